"""Wire messages: msgspec round trips of every message type, and garbage that must be a ProtocolError.

The codecs in tp_runtime.serialize promise that bytes which are not a valid message raise ProtocolError,
never anything else, and that no pickle ever touches a socket.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tp_runtime.errors import ProtocolError
from tp_runtime.messages import (
    CachedRequests,
    ControlCall,
    ExecuteModel,
    Logprobs,
    ModelRunnerOutput,
    NewRequest,
    RequestSampling,
    SchedulerOutput,
    Shutdown,
    WorkerReply,
)
from tp_runtime.serialize import driver_message_codec, worker_reply_codec

SAMPLING = RequestSampling(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    seed=2**62 + 3,
    min_tokens=2,
    stop_token_ids=[2, 7],
    num_logprobs=3,
)
SAMPLING_PLAIN = RequestSampling(1.0, 1.0, 0, 0.0, None, 0, [], -1)
NEW_1 = NewRequest(
    req_id=3, token_ids=[1, 2, 3, 299], num_output_tokens=0, sampling=SAMPLING, block_ids=[0, 1]
)
NEW_2 = NewRequest(
    req_id=8, token_ids=[5] * 40, num_output_tokens=7, sampling=SAMPLING_PLAIN, block_ids=[4, 9, 2]
)
CACHED = CachedRequests(req_ids=[1, 2, 5], new_block_ids=[[5], [], [6, 7]])
SCHED_NEW_AND_CACHED = SchedulerOutput(
    step_id=7,
    new_requests=[NEW_1, NEW_2],
    cached_requests=CACHED,
    scheduled_req_ids=[3, 8, 1, 2, 5],
    num_scheduled_tokens=[4, 40, 1, 1, 1],
    freed_req_ids=[0, 4],
)
SCHED_EMPTY = SchedulerOutput(0, [], CachedRequests([], []), [], [], [])
LOGPROBS = Logprobs(token_ids=[[11, 11, 4, 9], [3, 1, 3, 0]], logprobs=[[-0.5, -0.5, -1.25, -3.0]] * 2,
                    sampled_ranks=[1, 2])  # fmt: skip
OUT_PLAIN = ModelRunnerOutput(step_id=7, req_ids=[3, 8], sampled_token_ids=[11, 3])
OUT_FULL = ModelRunnerOutput(7, [3, 8], [11, 3], LOGPROBS, {"forward": 0.012, "sample": 1e-4})
OUT_TIMINGS_ONLY = ModelRunnerOutput(1, [], [], None, {"forward": 0.5})

# (message, the type a typed decoder expects)
ROUND_TRIPS: list[tuple[Any, Any]] = [
    (SAMPLING, RequestSampling),
    (SAMPLING_PLAIN, RequestSampling),
    (NEW_1, NewRequest),
    (CACHED, CachedRequests),
    (SCHED_NEW_AND_CACHED, SchedulerOutput),
    (SCHED_EMPTY, SchedulerOutput),
    (LOGPROBS, Logprobs),
    (OUT_PLAIN, ModelRunnerOutput),
    (OUT_FULL, ModelRunnerOutput),
    (OUT_TIMINGS_ONLY, ModelRunnerOutput),
    (ExecuteModel(SCHED_NEW_AND_CACHED), ExecuteModel),
    (ControlCall(4, "allocate_kv_cache", [128]), ControlCall),
    (Shutdown(), Shutdown),
    (WorkerReply(0, 7, "output", output=OUT_FULL), WorkerReply),
]

DRIVER_MESSAGES = [
    ExecuteModel(SCHED_NEW_AND_CACHED),
    ExecuteModel(SCHED_EMPTY),
    ControlCall(0, "determine_num_kv_blocks", []),
    ControlCall(4, "allocate_kv_cache", [128]),
    ControlCall(5, "debug_raise", ["boom"], all_ranks=False),
    ControlCall(6, "set_collect_timings", [True, 1.5, None, "x", [1, [2]], {"k": "v"}]),
    Shutdown(),
]
WORKER_REPLIES = [
    WorkerReply(rank=0, call_id=-1, kind="ready", result=4242),
    WorkerReply(0, 7, "output", output=OUT_PLAIN),
    WorkerReply(0, 7, "output", output=OUT_FULL),
    WorkerReply(0, 8, "output", output=OUT_TIMINGS_ONLY),
    WorkerReply(1, 3, "result", result=[1, 2.5, "a", None, True, {"nested": [1]}]),
    WorkerReply(1, 3, "result", result=None),
    WorkerReply(1, -1, "error", error="Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"),
]


@pytest.mark.parametrize("message,type_", ROUND_TRIPS, ids=lambda x: type(x).__name__)
def test_typed_round_trip(message: Any, type_: Any) -> None:
    data = msgspec.msgpack.encode(message)
    assert msgspec.msgpack.decode(data, type=type_) == message


@pytest.mark.parametrize("message", DRIVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_driver_codec_round_trip(message: Any) -> None:
    codec = driver_message_codec()
    back = codec.decode(codec.encode(message))
    assert type(back) is type(message)
    assert back == message
    assert codec.decode(memoryview(codec.encode(message))) == message


@pytest.mark.parametrize("reply", WORKER_REPLIES, ids=lambda r: r.kind)
def test_worker_reply_codec_round_trip(reply: WorkerReply) -> None:
    codec = worker_reply_codec()
    back = codec.decode(codec.encode(reply))
    assert back == reply
    if reply.output is not None:
        assert back.output == reply.output and back.output.logprobs == reply.output.logprobs


def test_round_trip_preserves_float_and_int_values_exactly() -> None:
    codec = worker_reply_codec()
    values = [0.1, 1e-300, -0.0, 2.0**-1074, 1.7976931348623157e308]
    out = ModelRunnerOutput(1, [2**63 - 1], [0], Logprobs([[0]], [values], [1]), {"t": 0.1})
    back = codec.decode(codec.encode(WorkerReply(0, 1, "output", output=out)))
    assert back.output is not None and back.output.logprobs is not None
    assert back.output.logprobs.logprobs[0] == values
    assert back.output.req_ids == [2**63 - 1]


# ----------------------------------------------------------------------------- garbage
class _RunsShellOnUnpickle:
    """A pickle payload that, if ever unpickled, runs a shell command creating `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _garbage(tmp_path: Path) -> dict[str, bytes]:
    rng = random.Random(1234)
    valid_driver = driver_message_codec().encode(ExecuteModel(SCHED_NEW_AND_CACHED))
    valid_reply = worker_reply_codec().encode(WorkerReply(0, 7, "output", output=OUT_FULL))
    marker = tmp_path / "pwned"
    return {
        "empty": b"",
        "junk": b"junk",
        "nul_garbage": b"\x00garbage",
        "random_1": bytes(rng.randrange(256) for _ in range(64)),
        "random_2": bytes(rng.randrange(256) for _ in range(1000)),
        "msgpack_int": msgspec.msgpack.encode(5),
        "msgpack_str": msgspec.msgpack.encode("hello"),
        "msgpack_map": msgspec.msgpack.encode({"rank": 0, "call_id": 1, "kind": "result"}),
        "unknown_reply_kind": msgspec.msgpack.encode([0, 1, "heartbeat", None, None, None]),
        "msgpack_wrong_array": msgspec.msgpack.encode([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        "msgpack_wrong_field_type": msgspec.msgpack.encode(["exec", [1.5]]),
        "unknown_tag": msgspec.msgpack.encode(["pickle", b"x"]),
        "truncated_driver": valid_driver[: len(valid_driver) // 2],
        "truncated_reply": valid_reply[:-1],
        "trailing_bytes": valid_reply + b"\x00",
        "huge_length_prefix": b"\xdd\xff\xff\xff\xff",
        "invalid_utf8": b"\x93\x00\x00\xa2\xff\xfe",
        "pickle_protocol_0": pickle.dumps(_RunsShellOnUnpickle(marker), protocol=0),
        "pickle_protocol_2": pickle.dumps(_RunsShellOnUnpickle(marker), protocol=2),
        "pickle_highest": pickle.dumps(_RunsShellOnUnpickle(marker), protocol=pickle.HIGHEST_PROTOCOL),
    }


@pytest.mark.parametrize("codec_name", ["driver", "reply"])
def test_garbage_raises_protocol_error(codec_name: str, tmp_path: Path) -> None:
    codec: Any = driver_message_codec() if codec_name == "driver" else worker_reply_codec()
    for name, data in _garbage(tmp_path).items():
        with pytest.raises(ProtocolError, match="not a valid") as info:
            codec.decode(data)
        assert ("driver message" if codec_name == "driver" else "worker reply") in str(info.value), name
    assert not (tmp_path / "pwned").exists(), "a pickle payload was executed"


def test_other_sides_messages_are_protocol_errors() -> None:
    """A worker reply sent to a worker (or a driver message to the driver) is the wrong shape."""
    for reply in WORKER_REPLIES:
        with pytest.raises(ProtocolError):
            driver_message_codec().decode(worker_reply_codec().encode(reply))
    for message in DRIVER_MESSAGES:
        with pytest.raises(ProtocolError):
            worker_reply_codec().decode(driver_message_codec().encode(message))


def test_pickle_payload_is_live_but_never_executed_by_the_codecs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsShellOnUnpickle(marker))
    for codec in (driver_message_codec(), worker_reply_codec()):
        with pytest.raises(ProtocolError):
            codec.decode(payload)  # type: ignore[attr-defined]
    assert not marker.exists()
    # Control: the payload really would run the command if something unpickled it.
    pickle.loads(payload)
    assert marker.exists()


def test_mutated_messages_never_raise_anything_but_protocol_error() -> None:
    """Bit flips, truncations and insertions of valid messages: each decodes to a valid message of the
    right type or raises ProtocolError."""
    rng = random.Random(0)
    driver, reply = driver_message_codec(), worker_reply_codec()
    cases: list[tuple[Any, bytes, tuple[type, ...]]] = [
        (driver, driver.encode(m), (ExecuteModel, ControlCall, Shutdown)) for m in DRIVER_MESSAGES
    ] + [(reply, reply.encode(r), (WorkerReply,)) for r in WORKER_REPLIES]
    for i in range(20000):
        codec, base, types = cases[i % len(cases)]
        data = bytearray(base)
        op = rng.random()
        if op < 0.4:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif op < 0.7:
            data = data[: rng.randrange(len(data))]
        else:
            k = rng.randrange(len(data) + 1)
            data = data[:k] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + data[k:]
        try:
            decoded = codec.decode(bytes(data))
        except ProtocolError:
            continue
        assert isinstance(decoded, types)


@pytest.mark.parametrize("where", ["WorkerReply.result", "ControlCall.args"])
def test_deeply_nested_garbage_is_a_protocol_error(where: str) -> None:
    """The `Any` fields (WorkerReply.result, ControlCall.args) accept any msgpack value, so a few KB of
    nested arrays make msgspec exceed the recursion limit; that must still surface as ProtocolError."""
    codec: Any = worker_reply_codec() if where == "WorkerReply.result" else driver_message_codec()

    def message(depth: int) -> bytes:
        nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
        if where == "WorkerReply.result":  # [0, 0, "result", nil, <nested>, nil]
            return b"\x96\x00\x00" + msgspec.msgpack.encode("result") + b"\xc0" + nested + b"\xc0"
        # ["call", 1, "check_health", [<nested>], true]
        head = b"\x95" + msgspec.msgpack.encode("call") + b"\x01" + msgspec.msgpack.encode("check_health")
        return head + b"\x91" + nested + b"\xc3"

    codec.decode(message(3))  # well-formed when shallow: only the depth is at issue below
    data = message(5000)
    with pytest.raises(ProtocolError):
        codec.decode(data)
