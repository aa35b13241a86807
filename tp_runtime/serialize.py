"""Typed msgspec-msgpack codecs for the cross-process messages, and the authenticated frames that carry
them. No pickle ever touches a socket.

Frames. Every frame on a driver<->worker socket is `MAC (32 bytes) | sender (u32) | seq (u64) | body`,
with MAC = HMAC-SHA256 over everything after it, under a key derived from the engine's key for that
channel (broadcast, replies, heartbeats), so a frame of one channel is never valid on another. The engine's
key is 32 random bytes made by the driver and handed to spawned workers through their
stdin pipe (never a command line, an environment variable or a socket); under torchrun it is derived from
the shared secret and a per-job nonce. Each sender numbers its frames 1, 2, 3 ... and a receiver accepts
only a number above the last one it accepted from that sender: a replayed, duplicated or reordered frame
is dropped like a forged one. A frame that fails any check is dropped and logged (rate-limited); it never
reaches the msgpack decoder.

Why every frame carries an HMAC, and TCP sockets also run ZeroMQ's CURVE (below):
- the HMAC needs no key exchange to design: the key travels with the spawn arguments (or is derived from
  the torchrun secret), and it authenticates messages, which replay and duplicate detection need;
- ipc sockets sit in a 0700 folder, so only this user reaches them, and need nothing more;
- on TCP (torchrun across hosts) anyone on the network could otherwise connect: CURVE, with the driver's
  key pair derived from the job key, turns away a peer that lacks the key at the handshake, before it can
  read a broadcast (prompts' token ids) or queue a frame for the driver to verify.
- cost: SHA-256 of the frame plus about 1 µs, per side (SHA-256 runs at ~1.7 GB/s with SHA-NI).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.utils.z85

from tp_runtime.errors import ConfigError, ProtocolError
from tp_runtime.messages import DriverMessage, WorkerReply

T = TypeVar("T")
logger = logging.getLogger("tp_runtime.transport")

# Channels: each has its own derived key.
BROADCAST = b"broadcast"  # driver -> every worker
REPLIES = b"replies"  # workers -> driver
HEARTBEATS = b"heartbeats"  # each worker's heartbeat thread -> driver's watchdog
# Each worker sends an authenticated heartbeat this often (its own thread and socket), so the driver can
# tell a stopped or hung rank from a slow step, and name it, even when its collectives block every rank.
HEARTBEAT_INTERVAL_S = 0.5
DRIVER_ID = 0xFFFF_FFFF  # sender id of the driver; workers use their rank

_MAC_LEN = 32
_HEADER = struct.Struct("<IQ")  # sender, seq
FRAME_OVERHEAD = _MAC_LEN + _HEADER.size


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


def driver_message_codec() -> Codec[DriverMessage]:
    return Codec(DriverMessage, "driver message")


def worker_reply_codec() -> Codec[WorkerReply]:
    return Codec(WorkerReply, "worker reply")


# ----------------------------------------------------------------------------------------------- keys
def channel_key(key: bytes, channel: bytes) -> bytes:
    if len(key) < 16:
        raise ValueError("internal: a frame key must have at least 16 bytes")
    return hmac.digest(key, b"tp-runtime frame key/" + channel, "sha256")


def derive_job_key(secret: bytes | None, nonce: bytes) -> bytes:
    """The key of one torchrun job: the nonce (random, from rank 0) keyed by the shared secret, so frames
    of another job using the same secret are rejected too. Without a secret the nonce is the key."""
    return nonce if secret is None else hmac.digest(secret, b"tp-runtime job key/" + nonce, "sha256")


def key_check(key: bytes) -> bytes:
    """A value ranks compare to find out whether they hold the same key (reveals nothing about it)."""
    return hmac.digest(key, b"tp-runtime key check", "sha256")


# ---------------------------------------------------------------------------------- TCP transport keys
# On TCP (a torchrun job across hosts; ranks all on one host use ipc sockets) the driver's sockets are
# reachable from the network: they also run CurveZMQ, with the driver's key pair derived from the job
# key. A peer that does not hold the job key cannot complete a handshake, so it can neither read the
# broadcasts (prompts' token ids) nor queue frames on the driver's sockets. Every frame is still
# authenticated as on ipc sockets.


def _curve_server_keys(key: bytes) -> tuple[bytes, bytes]:
    """The driver's CURVE (public, secret) key pair, Z85-encoded, derived from the job key."""
    secret = zmq.utils.z85.encode(hmac.digest(key, b"tp-runtime curve server key", "sha256"))
    return zmq.curve_public(secret), secret


# libzmq's size limit counts what CURVE adds to every message, and applies to its handshake commands
# (HELLO, WELCOME, INITIATE with metadata, READY): a socket that otherwise receives nothing (or only tiny
# frames) must still take these.
_CURVE_MESSAGE_BYTES = 33
_CURVE_HANDSHAKE_BYTES = 1024


def _room_for_curve(sock: zmq.Socket[bytes]) -> None:
    limit = int(sock.getsockopt(zmq.MAXMSGSIZE))
    if limit >= 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max(limit + _CURVE_MESSAGE_BYTES, _CURVE_HANDSHAKE_BYTES))


