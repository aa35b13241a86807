"""The all-reduce strategies, without a GPU.

- The size-based choice between one-shot, two-shot and NCCL is a pure function (thresholds, capacity,
  dtypes, alignment, missing kernels).
- SymmMemAllReduce's per-call wiring, with the torch.ops.symm_mem kernels replaced by CPU stand-ins that
  read the symmetric buffer (so a missing copy into it gives a wrong sum).
- Two gloo processes on loopback: the group's strategy is torch.distributed's, its sums equal a
  brute-force sum of every rank's input; the symmetric-memory probe falls back to it, on every rank,
  with one warning line, when CUDA is missing, the import fails, rendezvous raises, or set-up fails on
  one rank only; the other collectives still work.
- World size 1 is the identity; disable_nvlink_multicast forces its variables.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tp_runtime import distributed as D
from tp_runtime.distributed import (
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    DistAllReduce,
    FusedNormBuffers,
    IdentityAllReduce,
    SymmMemAllReduce,
    SymmMemOps,
    TPGroup,
    disable_nvlink_multicast,
    make_all_reduce,
    select_method,
)

KiB = 1024

# ------------------------------------------------------------------------------------------------ pure


def test_select_method_thresholds() -> None:
    cap = 1 << 20
    kw: dict[str, Any] = dict(one_shot_max_bytes=64 * KiB, two_shot_max_bytes=512 * KiB)
    assert select_method(4, torch.bfloat16, cap, **kw) == ONE_SHOT
    assert select_method(64 * KiB, torch.bfloat16, cap, **kw) == ONE_SHOT
    assert select_method(64 * KiB + 4, torch.bfloat16, cap, **kw) == TWO_SHOT
    assert select_method(512 * KiB, torch.float32, cap, **kw) == TWO_SHOT
    assert select_method(512 * KiB + 4, torch.float32, cap, **kw) == NCCL


def test_select_method_capacity_falls_back_to_nccl() -> None:
    kw: dict[str, Any] = dict(one_shot_max_bytes=1 << 30, two_shot_max_bytes=1 << 30)
    assert select_method(8 * KiB, torch.bfloat16, 8 * KiB, **kw) == ONE_SHOT
    assert select_method(8 * KiB + 4, torch.bfloat16, 8 * KiB, **kw) == NCCL
    # Prefill-sized: 8192 tokens x 4096 bf16 never goes through a decode-sized buffer.
    assert select_method(8192 * 4096 * 2, torch.bfloat16, 256 * 4096 * 2, **kw) == NCCL


def test_select_method_dtypes_alignment_and_missing_kernels() -> None:
    cap = 1 << 20
    assert select_method(8 * KiB, torch.float16, cap) == NCCL  # no symm-mem kernel for fp16
    assert select_method(8 * KiB, torch.int32, cap) == NCCL
    assert select_method(6, torch.bfloat16, cap) == NCCL  # 3 bf16 elements: not 4-byte aligned
    assert select_method(0, torch.float32, cap) == NCCL
    kw: dict[str, Any] = dict(one_shot_max_bytes=64 * KiB, two_shot_max_bytes=512 * KiB)
    assert select_method(8 * KiB, torch.float32, cap, has_one_shot=False, **kw) == TWO_SHOT
    assert select_method(128 * KiB, torch.float32, cap, has_two_shot=False, **kw) == NCCL
    assert select_method(8 * KiB, torch.float32, cap, has_one_shot=False, has_two_shot=False, **kw) == NCCL


def test_default_thresholds_are_consistent() -> None:
    assert D.ONE_SHOT_MAX_BYTES <= D.MAX_SYMM_BUFFER_BYTES
    assert D.TWO_SHOT_MAX_BYTES <= D.MAX_SYMM_BUFFER_BYTES
    # A decode message (256 rows x 4096 bf16 = 2 MiB) goes through symmetric memory by default.
    assert select_method(256 * 4096 * 2, torch.bfloat16, D.MAX_SYMM_BUFFER_BYTES) in (ONE_SHOT, TWO_SHOT)


def test_disable_nvlink_multicast_forces_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    disable_nvlink_multicast()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_world_size_one_is_identity() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    for tp in (TPGroup(), TPGroup(0, 1, make_all_reduce(1, torch.device("cpu")))):
        assert isinstance(tp.strategy, IdentityAllReduce)
        y = tp.all_reduce(x)
        assert y is x and torch.equal(y, torch.arange(6.0).reshape(2, 3))
    # Forcing a strategy does not matter at world size 1 (nothing to reduce, no process group needed).
    assert isinstance(make_all_reduce(1, torch.device("cuda", 0), strategy="symm_mem"), IdentityAllReduce)


def test_bad_strategy_name() -> None:
    with pytest.raises(ValueError, match="auto"):
        make_all_reduce(2, torch.device("cpu"), strategy="fast")


def test_default_group_strategy_is_dist_for_world_size_two() -> None:
    assert isinstance(TPGroup(1, 2).strategy, DistAllReduce)


def test_forcing_symm_mem_without_cuda_raises() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        make_all_reduce(2, torch.device("cpu"), strategy="symm_mem", max_message_bytes=1 << 20)


# ------------------------------------------------------- SymmMemAllReduce wiring with CPU stand-in kernels

PEERS = 2  # the stand-ins pretend every other rank holds 10x this rank's values


class FakeKernels:
    """CPU stand-ins for torch.ops.symm_mem: the sum over ranks of what each rank put in its symmetric
    buffer, where rank r != me holds 10 * (my buffer). Records which kernel ran."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.calls: list[str] = []

    def _check_symm(self, symm: torch.Tensor) -> None:
        assert symm.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        assert symm.storage_offset() == 0

    def _sum(self, symm: torch.Tensor) -> torch.Tensor:
        return symm * (1 + 10 * (PEERS - 1))

    def one_shot_out(self, symm: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self._check_symm(symm)
        self.calls.append("one_shot_out")
        return out.copy_(self._sum(symm))

    def one_shot_copy_out(
        self, symm: torch.Tensor, local: torch.Tensor, op: str, group: str, out: torch.Tensor
    ) -> torch.Tensor:
        self._check_symm(symm)
        self.calls.append("one_shot_copy_out")
        symm.copy_(local)
        return out.copy_(self._sum(symm))

    def two_shot_out(self, symm: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self._check_symm(symm)
        self.calls.append("two_shot_out")
        return out.copy_(self._sum(symm))

    def two_shot_inplace(self, symm: torch.Tensor, op: str, group: str) -> torch.Tensor:
        self._check_symm(symm)
        self.calls.append("two_shot_")
        return symm.copy_(self._sum(symm))


class CountingFallback(DistAllReduce):
    def __init__(self) -> None:
        self.name = "fake-nccl"
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return x * (1 + 10 * (PEERS - 1))


def _fake_strategy(
    capacity: int = 64 * KiB, *, copy_kernel: bool = True, two_shot_out: bool = True, world: int = 2
) -> tuple[SymmMemAllReduce, FakeKernels, CountingFallback]:
    buffer = torch.full((capacity,), 255, dtype=torch.uint8)  # garbage: a missing copy shows
    k = FakeKernels(buffer)
    ops = SymmMemOps(
        one_shot_out=k.one_shot_out,
        one_shot_copy_out=k.one_shot_copy_out if copy_kernel else None,
        two_shot_out=k.two_shot_out if two_shot_out else None,
        two_shot_inplace=k.two_shot_inplace,
    )
    fb = CountingFallback()
    s = SymmMemAllReduce(buffer, "g", world, fb, ops, one_shot_max_bytes=4 * KiB, two_shot_max_bytes=32 * KiB)
    return s, k, fb


def test_fused_add_rms_norm_declines_what_it_cannot_take_safely() -> None:
    """The fused all-reduce + add + RMSNorm runs only once prepared for a dtype (every region emptied:
    -0.0), for 2-d rows of that dtype within its row and byte limits, and only in the row width of its
    first call until prepared again; otherwise it declines (None) and the model reduces, then
    normalises. Plain strategies never fuse."""
    calls: list[tuple[tuple[int, ...], torch.dtype, int, int, int]] = []

    def kernel(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append((tuple(x.shape), x.dtype, kw["rank"], kw["world_size"], kw["slot_elems"]))
        return torch.zeros_like(x)

    regions = torch.full((3 * 2 * 4 * KiB,), 7, dtype=torch.uint8)
    epochs = torch.full((8,), 2, dtype=torch.int32)
    fused = FusedNormBuffers(torch.zeros(2, 3, dtype=torch.int64), regions, epochs, slot_bytes=4 * KiB,
                             max_rows=8, kernel=kernel)  # fmt: skip
    s, _, _ = _fake_strategy()
    s = SymmMemAllReduce(s.buffer, "g", 2, s.fallback, s.ops, fused_norm=fused, rank=1)
    assert s.fuses_add_rms_norm and not DistAllReduce().fuses_add_rms_norm
    assert DistAllReduce().add_rms_norm(torch.ones(1, 4), torch.ones(1, 4), torch.ones(4), 1e-6) is None
    w = torch.ones(512)

    def run(x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        r = torch.zeros_like(x) if residual is None else residual
        return s.add_rms_norm(x, r, w[: x.shape[-1]].to(x.dtype), 1e-6) is not None

    assert not run(torch.ones(4, 64))  # not prepared
    s.prepare_fused_norm(torch.float32)
    as_float = regions.view(torch.float32)
    assert bool(((as_float == 0) & torch.signbit(as_float)).all()) and not epochs.any()
    assert run(torch.ones(4, 64))  # 1 KiB: fits; fixes the width
    assert calls == [((4, 64), torch.float32, 1, 2, 1024)]
    assert not run(torch.ones(9, 64))  # more rows than max_rows
    assert not run(torch.ones(4, 48))  # another width
    assert not run(torch.ones(4, 64, dtype=torch.bfloat16))  # another dtype
    assert not run(torch.ones(64))  # not rows
    assert not run(torch.ones(4, 64), torch.zeros(4, 32))  # residual of another shape
    assert not run(torch.ones(64, 4).t())  # columns not contiguous
    assert run(torch.ones(8, 64))  # the first layout again
    s.prepare_fused_norm(torch.bfloat16)
    as_bf16 = regions.view(torch.bfloat16)
    assert bool(((as_bf16 == 0) & torch.signbit(as_bf16)).all())
    assert not run(torch.ones(8, 512, dtype=torch.bfloat16))  # 8 KiB: more than a slot
    assert run(torch.ones(2, 256, dtype=torch.bfloat16))
    assert calls[-1] == ((2, 256), torch.bfloat16, 1, 2, 2048)
    assert not run(torch.ones(2, 64, dtype=torch.bfloat16)) and not run(torch.ones(2, 256))
    with pytest.raises(ValueError, match=r"has no torch\.float64"):
        s.prepare_fused_norm(torch.float64)
    s.close()
    assert not s.fuses_add_rms_norm and not run(torch.ones(2, 256, dtype=torch.bfloat16))


def _values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # |x| * 11 <= 121: exact in bfloat16 too.
    return (torch.arange(int(torch.tensor(shape).prod())) % 23 - 11).reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_symm_dispatch_sums_through_the_buffer(dtype: torch.dtype) -> None:
    s, k, fb = _fake_strategy()
    # (shape, kernel expected); itemsize 2 or 4 -> bytes
    for rows, hidden in [(1, 64), (4, 256), (16, 256), (24, 320)]:
        x = _values((rows, hidden), dtype)
        want = x.double() * 11
        nbytes = x.numel() * x.element_size()
        expected = select_method(
            nbytes, dtype, 64 * KiB, one_shot_max_bytes=4 * KiB, two_shot_max_bytes=32 * KiB
        )
        k.calls.clear()
        fb.seen.clear()
        y = s(x.clone())
        assert torch.equal(y.double(), want), (rows, hidden, expected)
        if expected == ONE_SHOT:
            assert k.calls == ["one_shot_copy_out"]
        elif expected == TWO_SHOT:
            assert k.calls == ["two_shot_out"]
        else:
            assert k.calls == [] and fb.seen == [(rows, hidden)]


def test_symm_dispatch_paths_without_fused_kernels_and_odd_world_size() -> None:
    s, k, _ = _fake_strategy(copy_kernel=False, world=3)  # two_shot_out exists for 2, 4, 8 ranks only
    x = _values((2, 64), torch.float32)  # 512 B: one-shot
    assert torch.equal(s(x.clone()), x * 11) and k.calls == ["one_shot_out"]
    k.calls.clear()
    x = _values((8, 512), torch.float32)  # 16 KiB: two-shot
    assert torch.equal(s(x.clone()), x * 11) and k.calls == ["two_shot_"]


def test_symm_one_shot_copies_with_a_separate_kernel_above_the_fused_limit() -> None:
    s, k, _ = _fake_strategy(capacity=2 << 20)
    small = _values((D.ONE_SHOT_FUSED_COPY_MAX_BYTES // 4,), torch.float32)
    large = _values((D.ONE_SHOT_FUSED_COPY_MAX_BYTES // 4 + 4,), torch.float32)
    assert torch.equal(s.run_method(ONE_SHOT, small.clone()), small * 11)
    assert torch.equal(s.run_method(ONE_SHOT, large.clone()), large * 11)
    assert k.calls == ["one_shot_copy_out", "one_shot_out"]
    # Shapes and dtypes alternating through the cached buffer views still sum right.
    for shape, dtype in [((4, 64), torch.float32), ((4, 64), torch.bfloat16), ((2, 128), torch.float32)] * 2:
        x = _values(shape, dtype)
        assert torch.equal(s(x.clone()), x * 11)


def test_symm_non_contiguous_and_offset_inputs() -> None:
    s, k, _ = _fake_strategy()
    base = _values((8, 64), torch.float32)
    y = s(base.t())  # non-contiguous: reduced as a contiguous copy
    assert torch.equal(y, base.t() * 11)
    k.calls.clear()
    big = _values((9, 64), torch.float32)
    view, want = big[1:], big[1:] * 11  # offset 256 B: 16-byte aligned -> fused kernel, in place
    assert torch.equal(s(view), want) and k.calls == ["one_shot_copy_out"]
    k.calls.clear()
    odd = _values((130,), torch.float32)[1:129]  # offset 4 B: reduced in an aligned copy, returned
    want = _values((130,), torch.float32)[1:129] * 11
    y = s(odd)
    assert torch.equal(y, want) and k.calls == ["one_shot_copy_out"]
    assert y.data_ptr() % 16 == 0 and y.data_ptr() != odd.data_ptr()


def test_symm_large_fp16_and_empty_messages_use_fallback() -> None:
    s, k, fb = _fake_strategy()
    big = _values((256, 4096), torch.bfloat16)  # 2 MiB > 64 KiB buffer
    assert torch.equal(s(big.clone()), big * 11) and fb.seen == [(256, 4096)] and k.calls == []
    half = _values((2, 64), torch.float16)
    assert torch.equal(s(half.clone()), half * 11) and fb.seen[-1] == (2, 64) and k.calls == []
    with pytest.raises(ValueError, match="exceeds"):
        s.run_method(ONE_SHOT, big)
    with pytest.raises(ValueError, match="float16"):
        s.run_method(ONE_SHOT, half)


def test_symm_self_test_detects_wrong_sums() -> None:
    s, k, _ = _fake_strategy()
    # Ranks hold rank + 1, so 2 ranks sum to 3. The stand-in gives 11 * 1 on rank 0: wrong.
    with pytest.raises(RuntimeError, match="self-test"):
        s.self_test(rank=0)
    k.calls.clear()
    k._sum = lambda symm: symm + 2  # type: ignore[method-assign]  # rank 0's 1 + rank 1's 2
    s.self_test(rank=0)
    assert k.calls == ["one_shot_copy_out", "two_shot_out"]


# -------------------------------------------------------------------------------- two gloo processes

WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    # Small integers: every sum is exact in every dtype, so equality is the check.
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-64, 65, shape, generator=g).to(dtype)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _child(rank: int, port: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    tp = D.init_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", rank, WORLD, 60.0, cpu, max_message_bytes=1 << 20
    )
    res: dict[str, Any] = {"strategy": type(tp.strategy).__name__, "name": tp.strategy.name}

    # Sums against a brute-force sum of every rank's input (each rank rebuilds the others' from seeds).
    sums_ok = []
    for seed, (shape, dtype) in enumerate(
        [((1, 8), torch.float32), ((3, 64), torch.bfloat16), ((16, 96), torch.float32), ((5,), torch.float16)]
    ):
        x = _rank_tensor(rank, shape, dtype, seed)
        want = sum(_rank_tensor(r, shape, dtype, seed).double() for r in range(WORLD))
        y = tp.all_reduce(x.clone())
        sums_ok.append(bool(torch.equal(y.double(), want)) and y.dtype == dtype and y.shape == shape)
    res["sums_ok"] = sums_ok
    res["gather"] = tp.all_gather_last_dim(torch.full((2, 1), float(rank))).tolist()
    res["min"] = tp.all_reduce_min_int(10 + rank, cpu)
    res["bcast"] = tp.broadcast_bytes(b"addr-of-rank-0" if rank == 0 else None, cpu).decode()

    # The probe's fallbacks, each ending in the same choice on every rank, with one warning line.
    handler = _Warnings()
    D.logger.addHandler(handler)
    D.logger.propagate = False

    def scenario(name: str) -> None:
        strategy = make_all_reduce(WORLD, torch.device("cuda", 0), max_message_bytes=1 << 20)
        x = _rank_tensor(rank, (4, 8), torch.float32, 99)
        want = sum(_rank_tensor(r, (4, 8), torch.float32, 99).double() for r in range(WORLD))
        res[name] = {
            "strategy": type(strategy).__name__,
            "sum_ok": bool(torch.equal(strategy(x).double(), want)),
            "warnings": list(handler.lines),
        }
        handler.lines.clear()

    # 1. No CUDA in this torch build (CPU-only here): probe says so, falls back.
    assert not torch.cuda.is_available()
    scenario("no_cuda")

    # From here on pretend every local check passes (no GPU needed to reach the set-up).
    D._local_symm_mem_problem = lambda device: None  # type: ignore[assignment]
    D._device_identity = lambda device: (socket.gethostname(), f"uuid-{rank}", rank)  # type: ignore[assignment]
    D._peer_problem = lambda me, ids, can: None  # type: ignore[assignment]

    # 2. Importing symmetric memory fails inside set-up.
    def broken_import() -> Any:
        raise ImportError("no _symmetric_memory in this build")

    D._import_symm_mem = broken_import  # type: ignore[assignment]
    scenario("import_fails")

    # 3. Allocation works but rendezvous raises.
    def fake_module() -> Any:
        def rendezvous(buf: torch.Tensor, group_name: str) -> Any:
            assert group_name == str(dist.group.WORLD.group_name)  # type: ignore[union-attr]
            raise RuntimeError("rendezvous: CUDA driver error: peer access is not supported\ndetails")

        return SimpleNamespace(
            empty=lambda n, dtype, device: torch.empty(n, dtype=dtype, device="cpu"), rendezvous=rendezvous
        )

    D._import_symm_mem = fake_module  # type: ignore[assignment]
    scenario("rendezvous_fails")

    # 4. Set-up succeeds on rank 0 only: both ranks must still fall back (and rank 0 frees its buffer).
    closed: list[bool] = []

    class FakeSymm(SymmMemAllReduce):
        def __init__(self) -> None:
            pass

        def close(self) -> None:
            closed.append(True)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("a fallen-back strategy must not be used")

    def create(device: torch.device, max_bytes: int, group: Any, fallback: Any) -> SymmMemAllReduce:
        if rank == 1:
            raise RuntimeError("out of memory")
        return FakeSymm()

    impl, problem = D._probe_symm_mem(torch.device("cuda", 0), 1 << 20, None, DistAllReduce(), create=create)
    res["one_rank_fails"] = {"impl": impl is None, "problem": problem, "closed": closed}

    # 5. Forcing symm_mem raises instead of falling back; "nccl" never probes.
    try:
        make_all_reduce(WORLD, torch.device("cuda", 0), strategy="symm_mem", max_message_bytes=1 << 20)
        res["forced"] = "no error"
    except RuntimeError as e:
        res["forced"] = str(e)
    res["nccl"] = type(make_all_reduce(WORLD, torch.device("cuda", 0), strategy="nccl")).__name__

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    D.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("all_reduce")
    tmp.spawn(_child, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_gloo_strategy_is_dist_and_sums_are_exact(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert res["strategy"] == "DistAllReduce" and res["name"] == "gloo"
        assert res["sums_ok"] == [True, True, True, True]


def test_gloo_other_collectives_still_work(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert res["gather"] == [[0.0, 1.0], [0.0, 1.0]]
        assert res["min"] == 10
        assert res["bcast"] == "addr-of-rank-0"


@pytest.mark.parametrize(
    "scenario, reason",
    [
        ("no_cuda", "CUDA is unavailable"),
        ("import_fails", "ImportError"),
        ("rendezvous_fails", "peer access"),
    ],
)
def test_probe_failure_falls_back_with_one_warning(
    gloo_results: list[dict[str, Any]], scenario: str, reason: str
) -> None:
    for res in gloo_results:
        r = res[scenario]
        assert r["strategy"] == "DistAllReduce" and r["sum_ok"]
        assert len(r["warnings"]) == 1 and "\n" not in r["warnings"][0]
        assert "symmetric-memory all-reduce unavailable, using gloo" in r["warnings"][0]
        assert reason in r["warnings"][0]


def test_probe_failure_on_one_rank_falls_back_on_all(gloo_results: list[dict[str, Any]]) -> None:
    r0, r1 = (res["one_rank_fails"] for res in gloo_results)
    assert r0["impl"] and r1["impl"]  # None on both ranks
    assert r0["closed"] == [True] and r1["closed"] == []
    assert r0["problem"] == "set-up failed on a peer rank"
    assert "out of memory" in r1["problem"]


def test_forced_strategies(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert "symmetric-memory all-reduce unavailable" in res["forced"]
        assert res["nccl"] == "DistAllReduce"
