"""What an executor provides (how the driver reaches its workers), the factory that picks one, and what the
executors share."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tp_runtime.config import EngineConfig, torchrun_rank
from tp_runtime.errors import (
    ConfigError,
)
from tp_runtime.messages import GrammarMask, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # a local rank's pending step (in-process, torchrun rank 0)
    from tp_runtime.worker.outputs import PendingOutput

CLOSED_MESSAGE = "the engine was shut down (after an error, or by shutdown()); create a new LLM"
T = TypeVar("T")


class Executor(Protocol):
    # Driver-side timings of the last submit (seconds), for the benchmark's step breakdown.
    last_step_timings: dict[str, float]

    def initialize(self) -> int:
        """Load the model on every rank and allocate the KV cache; returns the number of KV blocks."""
        ...

    def submit(self, so: SchedulerOutput) -> None:
        """Send a step to every rank; returns without waiting for its output."""
        ...

    def submit_grammar_mask(self, mask: GrammarMask) -> None:
        """Send the grammar mask of a submitted step that was sent with grammar_mask_follows."""
        ...

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        """Rank 0's output of a submitted step (steps are answered in the order they were submitted)."""
        ...

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Run a worker control method on every rank; results in rank order."""
        ...

    def check_alive(self) -> None:
        """Raise (WorkerDiedError, StepTimeoutError, EngineClosedError) if a rank is dead or stalled,
        without sending anything: what an idle engine polls."""
        ...

    def shutdown(self) -> None: ...



class PendingSteps:
    """Steps queued on an in-process worker, resolved in order (older ones are dropped when a newer one is
    asked for: their requests were aborted)."""

    def __init__(self) -> None:
        self.steps: dict[int, PendingOutput] = {}

    def add(self, pending: PendingOutput) -> None:
        self.steps[pending.step_id] = pending

    def resolve(self, step_id: int) -> ModelRunnerOutput:
        for older in [s for s in self.steps if s < step_id]:
            del self.steps[older]
        pending = self.steps.pop(step_id, None)
        if pending is None:
            raise RuntimeError(f"internal: step {step_id} was never submitted")
        return pending.resolve()


def size_kv_cache(executor: Executor) -> int:
    num_blocks = int(executor.collective_rpc("determine_num_kv_blocks")[0])
    executor.collective_rpc("allocate_kv_cache", [num_blocks])
    return num_blocks



def executor_kind(config: EngineConfig) -> str:
    kind = config.parallel.executor
    if kind == "auto":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if torchrun_rank() is not None and (world > 1 or config.parallel.tensor_parallel_size > 1):
            return "torchrun"
        return "inprocess" if config.parallel.tensor_parallel_size == 1 else "multiprocess"
    if kind == "torchrun" and torchrun_rank() is None:
        raise ConfigError(
            "executor='torchrun' needs a torchrun job (RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID set by "
            "torchrun); start it with scripts/launch_tp.sh or torchrun"
        )
    return kind


def make_executor(config: EngineConfig) -> Executor:
    # Imported here: each executor module imports this one.
    from tp_runtime.executor.inprocess import InProcessExecutor
    from tp_runtime.executor.multiproc import MultiprocExecutor
    from tp_runtime.executor.torchrun import connect_torchrun_driver

    kind = executor_kind(config)
    if kind == "inprocess":
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError("executor='inprocess' only runs tensor_parallel_size=1")
        return InProcessExecutor(config)
    if kind == "multiprocess":
        return MultiprocExecutor(config)
    rank = torchrun_rank()
    if rank is not None and rank > 0:
        raise ConfigError(
            f"this is rank {rank} of a torchrun job: only rank 0 creates the LLM (it hosts the driver); on "
            "every other rank call tp_runtime.run_torchrun_worker(...) with the same engine arguments"
        )
    return connect_torchrun_driver(config)

