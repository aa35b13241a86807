"""Typed msgspec-msgpack codecs for the cross-process messages. No pickle ever touches a socket."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

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
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"received bytes that are not a valid {self._what}: {exc}") from None


def driver_message_codec() -> Codec[DriverMessage]:
    return Codec(DriverMessage, "driver message")


def worker_reply_codec() -> Codec[WorkerReply]:
    return Codec(WorkerReply, "worker reply")
