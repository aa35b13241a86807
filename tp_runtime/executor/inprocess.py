"""TP=1 in the driver's own process: no sockets, no process group."""

from __future__ import annotations

import threading
from typing import Any

from tp_runtime.config import EngineConfig
from tp_runtime.errors import EngineClosedError
from tp_runtime.executor.base import CLOSED_MESSAGE, PendingSteps, size_kv_cache
from tp_runtime.messages import GrammarMask, ModelRunnerOutput, SchedulerOutput
from tp_runtime.worker.worker import Worker


class InProcessExecutor:
    """The worker's calls take one lock, and `shutdown()` takes it too: from another thread it waits for
    the call in progress (a step), and every later call raises EngineClosedError, as the multiprocess
    executor's do (it had dropped the weights under the running step: an internal error)."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, rank=0, local_rank=0)
        self.last_step_timings: dict[str, float] = {}
        self.pending = PendingSteps()
        self._lock = threading.RLock()
        self._shut_down = False

    def _open_worker(self) -> Worker:
        if self._shut_down:
            raise EngineClosedError(CLOSED_MESSAGE)
        return self.worker

    def initialize(self) -> int:
        with self._lock:
            self._open_worker().init_device(None)
            self.worker.load_model()
        return size_kv_cache(self)

    def submit(self, so: SchedulerOutput) -> None:
        with self._lock:
            launched = self._open_worker().execute_model(so)
        if launched is not None:  # else it waits for its grammar mask
            self.pending.add(launched)

    def submit_grammar_mask(self, mask: GrammarMask) -> None:
        with self._lock:
            self.pending.add(self._open_worker().apply_grammar_mask(mask))

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        with self._lock:
            self._open_worker()
            return self.pending.resolve(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        with self._lock:
            return [self._open_worker().call(method, list(args or []))]

    def check_alive(self) -> None:
        """The one rank is this process."""
        with self._lock:
            self._open_worker()

    def shutdown(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self.worker.shutdown()
