"""Exceptions users can see. Each message says what to change."""

from __future__ import annotations


class TPRuntimeError(RuntimeError):
    """Base class for runtime failures raised by tp_runtime."""


class ConfigError(ValueError):
    """An engine argument or model config that tp_runtime cannot run with."""


class InvalidRequestError(ValueError):
    """A prompt or sampling parameter that cannot be served. `field`: the request's field at fault
    ("prompt"), where one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class WorkerDiedError(TPRuntimeError):
    """A worker process exited while the engine needed it."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"worker rank {rank} died: {detail}")
        self.rank = rank


class WorkerError(TPRuntimeError):
    """A worker raised an exception; carries the remote traceback text."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"worker rank {rank} raised an exception:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


class EngineClosedError(TPRuntimeError):
    """The engine was shut down, by the user or after a fatal error; create a new LLM."""


class StepTimeoutError(TPRuntimeError):
    """A call to the workers took longer than the configured timeout."""


class ProtocolError(TPRuntimeError):
    """Bytes on a socket that are not a valid tp_runtime message."""
