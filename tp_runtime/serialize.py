"""Typed msgspec-msgpack codecs for the cross-process messages. No pickle ever touches a socket."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

import msgspec
import zmq

from tp_runtime.errors import ProtocolError
from tp_runtime.messages import DriverMessage, WorkerReply

T = TypeVar("T")


class Codec(Generic[T]):
    """Encoder plus a decoder that only yields `type_`; anything else is a ProtocolError."""

    def __init__(self, type_: type[T] | object, what: str) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        self._what = what

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise ProtocolError(f"received bytes that are not a valid {self._what}: {exc}") from None


def recv_spinning(sock: zmq.Socket[bytes], spin_s: float, block_ms: int) -> bytes | None:
    """Receive, busy-polling for up to spin_s first (a wake-up from a blocking wait costs tens of
    microseconds per hop), then blocking up to block_ms; None if nothing came."""
    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while True:
            try:
                return sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if time.perf_counter() > end:
                    break
    if sock.poll(block_ms):
        return sock.recv()
    return None


def driver_message_codec() -> Codec[DriverMessage]:
    return Codec(DriverMessage, "driver message")


def worker_reply_codec() -> Codec[WorkerReply]:
    return Codec(WorkerReply, "worker reply")
