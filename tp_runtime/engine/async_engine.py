"""AsyncLLMEngine: one LLMEngine stepped by one thread, for front ends that run an asyncio event loop.

The engine thread is the only one that touches the LLMEngine (scheduler, executor, detokenizers). Front
ends only put commands on a thread-safe queue (`add`, `abort`) and read each request's outputs from a
`RequestStream`, which the engine thread feeds through `loop.call_soon_threadsafe`, once per step for
all the streams of one event loop. With no request in the engine the thread blocks on the queue: an idle
server costs no CPU.

A failure in a step (a dead or failing worker, a step timeout) is fatal: the thread records it, raises it
in every open stream, refuses new requests (`EngineClosedError` naming the cause) and shuts the engine
down; `error` tells health checks. `shutdown(grace_s)` drains: it refuses new requests, lets the ones in
the engine finish for up to `grace_s` seconds, aborts the rest (their streams end with finish_reason
"abort") and shuts the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tp_runtime.engine.llm_engine import LLMEngine
from tp_runtime.errors import EngineClosedError
from tp_runtime.outputs import RequestOutput
from tp_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's state after the engine thread's last iteration (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    # Requests finished so far, by finish reason ("abort": aborted, whether or not anyone was told).
    finished: tuple[tuple[str, int], ...] = ()


class RequestStream:
    """The outputs of the engine requests one front-end request added (its prompts, its n samples), in
    the order the engine gave them: `async for index, output in stream`, where `index` is the request's
    position in the list given to `AsyncLLMEngine.add`. Each output is a delta (`output.finished` on a
    request's last). The iteration ends once every request has finished, and raises the engine's error if
    the engine died. Read it on the event loop that created it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._unfinished = count
        # Engine thread only: the engine's request ids of this stream still running -> index.
        self._engine_ids: dict[str, int] = {}

    @property
    def finished(self) -> bool:
        """Every request has finished (or the stream raised)."""
        return self._unfinished == 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._unfinished == 0:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished = 0
            raise item
        if item[1].finished:
            self._unfinished -= 1
        return item


@dataclass
class _Add:
    stream: RequestStream
    requests: list[tuple[list[int], SamplingParams]]


@dataclass
class _Abort:
    stream: RequestStream


@dataclass
class _Stop:
    grace_s: float


_Command = _Add | _Abort | _Stop
_Item = tuple[int, RequestOutput] | BaseException  # what a stream's queue holds
_Batches = dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, _Item]]]


