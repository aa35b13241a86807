"""Signals that arrive while the main thread is inside an import.

An exception raised there by a signal handler (KeyboardInterrupt, a server's shutdown) may land in an
extension module's set-up: C++ that runs Python through pybind11 (torch's, Triton's), which cannot carry
it, and the process aborts ("terminate called after throwing ... KeyboardInterrupt"). The handlers of the
CLI, the server and the torchrun launcher therefore hold such a signal back and have it sent again once
the main thread has left every import (`DeferredSignals`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

_IMPORT_SYSTEM = ("importlib._bootstrap", "importlib._bootstrap_external")  # (frozen or not)
_POLL_S = 0.005
# A signal sent just as the main thread begins a blocking call (it lets the sender run by releasing the
# GIL there) only trips a flag and does not wake the call: sent again until the handler has seen it.
_RESEND_S = 0.05
_MAX_SENDS = 20  # (a handler that never calls `arrived`, installed since, gets a few at most)
_FLUSH_S = 0.25  # how long stop() waits for a signal already sent to reach its handler


def in_import(frame: Any) -> bool:
    """Whether `frame` runs inside an import (a module's body, or the C set-up of an extension module)."""
    while frame is not None:
        if frame.f_globals.get("__name__") in _IMPORT_SYSTEM:
            return True
        frame = frame.f_back
    return False


class _Held:
    """One signal held back: whether it has been sent again, and whether the handler has seen it since."""

    __slots__ = ("seen", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.seen = False


class DeferredSignals:
    """Sends a signal held back inside an import to the main thread again, as a real signal, once no
    import is on its stack: one delivery per signal number however often it came meanwhile. A handler
    that uses it calls `arrived` first and `defer` where it holds one back; `stop` (before the handler is
    replaced) sends nothing more and lets one already sent reach it.

    The handler's side takes no lock: CPython may run a second handler inside the first (a signal that
    arrives meanwhile), which would wait forever on a lock the first holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # between the senders and stop(), never taken by a handler
        self._held: dict[int, _Held] = {}
        self._stopped = False

    def arrived(self, signum: int) -> None:
        held = self._held.pop(signum, None)
        if held is not None:
            held.seen = True

    def defer(self, signum: int) -> None:
        """Called by the handler (on the main thread)."""
        held = _Held()
        # setdefault runs no Python code, where a second handler could run (nested) and take the number too
        if self._stopped or self._held.setdefault(signum, held) is not held:
            return
        handler = signal.getsignal(signum)
        try:
            threading.Thread(
                target=self._send_after_imports, args=(signum, held, handler), name="tp-runtime-signal",
                daemon=True,
            ).start()  # fmt: skip
        except RuntimeError:  # the interpreter is shutting down: nothing left to stop
            self._held.pop(signum, None)

    def _send_after_imports(self, signum: int, held: _Held, handler: Any) -> None:
        try:
            self._send(signum, held, handler)
        finally:  # a later signal of this number is held back again (not taken for this one); stop()
            # waits for a sent one itself
            if not self._stopped and self._held.get(signum) is held:
                self._held.pop(signum, None)

    def _send(self, signum: int, held: _Held, handler: Any) -> None:
        main = threading.main_thread()
        for _ in range(_MAX_SENDS):
            while not held.seen and main.is_alive() and in_import(sys._current_frames().get(main.ident or 0)):
                time.sleep(_POLL_S)
            with self._lock:
                if self._stopped or held.seen or not main.is_alive():
                    return
                if held.sent and signal.getsignal(signum) is not handler:
                    return  # another handler took it (one that does not answer here): once is enough
                held.sent = True
                signal.pthread_kill(main.ident or 0, signum)  # to the handler, which looks again
            time.sleep(_RESEND_S)
            if held.seen:
                return

    def stop(self) -> None:
        """Called on the main thread, with the handler still installed."""
        with self._lock:
            self._stopped = True
        deadline = time.monotonic() + _FLUSH_S
        while any(h.sent and not h.seen for h in list(self._held.values())) and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # the handler runs between these bytecodes
