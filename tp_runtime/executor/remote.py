"""Sending to and waiting on remote ranks, shared by the spawned and the torchrun executors."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tp_runtime.errors import (
    ConfigError,
    EngineClosedError,
    ProtocolError,
    StepTimeoutError,
    WorkerDiedError,
    WorkerError,
)
from tp_runtime.executor.base import CLOSED_MESSAGE
from tp_runtime.ipc import HEARTBEAT_TIMEOUT_S, LIVENESS_POLL_MS, DriverChannel, stalled_error
from tp_runtime.messages import (
    DriverMessage,
    Hello,
    ModelRunnerOutput,
    WorkerReply,
    first_outside,
)
from tp_runtime.serialize import (
    recv_spinning,
)

# Why an engine closed by a Ctrl-C during a step refuses its next call (RemoteWorkers.closed_message).
INTERRUPTED_MESSAGE = "the engine was closed by a KeyboardInterrupt (Ctrl-C) during a step; create a new LLM"


@dataclass
class _Expected:
    """The replies a wait collects: `kind` ("result" / "ready") for `call_id` from `ranks`."""

    call_id: int
    kind: str
    ranks: set[int]
    results: dict[int, Any] = field(default_factory=dict)


def _output_problem(
    out: ModelRunnerOutput, scheduled: frozenset[int] | None = None, vocab_size: int | None = None
) -> str | None:
    """What is inconsistent in an output, if anything: its lists must agree in length, and with what is
    known, its requests must be distinct requests the step ran (`scheduled`) and its token ids in the
    vocabulary (`vocab_size`). The driver indexes its requests and the tokenizer with them."""
    n = len(out.req_ids)
    if len(out.sampled_token_ids) != n:
        return f"has {n} request ids but {len(out.sampled_token_ids)} sampled token ids"
    if scheduled is not None:
        named = set(out.req_ids)
        if len(named) != n:
            return "names a request twice"
        named.update(p.req_id for p in out.prompt_logprobs or [])
        if not named <= scheduled:
            return f"has request {min(named - scheduled)}, which the step did not run"
    if vocab_size is not None:
        id_lists = [out.sampled_token_ids, *(out.logprobs.token_ids if out.logprobs else [])]
        id_lists += [ids for p in out.prompt_logprobs or [] for ids in p.token_ids]
        for ids in id_lists:
            token = first_outside(ids, 0, vocab_size)
            if token is not None:
                return f"has token id {token}, outside the vocabulary [0, {vocab_size})"
    lp = out.logprobs
    if lp is not None:
        for name in ("token_ids", "logprobs", "sampled_ranks"):
            rows = len(getattr(lp, name))
            if rows != n:
                return f"has {n} request ids but {rows} rows of logprobs.{name}"
        for i, (ids, values) in enumerate(zip(lp.token_ids, lp.logprobs, strict=True)):
            if len(ids) != len(values):
                return f"has {len(ids)} token ids but {len(values)} logprobs in logprob row {i}"
    for p in getattr(out, "prompt_logprobs", None) or []:
        lengths = {len(p.token_ids), len(p.logprobs), len(p.ranks)}
        if len(lengths) > 1 or any(len(a) != len(b) for a, b in zip(p.token_ids, p.logprobs, strict=True)):
            return f"has prompt logprobs of request {p.req_id} whose lists differ in length"
    return None


# Start-up greetings: the first soon, then at most one a second.
_FIRST_HELLO_INTERVAL_S = 0.02
_LAST_HELLO_INTERVAL_S = 1.0


class RemoteWorkers:
    """Sends to and waits on remote ranks; subclasses say how to tell whether a rank is alive.

    Steps are tracked from submission to answer: rank 0 answers each step once, in the order they were
    sent, so an authentic output for any other step is a ProtocolError, never something to wait past."""

    settle_s = 0.5  # how long an error reply waits for a rank's death to show (the dead rank is named)

    def __init__(
        self,
        channel: DriverChannel,
        remote_ranks: list[int],
        spin_wait_s: float,
        vocab_size: int | None = None,
    ) -> None:
        self.channel = channel
        self.vocab_size = vocab_size  # when known, sampled token ids outside [0, vocab_size) are refused
        self.remote_ranks = remote_ranks
        self.spin_wait_s = spin_wait_s
        self.closed = False
        self.closed_message = CLOSED_MESSAGE  # what a call once closed raises (EngineClosedError)
        # Steps sent and not answered yet, oldest first, with the requests each runs (None: not told).
        self.in_flight: dict[int, frozenset[int] | None] = {}
        self.arrived: dict[int, ModelRunnerOutput] = {}  # answered, not asked for yet
        self.abandoned: set[int] = set()  # in flight but no longer wanted (their requests were aborted)
        self.answered: deque[int] = deque(maxlen=64)  # to tell a duplicate from a step never sent
        self.stopped_since: dict[int, float] = {}  # ranks seen stopped by a signal, since when

    def _check_processes(self, settle_s: float) -> None:
        """Raise WorkerDiedError for a rank that is gone (waiting up to settle_s for one to go)."""

    def _stopped(self, rank: int) -> bool:
        """Whether the rank's process is known to be stopped by a signal (only for local processes)."""
        return False

    def _maybe_busy(self, rank: int) -> bool:
        """Whether a silent rank may just be busy holding the GIL (a long compile, say), not stuck."""
        return False

    def check_alive(self, settle_s: float = 0.0) -> None:
        if self.closed:
            raise EngineClosedError(self.closed_message)
        self._check_processes(settle_s)
        for rank, silent_s in self.channel.watchdog.late().items():
            if not self._maybe_busy(rank):
                state = "it is stopped by a signal" if self._stopped(rank) else "it is stopped or hung"
                raise stalled_error(rank, silent_s, state)
        # Before its heartbeats are watched (start-up, the model load), a rank stopped this long.
        now = time.monotonic()
        watched = self.channel.watchdog.watched
        for rank in self.remote_ranks:
            if rank in watched or not self._stopped(rank):
                self.stopped_since.pop(rank, None)
            elif now - self.stopped_since.setdefault(rank, now) >= HEARTBEAT_TIMEOUT_S:
                raise stalled_error(rank, now - self.stopped_since[rank], "it is stopped by a signal")

    def broadcast(self, message: DriverMessage) -> None:
        self.channel.send(message)

    def submitted(self, step_id: int, scheduled_req_ids: list[int] | None = None) -> None:
        """A step was sent; with `scheduled_req_ids`, its answer may name only those requests."""
        self.in_flight[step_id] = None if scheduled_req_ids is None else frozenset(scheduled_req_ids)

    def _serve(
        self,
        done: Callable[[], bool],
        expected: _Expected | None,
        timeout_s: float,
        quiet_timeout: bool = False,
    ) -> None:
        """Handle replies until done(); a worker error, a death or the timeout raises (the timeout only
        returns with quiet_timeout)."""
        start = time.monotonic()
        deadline, next_check = start + timeout_s, start + LIVENESS_POLL_MS / 1000
        pull, reader, spin_s = self.channel.pull, self.channel.reader, self.spin_wait_s
        while not done():
            data = recv_spinning(pull, spin_s, LIVENESS_POLL_MS)
            if data is not None:
                opened = reader.read(data)
                if opened is not None:
                    self._handle(*opened, expected)
            now = time.monotonic()
            # Checked on every pass, not only when the socket is quiet: a flood of frames must not
            # postpone the timeout or the liveness checks.
            if data is None or now >= next_check:
                next_check = now + LIVENESS_POLL_MS / 1000
                self.channel.discard_inbound()
                reader.drops.flush()
                self.check_alive()
            if now > deadline and not done():
                if quiet_timeout:
                    return
                raise self._timeout(expected, timeout_s)

    def _handle(self, sender: int, reply: WorkerReply, expected: _Expected | None) -> None:
        if reply.rank != sender:
            raise ProtocolError(f"a reply signed by rank {sender} says it comes from rank {reply.rank}")
        if reply.kind == "error":
            if reply.config_error is not None:
                # A checkpoint or config the user must fix, found by every rank alike: whichever rank has
                # exited by now, this is why.
                raise ConfigError(reply.config_error)
            error = WorkerError(reply.rank, reply.error or "(no traceback)")
            # A rank that died takes its peers' collectives down with it; name the dead rank, not the
            # survivor whose all-reduce failed. A rank that reported an error and then exited died of it:
            # its traceback says why.
            try:
                self.check_alive(settle_s=self.settle_s)
            except WorkerDiedError as died:
                if died.rank == reply.rank:
                    raise error from None
                raise
            raise error
        if reply.kind == "output":
            self._accept_output(reply)
            return
        if (
            expected is not None
            and reply.kind == expected.kind
            and reply.call_id == expected.call_id
            and reply.rank in expected.ranks
        ):
            if reply.rank in expected.results:
                raise ProtocolError(f"rank {reply.rank} sent its {reply.kind} of call {reply.call_id} twice")
            expected.results[reply.rank] = reply.result
            return
        waiting = f"; waiting for the {expected.kind} of call {expected.call_id}" if expected else ""
        raise ProtocolError(
            f"rank {reply.rank} sent an unexpected {reply.kind!r} reply for call {reply.call_id}{waiting}"
        )

    def _accept_output(self, reply: WorkerReply) -> None:
        step, out = reply.call_id, reply.output
        if reply.rank != 0:
            raise ProtocolError(f"rank {reply.rank} sent an output (step {step}); only rank 0 answers steps")
        if out is None or out.step_id != step:
            carried = "no output" if out is None else f"the output of step {out.step_id}"
            raise ProtocolError(f"rank 0's reply for step {step} carries {carried}")
        if step not in self.in_flight:
            if step in self.answered:
                raise ProtocolError(f"rank 0 answered step {step} twice (a duplicate reply)")
            raise ProtocolError(
                f"rank 0 answered step {step}, which is not in flight (in flight: {list(self.in_flight)})"
            )
        oldest = next(iter(self.in_flight))
        if step != oldest:
            raise ProtocolError(
                f"rank 0 answered step {step} before step {oldest} (steps are answered in the order sent)"
            )
        problem = _output_problem(out, self.in_flight[step], self.vocab_size)
        if problem is not None:
            raise ProtocolError(f"rank 0's output of step {step} {problem}")
        del self.in_flight[step]
        self.answered.append(step)
        if step in self.abandoned:
            self.abandoned.discard(step)
        else:
            self.arrived[step] = out

    def _timeout(self, expected: _Expected | None, timeout_s: float) -> StepTimeoutError:
        missing = sorted(expected.ranks - expected.results.keys()) if expected else [0]
        stalled = {r: f"sent no heartbeat for {age:.1f} s" for r, age in self.channel.watchdog.silent.items()}
        stalled.update({r: "is stopped by a signal" for r in self.remote_ranks if self._stopped(r)})
        if stalled:
            who = "the stalled rank: " + ", ".join(f"rank {r} {why}" for r, why in sorted(stalled.items()))
        else:
            who = (
                "the stalled rank is unknown (every rank still sends heartbeats: the step is slower than the "
                "timeout, or a rank is stuck inside a collective)"
            )
        return StepTimeoutError(
            f"no reply from rank(s) {missing} within {timeout_s:g} s; {who}. One slow or stuck rank stalls "
            "every rank of the group; raise step_timeout_s if steps are expected to take this long"
        )

    def wait_replies(self, call_id: int, kind: str, ranks: set[int], timeout_s: float) -> dict[int, Any]:
        """Replies of `kind` for `call_id` from `ranks`; a worker error or death raises at once."""
        expected = _Expected(call_id, kind, ranks)
        self._serve(lambda: len(expected.results) == len(ranks), expected, timeout_s)
        return expected.results

    def wait_output(self, step_id: int, timeout_s: float) -> ModelRunnerOutput:
        for older in [s for s in self.in_flight if s < step_id]:  # steps of aborted requests
            self.abandoned.add(older)
        for older in [s for s in self.arrived if s < step_id]:
            del self.arrived[older]
        if step_id not in self.arrived and step_id not in self.in_flight:
            raise RuntimeError(f"internal: step {step_id} was never submitted")
        arrived = self.arrived
        self._serve(lambda: step_id in arrived, None, timeout_s)
        return arrived.pop(step_id)

    def poll_errors(self) -> None:
        """Handle whatever replies are waiting, without waiting (torchrun: only errors can be)."""
        reader = self.channel.reader
        while self.channel.pull.poll(0):
            opened = reader.read(self.channel.pull.recv())
            if opened is not None:
                self._handle(*opened, None)

    def wait_ready(self, timeout_s: float) -> dict[int, Any]:
        """Greet the ranks until each has answered READY (its pid). A rank answers the first Hello that
        reaches it, so afterwards every rank's subscription to the broadcast works: no later broadcast is
        lost to a late subscriber, and a subscriber that is not a rank cannot stand in for one."""
        expected = _Expected(-1, "ready", set(self.remote_ranks))
        deadline = time.monotonic() + timeout_s
        interval = _FIRST_HELLO_INTERVAL_S
        while len(expected.results) < len(expected.ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StepTimeoutError(
                    f"rank(s) {sorted(expected.ranks - expected.results.keys())} did not start within "
                    f"{timeout_s:g} s (startup_timeout_s); raise it if the ranks start this slowly"
                )
            self.broadcast(Hello())
            done = lambda: len(expected.results) == len(expected.ranks)  # noqa: E731
            self._serve(done, expected, min(interval, remaining), quiet_timeout=True)
            # Ranks that load a large model receive (and drop) every Hello sent meanwhile: keep them few.
            interval = min(2 * interval, _LAST_HELLO_INTERVAL_S)
        self.channel.watchdog.watch(self.remote_ranks)
        return expected.results
