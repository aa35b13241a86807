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
_FLUSH_S = 1.0  # how long stop() waits for a signal already sent to reach its handler


def in_import(frame: Any) -> bool:
    """Whether `frame` runs inside an import (a module's body, or the C set-up of an extension module)."""
    while frame is not None:
        if frame.f_globals.get("__name__") in _IMPORT_SYSTEM:
            return True
        frame = frame.f_back
    return False


class DeferredSignals:
    """Sends a signal held back inside an import to the main thread again (a real signal, which also
    wakes a blocking call) once no import is on its stack; one delivery per signal number however often
    it came meanwhile. A handler that uses it calls `arrived` first and `defer` where it holds one back;
    `stop` (before the handler is replaced) sends nothing more and lets one already sent reach it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[int] = set()  # signal numbers to send once the import ends
        self._sent = 0  # sent and not yet seen by the handler
        self._stopped = False

    def arrived(self, signum: int) -> None:
        with self._lock:
            self._sent = max(0, self._sent - 1)

    def defer(self, signum: int) -> None:
        with self._lock:
            if self._stopped or signum in self._waiting:
                return
            self._waiting.add(signum)
        threading.Thread(
            target=self._send_after_imports, args=(signum,), name="tp-runtime-signal", daemon=True
        ).start()

    def _send_after_imports(self, signum: int) -> None:
        main = threading.main_thread()
        while main.is_alive() and in_import(sys._current_frames().get(main.ident or 0)):
            time.sleep(_POLL_S)
        with self._lock:
            self._waiting.discard(signum)
            if self._stopped or not main.is_alive():
                return
            self._sent += 1
            signal.pthread_kill(main.ident or 0, signum)  # to the handler, which looks again

    def stop(self) -> None:
        """Called on the main thread, with the handler still installed."""
        with self._lock:
            self._stopped = True
        deadline = time.monotonic() + _FLUSH_S
        while self._sent and time.monotonic() < deadline:  # the handler runs between these bytecodes
            time.sleep(_POLL_S)
