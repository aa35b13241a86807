"""Start-up compiles the Triton kernels its warm-up launches in a pool of threads, before launching them.

Triton compiles a kernel specialization on its first launch, one at a time. On a machine with no Triton
cache, a Llama-3-8B start-up compiled a few dozen of them in a row, about 17 s of its 39 s. Here the warm-up's
forwards first run once with Triton's cache hook declining every kernel not yet compiled: the hook keeps the
specialization and the launch is skipped. Nothing those forwards compute is read; they only find the kernels.
Then the kept specializations compile and load in parallel (ptxas and the host compiler run as
subprocesses and much of Triton's compiler runs outside the GIL), and the real warm-up finds each kernel
ready to launch.

Triton's hook is one per process, so it is set only for the dry pass and only declines launches from the
thread running it; other threads' launches go to whatever hook was there before. Where the installed
Triton lacks the hook or `JITFunction.preload`, there is no dry pass and kernels compile on first use as
before. The real warm-up then counts the kernels that still compiled on launch: start-up warns if any did.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# The hook is process-wide: one dry pass at a time (two engines starting in one process take turns).
_HOOK_LOCK = threading.Lock()


@dataclass
class PrecompileReport:
    """What one start-up compiled ahead: kernel specializations, wall seconds, and those that failed
    (they compile on first use instead, where a real error is raised as it would have been)."""

    kernels: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)


class _Recorder:
    """Triton's `jit_cache_hook` (called where a launch finds its kernel not compiled yet) for the owner
    thread: records each such kernel and, with `decline`, skips its compile and launch (the dry pass);
    without, lets it compile as usual (counting what the dry pass missed)."""

    def __init__(self, previous: Any, decline: bool = True) -> None:
        self.owner = threading.get_ident()
        self.previous = previous
        self.decline = decline
        self.active = True
        # (kernel, specialization key) -> (the JITFunction, its serialized specialization)
        self.found: dict[tuple[int, str], tuple[Any, str]] = {}

    def _pass_on(self, kwargs: dict[str, Any]) -> bool | None:
        return self.previous(**kwargs) if self.previous is not None else None

    def __call__(self, **kwargs: Any) -> bool | None:
        if not self.active or threading.get_ident() != self.owner:
            return self._pass_on(kwargs)
        try:
            jit_function = kwargs["fn"].jit_function
            data = kwargs["compile"]["specialization_data"]
            key = str(kwargs["key"])
        except (KeyError, AttributeError, TypeError):
            return None  # a Triton whose hook says less: this kernel compiles now, as usual
        if not hasattr(jit_function, "preload"):
            return None
        self.found.setdefault((id(jit_function), key), (jit_function, data))
        return True if self.decline else self._pass_on(kwargs)  # True: compile and launch nothing


def _runtime_knobs() -> Any:
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    return knobs if knobs is not None and hasattr(knobs, "jit_cache_hook") else None


def _start_triton_driver() -> None:
    try:
        from triton.runtime import driver

        driver.active  # noqa: B018 (the property builds the driver)
    except Exception:  # no Triton, or no GPU for it: the first launch says so where it matters
        pass


@contextmanager
def triton_driver_starting(device: torch.device) -> Iterator[None]:
    """While the body runs (the model's load), Triton's CUDA driver starts in a thread: its first use on a
    machine compiles a helper module with the host's C compiler, 4.85 s of a fresh H100 machine's first
    start, which ran in series with everything before the first kernel launch (BENCHMARKS.md, start-up).
    The thread is joined when the body ends, so Triton is only touched from one thread at a time."""
    if device.type != "cuda":
        yield
        return
    thread = threading.Thread(target=_start_triton_driver, name="tp-runtime-triton-driver", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def compile_threads(ranks_on_host: int) -> int:
    """Threads per rank: the host's cores shared by the ranks compiling at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(32, cores // max(1, ranks_on_host)))


class KernelPrecompiler:
    """Where `available`: `with pre.dry_pass(): <warm-up forwards>`, `pre.compile_all()`, then the real
    warm-up inside `with pre.counting() as late:`, after which `late.found` lists what compiled there."""

    def __init__(self, device: torch.device, threads: int) -> None:
        self.device = device
        self.threads = threads
        self._recorder: _Recorder | None = None

    @property
    def available(self) -> bool:
        """A GPU, and a Triton with the cache hook and `JITFunction.preload` (3.4 and later)."""
        if self.device.type != "cuda" or _runtime_knobs() is None:
            return False
        from triton.runtime.jit import JITFunction

        return hasattr(JITFunction, "preload")

    @contextmanager
    def _hooked(self, decline: bool) -> Iterator[_Recorder]:
        knobs = _runtime_knobs()
        if knobs is None or not self.available:
            yield _Recorder(None, decline)  # records nothing: no hook calls it
            return
        with _HOOK_LOCK:
            recorder = _Recorder(knobs.jit_cache_hook, decline)
            knobs.jit_cache_hook = recorder
            try:
                yield recorder
            finally:
                recorder.active = False
                if knobs.jit_cache_hook is recorder:
                    knobs.jit_cache_hook = recorder.previous

    @contextmanager
    def dry_pass(self) -> Iterator[None]:
        """Inside: this thread's launches of uncompiled Triton kernels are recorded, not run."""
        with self._hooked(decline=True) as recorder:
            yield
        self._recorder = recorder

    @contextmanager
    def counting(self) -> Iterator[_Recorder]:
        """Inside: this thread's kernels that still compile on launch (none, if the dry pass found every
        one) compile as usual and are listed in the yielded recorder's `found`."""
        with self._hooked(decline=False) as recorder:
            yield recorder

    def compile_all(self) -> PrecompileReport:
        """Compile what the dry pass found, in parallel; each lands in its kernel's in-memory cache."""
        report = PrecompileReport()
        found = list(self._recorder.found.values()) if self._recorder is not None else []
        self._recorder = None
        if not found:
            return report
        start = time.perf_counter()
        device = self.device

        def on_thread_start() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # Triton keys its caches by the thread's current device

        def compile_one(item: tuple[Any, str]) -> str | None:
            jit_function, data = item
            try:
                kernel = jit_function.preload(data)
                # Loading the binary and building its launcher: some Tritons (3.6) compile a C launcher
                # per kernel with the host compiler there, 3.1 s of an H200's first start when the first
                # launches did it one at a time on the main thread (BENCHMARKS.md, start-up).
                init_handles = getattr(kernel, "_init_handles", None)
                if callable(init_handles):
                    try:
                        init_handles()
                    except Exception:
                        # Triton sets the launcher before it loads the binary: a failed load would leave a
                        # launcher without a function, so first use loads it again, raising its own error.
                        if getattr(kernel, "module", None) is None:
                            kernel._run = None
                        raise
            except Exception as exc:  # it compiles on first use instead, raising there
                return f"{getattr(jit_function, '__name__', jit_function)}: {type(exc).__name__}: {exc}"
            return None

        with ThreadPoolExecutor(max_workers=min(self.threads, len(found)), initializer=on_thread_start,
                                thread_name_prefix="tp-runtime-triton") as pool:  # fmt: skip
            results = list(pool.map(compile_one, found))
        report.kernels = len(found)
        report.failed = [r for r in results if r is not None]
        report.seconds = time.perf_counter() - start
        if report.failed:
            print(f"tp-runtime: warning: {len(report.failed)} of {len(found)} Triton kernels did not compile "
                  f"ahead and compile on first use ({report.failed[0]})", file=sys.stderr,
                  flush=True)  # fmt: skip
        return report
