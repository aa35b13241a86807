"""Entry point of a spawned worker process: `python -m tp_runtime.worker.process`.

The multiprocess executor starts each rank as a fresh interpreter running this module (never
multiprocessing's spawn, which re-imports the user's main module in every worker, so a script without an
`if __name__ == "__main__":` guard would start engines recursively). The user's `__main__` is never
imported here.

The driver writes the worker's arguments to its stdin as one frame: a 4-byte big-endian length, then a
msgspec-msgpack `SpawnArgs` (the EngineConfig, the rank, the addresses, the process-group init method and
the HMAC key). Nothing is pickled, and the key never appears on the command line or in the environment.
The driver then keeps the pipe open for the worker's life: EOF on stdin means the driver is gone, and the
worker leaves at once, removing the driver's ipc socket folder (a killed driver cannot remove it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import struct
import sys
import threading

import msgspec

from tp_runtime.config import EngineConfig
from tp_runtime.messages import PROTOCOL

_LENGTH = struct.Struct(">I")
# Far above any config (the largest part is the rope frequencies); a bound so a bad length cannot make the
# worker allocate without limit.
_MAX_FRAME_BYTES = 64 << 20


class SpawnArgs(msgspec.Struct, frozen=True):
    config: EngineConfig
    rank: int
    local_rank: int
    broadcast: str
    results: str
    heartbeat: str | None
    max_broadcast_bytes: int
    key: bytes
    init_method: str | None
    # The driver's pid when it spawned the worker from its main thread (which lives as long as the
    # driver): the worker then asks the kernel for a signal when its parent dies. None: not asked.
    die_with_parent: int | None = None
    # The driver's messages.PROTOCOL: a worker whose own differs exits with PROTOCOL_MISMATCH_EXIT.
    protocol: str = ""


class _Protocol(msgspec.Struct):
    """The one field of a start-up frame read before the rest, whatever else the frame's layout holds."""

    protocol: str = ""


# A worker's exit status when its messages' layout differs from its driver's (another version of the code).
PROTOCOL_MISMATCH_EXIT = 3
PROTOCOL_MISMATCH = (
    "runs tp_runtime code whose driver-worker messages differ from the driver's (another version of the "
    "package, or its files changed since the driver started); restart the program so that both load the "
    "same code"
)


def encode_spawn_args(args: SpawnArgs) -> bytes:
    """The frame the driver writes to a worker's stdin."""
    body = msgspec.msgpack.encode(args)
    return _LENGTH.pack(len(body)) + body


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError(f"the driver closed the pipe after {n - left} of {n} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_spawn_args(fd: int) -> SpawnArgs:
    """Read the start-up frame from a file descriptor (unbuffered: nothing past the frame is consumed)."""
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    if length > _MAX_FRAME_BYTES:
        raise ValueError(f"spawn frame of {length} bytes (at most {_MAX_FRAME_BYTES})")
    body = _read_exactly(fd, length)
    if msgspec.msgpack.decode(body, type=_Protocol).protocol != PROTOCOL:
        raise ProtocolMismatch
    return msgspec.msgpack.decode(body, type=SpawnArgs)


class ProtocolMismatch(Exception):
    """The driver's messages.PROTOCOL is not this worker's."""


def _ipc_folder(address: str) -> str | None:
    return os.path.dirname(address[len("ipc://") :]) if address.startswith("ipc://") else None


def exit_when_driver_dies(fd: int, ipc_folder: str | None) -> None:
    """Block on the pipe from the driver; EOF means the driver is gone, so leave at once (no orphans),
    removing the driver's ipc socket folder. The driver sends nothing more: anything read is ignored.
    It reads the raw descriptor: a daemon thread blocked inside a buffered stream's lock would make
    interpreter shutdown fail."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    _leave(ipc_folder)


def _leave(ipc_folder: str | None) -> None:
    """The driver is gone: remove its ipc socket folder and exit at once."""
    if ipc_folder is not None:
        shutil.rmtree(ipc_folder, ignore_errors=True)
    os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, ipc_folder: str | None) -> None:
    """Have the kernel send this process SIGCONT when its parent dies (Linux): a worker stopped by a signal
    then resumes, reads its pipe's EOF and leaves as any worker of a killed driver does (removing the
    socket folder), rather than lingering stopped. A parent already gone: leave now, the same way."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGCONT, 0, 0, 0)
    if os.getppid() != parent_pid:
        print("tp-runtime worker: the driver is gone; exiting", file=sys.stderr, flush=True)
        _leave(ipc_folder)


def main() -> None:
    stdin = sys.stdin.fileno()
    try:
        args = read_spawn_args(stdin)
    except ProtocolMismatch:
        print(f"tp-runtime worker: this worker {PROTOCOL_MISMATCH}", file=sys.stderr, flush=True)
        os._exit(PROTOCOL_MISMATCH_EXIT)
    except (EOFError, OSError, ValueError, msgspec.DecodeError) as exc:
        print(f"tp-runtime worker: bad start-up frame from the driver: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    if args.die_with_parent is not None:
        die_with_parent(args.die_with_parent, _ipc_folder(args.broadcast))
    # Watch the pipe before the slow imports (torch) and the model load.
    threading.Thread(
        target=exit_when_driver_dies, args=(stdin, _ipc_folder(args.broadcast)),
        name="tp-runtime-driver-pipe", daemon=True,
    ).start()  # fmt: skip
    # Nothing here may read stdin again; a stray input() must not steal the pipe's EOF.
    sys.stdin = open(os.devnull)  # noqa: SIM115

    from tp_runtime.worker.worker import WorkerAddresses, run_worker_loop

    addresses = WorkerAddresses(
        args.broadcast, args.results, args.key, args.heartbeat, args.max_broadcast_bytes
    )
    run_worker_loop(args.config, args.rank, args.local_rank, addresses, args.init_method)


if __name__ == "__main__":
    main()
