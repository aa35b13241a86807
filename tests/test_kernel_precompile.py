"""The start-up kernel precompiler (worker/kernel_precompile.py): its Triton hook records and declines only
the dry pass's own launches, is removed afterwards (also after an error), reads what this Triton's hook
really passes, and the recorded kernels compile in parallel with failures reported rather than raised.
Compiling and launching need a GPU; there, start-up counts the kernels that still compiled during the real
warm-up (the `counting` recorder tested here) and warns if any did."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from tp_runtime.worker import kernel_precompile
from tp_runtime.worker.kernel_precompile import KernelPrecompiler, _Recorder, compile_threads

triton = pytest.importorskip("triton")
knobs = triton.knobs.runtime


class _FakeCompiled:
    """What preload returns: a compiled kernel whose binary loads (and launcher builds) on _init_handles."""

    def __init__(self, owner: _FakeKernel, data: str) -> None:
        self.owner, self.data = owner, data
        self.module: object = None
        self._run: object = None
        owner.compiled.append(self)

    def _init_handles(self) -> None:
        self._run = "launcher"  # as Triton: the launcher first, then the binary's load
        if self.owner.fail_load:
            raise RuntimeError("CUDA error: out of memory")
        self.module = "module"
        with self.owner.lock:
            self.owner.loaded.append((self.data, threading.current_thread().name))


class _FakeKernel:
    def __init__(self, name: str, fail: bool = False, fail_load: bool = False) -> None:
        self.__name__ = name
        self.fail = fail
        self.fail_load = fail_load
        self.preloaded: list[tuple[str, str]] = []
        self.loaded: list[tuple[str, str]] = []
        self.compiled: list[_FakeCompiled] = []
        self.lock = threading.Lock()

    def preload(self, data: str) -> _FakeCompiled:
        if self.fail:
            raise RuntimeError("ptxas error")
        with self.lock:
            self.preloaded.append((data, threading.current_thread().name))
        return _FakeCompiled(self, data)


class _Info:
    def __init__(self, jit_function: object) -> None:
        self.jit_function = jit_function


def _call(hook: object, kernel: object, key: str) -> bool | None:
    return hook(key=key, repr="", fn=_Info(kernel), compile={"specialization_data": f"data-{key}"},  # type: ignore[operator]
                is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_recorder_declines_only_its_own_threads_launches_and_passes_the_rest_on() -> None:
    seen: list[str] = []

    def previous(**kwargs: object) -> None:
        seen.append(str(kwargs["key"]))

    recorder = _Recorder(previous)
    kernel = _FakeKernel("k")
    assert _call(recorder, kernel, "a") is True
    assert _call(recorder, kernel, "a") is True  # the same specialization again: kept once
    assert _call(recorder, kernel, "b") is True
    other: list[bool | None] = []
    thread = threading.Thread(target=lambda: other.append(_call(recorder, kernel, "c")))
    thread.start()
    thread.join()
    assert other == [None] and seen == ["c"]  # another thread's launch compiles and runs as usual
    recorder.active = False
    assert _call(recorder, kernel, "d") is None and seen == ["c", "d"]
    assert sorted(data for _, data in recorder.found.values()) == ["data-a", "data-b"]
    # A hook call without what the recorder needs: the kernel compiles at once instead.
    assert _Recorder(None)(key="x", fn=object(), compile={}) is None


def test_counting_lets_kernels_compile_and_lists_them() -> None:
    seen: list[str] = []

    def previous(**kwargs: object) -> bool | None:
        seen.append(str(kwargs["key"]))
        return None

    counter = _Recorder(previous, decline=False)
    kernel = _FakeKernel("k")
    assert _call(counter, kernel, "a") is None and seen == ["a"]  # compiles: the hook before decides
    assert [data for _, data in counter.found.values()] == ["data-a"]


def test_dry_pass_installs_the_hook_and_removes_it_after_an_error() -> None:
    before = knobs.jit_cache_hook
    pre = KernelPrecompiler(torch.device("cuda", 0), threads=2)
    with pytest.raises(RuntimeError, match="boom"), pre.dry_pass():
        assert isinstance(knobs.jit_cache_hook, _Recorder)
        raise RuntimeError("boom")
    assert knobs.jit_cache_hook is before
    with pre.counting() as late:
        assert knobs.jit_cache_hook is late and not late.decline
    assert knobs.jit_cache_hook is before
    # On the CPU there is no dry pass: nothing is installed and nothing compiles.
    cpu = KernelPrecompiler(torch.device("cpu"), threads=2)
    assert pre.available and not cpu.available
    with cpu.dry_pass():
        assert knobs.jit_cache_hook is before
    with cpu.counting() as late:
        assert knobs.jit_cache_hook is before
    assert cpu.compile_all().kernels == 0 and not late.found


def test_recorder_reads_this_tritons_hook_arguments() -> None:
    """Triton's own hook call (as its JIT makes it on a cache miss) against the recorder: the recorded
    specialization is the JITFunction's, in the serialized form its preload reads."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    import tp_runtime.layers.fused_triton as fused

    kernel = next(v for v in vars(fused).values() if isinstance(v, triton.runtime.jit.JITFunction))
    target = GPUTarget("cuda", 90, 32)
    options = CUDABackend(target).parse_options({})
    recorder = _Recorder(None)
    key = ("spec", ("*fp32",))
    declined = kernel._call_hook(recorder, key, {"x": "*fp32"}, target, 0, {}, options, [{}], False)
    assert declined is True
    ((jit_function, data),) = recorder.found.values()
    assert jit_function is kernel and hasattr(kernel, "preload")
    assert json.loads(data)["name"] == kernel._fn_name


