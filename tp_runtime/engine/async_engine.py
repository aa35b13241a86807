"""AsyncLLMEngine: one LLMEngine stepped by one thread, for front ends that run an asyncio event loop.

The engine thread is the only one that touches the LLMEngine (scheduler, executor, detokenizers). Front
ends only put commands on a thread-safe queue (`add`, `abort`) and read each request's outputs from a
`RequestStream`, which the engine thread feeds through `loop.call_soon_threadsafe`, once per step for
all the streams of one event loop. With no request in the engine the thread blocks on the queue, waking
every `idle_check_s` (1 s) only to ask the executor whether every worker is still alive
(`engine.check_alive()`, which sends nothing): an idle engine costs next to no CPU, and a worker that dies
while no request runs is still noticed within a second. While a decode step runs with nothing waiting, the
thread waits on the queue until shortly before that step ends (`engine.step_hold_s()`, engine/pacing.py),
so a request arriving meanwhile joins the next step rather than the one after.

A failure in a step or in that check (a dead or failing worker, a step timeout) is fatal: the thread logs
it once, in full (a worker's traceback included), records it, ends every open stream with an
`EngineClosedError` of its own that names the cause in one line (`describe_failure`, never a remote
traceback), refuses new requests the same way and shuts the engine down; `error` tells health checks.
`drain(grace_s)` begins a graceful shutdown without waiting: it refuses new requests, lets the ones in the
engine finish for up to `grace_s` seconds, then aborts the rest (each stream still gets its requests'
last output, finish_reason "abort") and shuts the engine down; `shutdown(grace_s)` does the same and
waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tp_runtime.engine.llm_engine import LLMEngine
from tp_runtime.errors import EngineClosedError, TPRuntimeError, WorkerError
from tp_runtime.outputs import RequestOutput
from tp_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0  # how often an idle engine thread checks that its workers are alive
_SUMMARY_CHARS = 200


def describe_failure(exc: BaseException) -> str:
    """One line for clients about what killed the engine: the exception's class and the first line of its
    message, or for a worker's exception the rank and the remote exception's class; never a traceback
    (the engine thread logs that on the server)."""
    if isinstance(exc, WorkerError):
        lines = [line.strip() for line in exc.remote_traceback.strip().splitlines() if line.strip()]
        match = re.match(r"([A-Za-z_][\w.]{0,80})(?::|$)", lines[-1]) if lines else None
        remote = match.group(1) if match else "an exception"
        return f"WorkerError: worker rank {exc.rank} failed ({remote}); see the server log"
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if len(first) > _SUMMARY_CHARS:
        first = first[: _SUMMARY_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's state after the engine thread's last iteration (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    # Prompt tokens looked up in the prefix cache, and found there, over the engine's life.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Requests finished so far, by finish reason ("abort": aborted, whether or not anyone was told).
    finished: tuple[tuple[str, int], ...] = ()


class RequestStream:
    """The outputs of the engine requests one front-end request added (its prompts, its n samples), in
    the order the engine gave them: `async for index, output in stream`, where `index` is the request's
    position in the list given to `AsyncLLMEngine.add`. Each output is a delta (`output.finished` on a
    request's last). The iteration ends once every request has finished, and raises an EngineClosedError
    (its own, naming the cause in one line) if the engine died. Read it on the event loop that created
    it."""

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
    cache_salt: str | None = None


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
    the end (default `engine.shutdown`; an `LLM`'s `shutdown` when the engine belongs to one).
    `idle_check_s`: how often the idle thread checks the workers' liveness."""

    def __init__(
        self,
        engine: LLMEngine,
        shutdown_engine: Callable[[], None] | None = None,
        idle_check_s: float = IDLE_CHECK_S,
    ) -> None:
        self.engine = engine
        self.idle_check_s = idle_check_s
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
        # Of the engine thread's loop (an idle one counts one per liveness check): tests check that an idle
        # engine does not spin.
        self.iterations = 0
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

    def add(
        self, requests: Sequence[tuple[list[int], SamplingParams]], cache_salt: str | None = None
    ) -> RequestStream:
        """Queue engine requests (prompt ids, one-sample params), checked beforehand with
        `engine.check_request`; returns their stream, read on the calling event loop. `cache_salt`: theirs
        (LLMEngine.add_request's). Raises EngineClosedError once the engine died or began to shut down."""
        stream = RequestStream(asyncio.get_running_loop(), len(requests))
        with self._lock:
            if not self._accepting:
                raise self._closed_error()
            self._commands.put(_Add(stream, list(requests), cache_salt))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (its reader went away); their KV blocks are freed at the
        engine thread's next iteration."""
        if not stream.finished:
            self._commands.put(_Abort(stream))

    def drain(self, grace_s: float) -> None:
        """Begin a graceful shutdown and return at once: refuse new requests, let those in the engine run
        for up to `grace_s` seconds, then abort the rest (their streams end with finish_reason "abort")
        and shut the engine down. Call it from the event loop or any thread, not from a signal handler
        (it takes a lock the interrupted code may hold). A later call (or `shutdown`) with a shorter grace
        period brings the deadline forward, never back."""
        with self._lock:
            self._accepting = False
        if self._thread.ident is not None:
            self._commands.put(_Stop(grace_s))  # a no-op for a thread that has ended

    def shutdown(self, grace_s: float = 0.0) -> None:
        """`drain(grace_s)`, then wait until the engine is shut down. Idempotent."""
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
            return _died(self._error)
        return EngineClosedError("the engine is shutting down and takes no new requests")

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests() and self._drain_deadline is None
                if idle:
                    commands = self._take(self.idle_check_s)
                else:
                    # A request that comes while the device still runs a decode step joins the next one.
                    commands = self._take(engine.step_hold_s() if self._drain_deadline is None else 0.0)
                if idle and not commands:  # nothing to do for idle_check_s: are the workers alive?
                    engine.check_alive()
                for command in commands:
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

    def _take(self, timeout: float) -> list[_Command]:
        """The commands queued, waiting up to `timeout` seconds for the first ([] if none came)."""
        commands = []
        if timeout > 0:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return []
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
                    added = engine.add_request(prompt_ids, params, stream=True, cache_salt=command.cache_salt)
                    req_id = str(added)
                    stream._engine_ids[req_id] = index
                    self._owners[req_id] = (stream, index)
            except Exception as exc:  # checked by the front end already; keep the engine consistent
                self._drop(stream)
                self._send({stream.loop: [(stream, exc)]})
        elif isinstance(command, _Abort):
            self._drop(command.stream)
        else:
            deadline = time.monotonic() + max(0.0, command.grace_s)
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline

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
        # Logged once, in full (a WorkerError's message holds the worker's traceback; a bug's traceback is
        # its own); clients only ever see describe_failure's line.
        logger.error(
            "the engine died: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, TPRuntimeError)
        )
        with self._lock:
            self._error = exc
            self._accepting = False
        streams = {stream for stream, _ in self._owners.values()}
        for command in self._take(0.0):  # requests queued before the engine stopped accepting
            if isinstance(command, _Add):
                streams.add(command.stream)
        self._owners.clear()
        batches: _Batches = {}
        for stream in streams:  # each its own exception: every reader raises (and so mutates) the one it gets
            batches.setdefault(stream.loop, []).append((stream, _died(exc)))
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
            prefix_cache_queries=scheduler.kv.num_queried_tokens,
            prefix_cache_hits=scheduler.kv.num_hit_tokens,
            finished=tuple(self._finished.items()),
        )


def _died(cause: BaseException) -> EngineClosedError:
    error = EngineClosedError(f"the engine died: {describe_failure(cause)}")
    error.__cause__ = cause
    return error


def _put_all(items: list[tuple[RequestStream, _Item]]) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)