def check_curve() -> None:
    """Raise a ConfigError when this pyzmq cannot run CURVE, which TCP sockets need."""
    if not zmq.has("curve"):
        raise ConfigError(
            "this pyzmq's libzmq has no CURVE security, which the engine's TCP sockets need; install a pyzmq "
            "wheel built with libsodium (the PyPI wheels are)"
        )


def secure_server(sock: zmq.Socket[bytes], address: str, key: bytes) -> None:
    """Make a driver socket about to bind `address` a CURVE server when the address is TCP."""
    if address.startswith("tcp://"):
        check_curve()
        _room_for_curve(sock)
        public, secret = _curve_server_keys(key)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True


def secure_client(sock: zmq.Socket[bytes], address: str, key: bytes) -> None:
    """Make a worker socket about to connect to `address` a CURVE client of the driver when it is TCP."""
    if address.startswith("tcp://"):
        check_curve()
        _room_for_curve(sock)
        sock.curve_serverkey = _curve_server_keys(key)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


# --------------------------------------------------------------------------------------------- frames
class FrameRejected(Exception):
    """Internal: a frame that is dropped (not authentic, replayed, malformed); the message says why."""


class _HmacSha256:
    """HMAC-SHA256 (RFC 2104) from precomputed inner and outer SHA-256 states: the same MAC as
    hmac.digest(key, data, "sha256"), at about half the cost per frame of copying OpenSSL's HMAC
    context (OpenSSL 3 copies three EVP contexts per HMAC copy)."""

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(padded.translate(hmac.trans_36))
        self._outer = hashlib.sha256(padded.translate(hmac.trans_5C))

    def digest(self, *parts: bytes | memoryview) -> bytes:
        inner = self._inner.copy()
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class Signer:
    """Seals frames from one sender on one channel, numbering them 1, 2, 3 ..."""

    def __init__(self, key: bytes, channel: bytes, sender: int) -> None:
        self._mac = _HmacSha256(channel_key(key, channel))
        self.sender = sender
        self.seq = 0

    def seal(self, body: bytes) -> bytes:
        self.seq += 1
        header = _HEADER.pack(self.sender, self.seq)
        return b"".join((self._mac.digest(header, body), header, body))


class Verifier:
    """Opens frames of one channel: checks the MAC, then that the sender's sequence number advanced.
    Rejected frames raise FrameRejected and are counted on `drops`."""

    def __init__(self, key: bytes, channel: bytes, where: str) -> None:
        self._mac = _HmacSha256(channel_key(key, channel))
        self.last_seq: dict[int, int] = {}  # only senders that hold the key get an entry
        self.drops = DropLog(where)

    def open(self, frame: bytes) -> tuple[int, memoryview]:
        """(sender, body) of an authentic, fresh frame."""
        if len(frame) < FRAME_OVERHEAD:
            raise self._reject(f"a {len(frame)}-byte frame is shorter than a frame header")
        view = memoryview(frame)
        if not hmac.compare_digest(self._mac.digest(view[_MAC_LEN:]), view[:_MAC_LEN]):
            raise self._reject("bad MAC (not from this engine's processes)")
        sender, seq = _HEADER.unpack_from(frame, _MAC_LEN)
        last = self.last_seq.get(sender, 0)
        if seq <= last:
            raise self._reject(f"replayed or out-of-order frame from sender {sender} (seq {seq} <= {last})")
        self.last_seq[sender] = seq
        return sender, view[FRAME_OVERHEAD:]

    def _reject(self, reason: str) -> FrameRejected:
        self.drops.note(reason)
        return FrameRejected(reason)


class DropLog:
    """Rate-limited log of dropped frames: at most one line per interval, with the count since the last."""

    def __init__(self, where: str, interval_s: float = 1.0) -> None:
        self.where = where
        self.interval_s = interval_s
        self.total = 0
        self.pending = 0
        self.last_reason = ""
        self._logged_at = -float("inf")

    def note(self, reason: str) -> None:
        self.total += 1
        self.pending += 1
        self.last_reason = reason
        self.flush()

    def flush(self) -> None:
        """Log the drops not logged yet, if the interval has passed (callers also call this when idle)."""
        now = time.monotonic()
        if self.pending and now - self._logged_at >= self.interval_s:
            logger.warning(
                "dropped %d frame(s) on %s (%d in all); last: %s",
                self.pending, self.where, self.total, self.last_reason,
            )  # fmt: skip
            self.pending = 0
            self._logged_at = now


class FrameWriter(Generic[T]):
    """Encodes a typed message and seals it."""

    def __init__(self, codec: Codec[T], key: bytes, channel: bytes, sender: int) -> None:
        self.codec = codec
        self.signer = Signer(key, channel, sender)

    def encode(self, message: T) -> bytes:
        return self.signer.seal(self.codec.encode(message))


class FrameReader(Generic[T]):
    """Opens and decodes frames. `read` returns None for a dropped frame; a frame that is authentic but
    not a valid message can only come from a broken peer of this engine, and raises ProtocolError."""

    def __init__(self, codec: Codec[T], key: bytes, channel: bytes, where: str) -> None:
        self.codec = codec
        self.verifier = Verifier(key, channel, where)

    @property
    def drops(self) -> DropLog:
        return self.verifier.drops

    def read(self, frame: bytes) -> tuple[int, T] | None:
        try:
            sender, body = self.verifier.open(frame)
        except FrameRejected:
            return None
        return sender, self.codec.decode(body)


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