def test_compile_all_compiles_in_parallel_and_reports_failures(capsys: pytest.CaptureFixture[str]) -> None:
    """Each kernel compiles and then loads (its launcher built) in a pool thread, not on the main thread at
    its first launch; a failure in either is reported, not raised, and a failed load is undone."""
    pre = KernelPrecompiler(torch.device("cpu"), threads=3)
    good, bad = _FakeKernel("good"), _FakeKernel("bad", fail=True)
    unloadable = _FakeKernel("unloadable", fail_load=True)
    recorder = _Recorder(None)
    for key in "abcdef":
        _call(recorder, good, key)
    _call(recorder, bad, "z")
    _call(recorder, unloadable, "y")
    pre._recorder = recorder
    report = pre.compile_all()
    assert report.kernels == 8 and len(report.failed) == 2
    assert any("ptxas error" in f for f in report.failed)
    assert any(f.startswith("unloadable") and "out of memory" in f for f in report.failed)
    # The failed load left no launcher without a function: first use loads it again and raises its error.
    assert [c._run for c in unloadable.compiled] == [None]
    assert all(c._run == "launcher" and c.module == "module" for c in good.compiled)
    assert sorted(d for d, _ in good.preloaded) == [f"data-{k}" for k in "abcdef"]
    assert sorted(d for d, _ in good.loaded) == [f"data-{k}" for k in "abcdef"]
    assert all(name.startswith("tp-runtime-triton") for _, name in good.preloaded + good.loaded)
    assert "2 of 8 Triton kernels did not compile ahead" in capsys.readouterr().err
    assert pre.compile_all().kernels == 0  # what was found is compiled once


def test_compile_threads_share_the_cores_between_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_precompile.os, "sched_getaffinity", lambda _: set(range(16)))
    assert compile_threads(1) == 16 and compile_threads(2) == 8 and compile_threads(64) == 1


def test_triton_driver_starts_beside_the_model_load_and_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, Triton's driver starts in a thread of its own while the body (the model's load) runs, and
    that thread has ended when the body does (Triton is never touched from two threads at once); on the
    CPU no thread starts."""
    body_running = threading.Event()
    seen: list[str] = []

    def start() -> None:
        body_running.wait(timeout=30)
        seen.append(threading.current_thread().name)

    monkeypatch.setattr(kernel_precompile, "_start_triton_driver", start)
    with kernel_precompile.triton_driver_starting(torch.device("cuda")):
        body_running.set()
    assert seen == ["tp-runtime-triton-driver"]
    assert not any(t.name == "tp-runtime-triton-driver" for t in threading.enumerate())
    with kernel_precompile.triton_driver_starting(torch.device("cpu")):
        pass
    assert seen == ["tp-runtime-triton-driver"]


def test_starting_triton_s_driver_without_a_gpu_raises_nothing() -> None:
    """Without a GPU Triton has no active driver: the thread swallows that (the first launch reports it)."""
    kernel_precompile._start_triton_driver()