class AsyncLLMEngine:
    """Owns `engine` from `start()` on: no other thread may use it. `shutdown_engine` is what stops it at
    the end (default `engine.shutdown`; an `LLM`'s `shutdown` when the engine belongs to one)."""

    def __init__(self, engine: LLMEngine, shutdown_engine: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._shutdown_engine = shutdown_engine if shutdown_engine is not None else engine.shutdown
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Orders "refuse new requests" against "enqueue a request", so no request slips in after the
        # engine died or began to drain.
        self._lock = threading.Lock()
        self._accepting = True
        self._shut_down = False
        self._error: BaseException | None = None
        self._owners: dict[str, tuple[RequestStream, int]] = {}  # engine thread only
        self._drain_deadline: float | None = None
        self._finished: Counter[str] = Counter()  # engine thread only; published in `stats`
        self.stats = EngineStats(kv_blocks_total=engine.num_kv_blocks)
        self.iterations = 0  # of the engine thread's loop: tests check that an idle engine does not spin
        self._thread = threading.Thread(target=self._run, name="tp-runtime-engine", daemon=True)

    # ------------------------------------------------------------------ front-end side (any thread)
    def start(self) -> None:
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The error that killed the engine, None while it is healthy."""
        return self._error

    @property
    def accepting(self) -> bool:
        return self._accepting

    def add(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> RequestStream:
        """Queue engine requests (prompt ids, one-sample params), checked beforehand with
        `engine.check_request`; returns their stream, read on the calling event loop. Raises
        EngineClosedError once the engine died or began to shut down."""
        stream = RequestStream(asyncio.get_running_loop(), len(requests))
        with self._lock:
            if not self._accepting:
                raise self._closed_error()
            self._commands.put(_Add(stream, list(requests)))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (its reader went away); their KV blocks are freed at the
        engine thread's next iteration."""
        if not stream.finished:
            self._commands.put(_Abort(stream))

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Refuse new requests, let those in the engine run for up to `grace_s` seconds, abort the rest
        and shut the engine down; returns when that is done. Idempotent."""
        with self._lock:
            self._accepting = False
            first, self._shut_down = not self._shut_down, True
        if self._thread.ident is None:  # never started: the engine is still this thread's
            if first:
                self._shutdown_engine()
            return
        self._commands.put(_Stop(grace_s))  # a no-op for a thread that has ended
        self._thread.join()

    def _closed_error(self) -> EngineClosedError:
        if self._error is not None:
            return EngineClosedError(f"the engine died: {type(self._error).__name__}: {self._error}")
        return EngineClosedError("the engine is shutting down and takes no new requests")

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests() and self._drain_deadline is None
                for command in self._take(block=idle):
                    self._apply(command)
                if self._drain_deadline is not None and (
                    not engine.has_unfinished_requests() or time.monotonic() >= self._drain_deadline
                ):
                    self._abort_all()
                    break
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self._publish_stats()
                self.iterations += 1
        except BaseException as exc:
            self._fail(exc)
        finally:
            try:
                self._shutdown_engine()
            except Exception:
                logger.exception("shutting the engine down failed")
            self._publish_stats()

    def _take(self, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            stream = command.stream
            try:
                for index, (prompt_ids, params) in enumerate(command.requests):
                    req_id = str(engine.add_request(prompt_ids, params, stream=True))
                    stream._engine_ids[req_id] = index
                    self._owners[req_id] = (stream, index)
            except Exception as exc:  # checked by the front end already; keep the engine consistent
                self._drop(stream)
                self._send({stream.loop: [(stream, exc)]})
        elif isinstance(command, _Abort):
            self._drop(command.stream)
        else:
            self._drain_deadline = time.monotonic() + max(0.0, command.grace_s)

    def _drop(self, stream: RequestStream) -> None:
        """Abort a stream's requests without telling it (its reader is gone or gets an error)."""
        for req_id in stream._engine_ids:
            if self.engine.abort_request(int(req_id)) is not None:
                self._finished["abort"] += 1
            self._owners.pop(req_id, None)
        stream._engine_ids.clear()

    def _abort_all(self) -> None:
        """End every request, each stream getting its requests' last output (finish_reason "abort")."""
        outputs = []
        for req_id in list(self._owners):
            out = self.engine.abort_request(int(req_id))
            if out is not None:
                outputs.append(out)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: _Batches = {}
        owners = self._owners
        for out in outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue
            stream, index = owner
            if out.finished:
                self._finished[out.outputs[0].finish_reason or "unknown"] += 1
                del owners[out.request_id]
                del stream._engine_ids[out.request_id]
            batches.setdefault(stream.loop, []).append((stream, (index, out)))
        if batches:
            self._send(batches)

    @staticmethod
    def _send(batches: _Batches) -> None:
        # One wake-up of each event loop per step, whatever the number of its streams.
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody reads its streams
                loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, exc: BaseException) -> None:
        logger.error("the engine died: %s: %s", type(exc).__name__, exc)
        with self._lock:
            self._error = exc
            self._accepting = False
        streams = {stream for stream, _ in self._owners.values()}
        for command in self._take(block=False):  # requests queued before the engine stopped accepting
            if isinstance(command, _Add):
                streams.add(command.stream)
        self._owners.clear()
        batches: _Batches = {}
        for stream in streams:
            batches.setdefault(stream.loop, []).append((stream, exc))
        self._send(batches)

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        total = self.engine.num_kv_blocks
        self.stats = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=total - scheduler.kv.num_free_blocks,
            kv_blocks_total=total,
            num_preemptions=scheduler.num_preemptions,
            finished=tuple(self._finished.items()),
        )


def _put_all(items: list[tuple[RequestStream, _Item]]) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)
