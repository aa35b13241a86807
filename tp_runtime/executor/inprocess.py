"""TP=1 in the driver's own process: no sockets, no process group."""

from __future__ import annotations

from typing import Any

from tp_runtime.config import EngineConfig
from tp_runtime.executor.base import PendingSteps, size_kv_cache
from tp_runtime.messages import GrammarMask, ModelRunnerOutput, SchedulerOutput
from tp_runtime.worker.worker import Worker


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, rank=0, local_rank=0)
        self.last_step_timings: dict[str, float] = {}
        self.pending = PendingSteps()

    def initialize(self) -> int:
        self.worker.init_device(None)
        self.worker.load_model()
        return size_kv_cache(self)

    def submit(self, so: SchedulerOutput) -> None:
        launched = self.worker.execute_model(so)
        if launched is not None:  # else it waits for its grammar mask
            self.pending.add(launched)

    def submit_grammar_mask(self, mask: GrammarMask) -> None:
        self.pending.add(self.worker.apply_grammar_mask(mask))

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        return self.pending.resolve(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        return [self.worker.call(method, list(args or []))]

    def check_alive(self) -> None:
        """The one rank is this process."""

    def shutdown(self) -> None:
        self.worker.shutdown()

