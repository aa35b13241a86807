"""The fused all-reduce + residual add + RMSNorm (layers/allreduce_norm_triton.py) and the model's use of it.

- The kernel, in Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must be set before Triton is
  imported), against a brute-force sum and norm. CPU tensors stand for every rank's symmetric memory; the
  peers are played by writing their rows before each call. World sizes 1-4, three dtypes, odd row widths,
  every region in turn, rows whose call counts differ, -0.0 in a partial sum (the empty marker), and a wait
  that holds until every element of the peer's row has arrived.
- The model at TP=2 over gloo with a strategy that says it fuses: row-parallel outputs leave unreduced and
  every norm after them sums them exactly once, so the logits equal the unfused model's bit for bit, also
  when the strategy declines a message. Layers with a bias on a row-parallel output never defer.
The cross-GPU path itself (symmetric memory, NVLink) runs on GPUs only: scripts/check_all_reduce.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp
from conftest import run_interpreted

from tp_runtime import distributed as D
from tp_runtime.config import build_model_config
from tp_runtime.distributed import DistAllReduce, TPGroup

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

KERNEL_CHECKS = """
import threading, torch
from tp_runtime.layers.allreduce_norm_triton import allreduce_add_rms_norm

MAX_ROWS, EPS = 8, 1e-5
g = torch.Generator().manual_seed(0)

def reference(partials, residual, weight):
    total = torch.zeros(partials[0].shape, dtype=torch.float32)
    for p in partials:  # ranks in order, in float32, rounded once
        total += p.float()
    summed = total.to(residual.dtype)
    new_residual = (summed.float() + residual.float()).to(residual.dtype)
    h = new_residual.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(residual.dtype)
    return (weight.float() * normed.float()).to(residual.dtype), new_residual

def empty(t):  # elements holding -0.0, the empty marker
    return (t == 0) & torch.signbit(t)

class Memory:
    # Every rank's symmetric memory as CPU tensors: three regions, each a slot of MAX_ROWS rows per rank,
    # all empty (-0.0) to start with, as prepare_fused_norm leaves them.
    def __init__(self, world, n_cols, dtype):
        self.world, self.n_cols, self.slot = world, n_cols, MAX_ROWS * n_cols
        self.data = [[torch.full((world * self.slot,), -0.0, dtype=dtype) for _ in range(3)]
                     for _ in range(world)]
        self.data_ptrs = torch.tensor([[d.data_ptr() for d in regions] for regions in self.data],
                                      dtype=torch.int64)

    def row(self, rank, region, slot, row):
        start = slot * self.slot + row * self.n_cols
        return self.data[rank][region][start : start + self.n_cols]

def play_peers(mem, rank, partials, epochs):
    # Each peer stores its rows into this rank's region of the row's call (slot = the peer's rank).
    for row in range(partials[0].shape[0]):
        for p in range(mem.world):
            if p != rank:
                mem.row(rank, int(epochs[row]), p, row).copy_(partials[p][row] + 0.0)  # -0.0 -> +0.0

def call(mem, rank, x, residual, weight, epochs):
    return allreduce_add_rms_norm(x, residual, weight, EPS, rank=rank, world_size=mem.world,
                                  data_ptrs=mem.data_ptrs, slot_elems=mem.slot, epochs=epochs)

checked = 0
for world in (1, 2, 3, 4):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n_cols in (64, 72, 100):
            rank = world - 1 if n_cols == 72 else 0
            mem = Memory(world, n_cols, dtype)
            epochs = torch.zeros(MAX_ROWS, dtype=torch.int32)
            weight = torch.randn(n_cols, generator=g).to(dtype)
            for i, rows in enumerate((3, 5, 2, 5, 8, 3, 3)):
                partials = [torch.randn(rows, n_cols, generator=g).to(dtype) for _ in range(world)]
                partials[rank][0, 1] = -0.0  # sent as +0.0: the sum is the same
                residual = torch.randn(rows, n_cols, generator=g).to(dtype)
                before = epochs.clone()
                play_peers(mem, rank, partials, epochs)
                want_out, want_res = reference(partials, residual, weight)
                x = partials[rank].clone()
                got = call(mem, rank, x, residual, weight, epochs)
                what = f"world {world} {dtype} cols {n_cols} call {i}"
                assert torch.equal(x, partials[rank]), what  # the input is left as it was
                if dtype == torch.bfloat16:  # the interpreter rounds float32 -> bfloat16 toward zero
                    torch.testing.assert_close(residual, want_res, rtol=2**-5, atol=2**-5, msg=what)
                    torch.testing.assert_close(got, want_out, rtol=2**-5, atol=2**-5, msg=what)
                else:
                    assert torch.equal(residual, want_res), what
                    tol = 1e-6 if dtype == torch.float32 else 1e-3
                    torch.testing.assert_close(got, want_out, msg=what, rtol=tol, atol=tol)
                for row in range(rows):
                    e = int(before[row])
                    assert int(epochs[row]) == (e + 1) % 3, what
                    sent = partials[rank][row] + 0.0
                    for p in range(world):  # this rank's row reached every rank's slot `rank`
                        got_row = mem.row(p, e, rank, row)
                        assert torch.equal(got_row, sent) and not empty(got_row).any(), what
                    for p in range(world):  # the previous call's region is empty again
                        assert empty(mem.row(rank, (e + 2) % 3, p, row)).all(), what
                assert torch.equal(epochs[rows:], before[rows:]), what
                checked += 1

# The wait holds until every element of the peer's row has arrived: observed by the row this rank sent
# to the peer while its residual is still as it was; then the peer's row arrives, in two halves, and the
# call finishes with the right sum.
mem = Memory(2, 64, torch.float32)
epochs = torch.zeros(MAX_ROWS, dtype=torch.int32)
weight = torch.ones(64)
partials = [torch.full((1, 64), 1.0), torch.full((1, 64), 2.0)]
residual = torch.zeros(1, 64)
result = {}
def rank0_call():
    result["out"] = call(mem, 0, partials[0].clone(), residual, weight, epochs)
worker = threading.Thread(target=rank0_call)
worker.start()
while empty(mem.row(1, 0, 0, 0)).any():  # rank 0's row has reached rank 1: rank 0 now waits for rank 1's
    worker.join(0.01)
    assert worker.is_alive(), "the call returned before its peer's row arrived"
mem.row(0, 0, 1, 0)[:32].copy_(partials[1][0, :32])
worker.join(0.5)  # half of the row is there: the call must not finish (a correct kernel never does)
assert worker.is_alive() and not result and torch.equal(residual, torch.zeros(1, 64))
mem.row(0, 0, 1, 0)[32:].copy_(partials[1][0, 32:])
worker.join(60)
assert not worker.is_alive() and torch.equal(residual, torch.full((1, 64), 3.0))
torch.testing.assert_close(result["out"], torch.ones(1, 64))

# A peer one call ahead has already stored its row of the next call: this call's refill (of the region
# before) leaves it alone, and the next call uses it without waiting.
mem = Memory(2, 64, torch.float32)
epochs = torch.zeros(MAX_ROWS, dtype=torch.int32)
calls = [[torch.full((1, 64), v) for v in (1.0, 2.0)], [torch.full((1, 64), v) for v in (4.0, 8.0)]]
for region, (_, peer) in enumerate(calls):
    mem.row(0, region, 1, 0).copy_(peer[0])
for region, (own, peer) in enumerate(calls):
    residual = torch.zeros(1, 64)
    call(mem, 0, own.clone(), residual, torch.ones(64), epochs)
    assert torch.equal(residual, own + peer), region
    if region == 0:
        assert torch.equal(mem.row(0, 1, 1, 0), calls[1][1][0])  # the next call's row is intact
print(f"OK {checked}")
"""


@needs_triton
def test_kernel_matches_brute_force_in_the_interpreter() -> None:
    assert run_interpreted(KERNEL_CHECKS, stderr_tail=6000, whole_output=True) == "OK 252"


# ----------------------------------------------------------------------------- the model at TP=2 (gloo)
WORLD = 2


class _FusingDist(DistAllReduce):
    """Says it fuses; sums through gloo, then the norm as RMSNorm computes it. Declines messages of
    `decline_rows` rows, which the model must then reduce and normalise itself."""

    def __init__(self, decline_rows: int = -1) -> None:
        super().__init__()
        self.decline_rows = decline_rows
        self.fused_calls = 0
        self.declined = 0

    @property
    def fuses_add_rms_norm(self) -> bool:
        return True

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        if x.shape[0] == self.decline_rows:
            self.declined += 1
            return None
        self.fused_calls += 1
        residual.add_(self(x))
        h = residual.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _forward(model: Any, tokens: list[int]) -> torch.Tensor:
    from tp_runtime.layers.attention import AttentionMetadata, PrefillChunk, TorchAttention

    n = len(tokens)
    cfg = model.config
    shape = (4, 16, model.num_local_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        backend=TorchAttention(), slot_mapping=torch.arange(n), num_decode_tokens=0,
        prefills=[PrefillChunk(0, n, 0, torch.zeros(0, dtype=torch.int64))],
    )  # fmt: skip
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


def _model_child(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    from tp_runtime.loader import load_weights
    from tp_runtime.models.registry import model_class

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    D.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, WORLD, 60.0, cpu)
    cfg = build_model_config(checkpoint, dtype="float32", device="cpu")
    tokens = [1, 17, 42, 5, 99, 3]
    res: dict[str, Any] = {}

    def build(strategy: D.AllReduce) -> Any:
        model = model_class(cfg.architecture)(cfg, TPGroup(rank, WORLD, strategy), torch.float32, cpu)
        load_weights(model, checkpoint, torch.float32)
        return model.eval()

    plain = build(DistAllReduce())
    want = _forward(plain, tokens)
    for name, strategy in (("fused", _FusingDist()), ("declined", _FusingDist(decline_rows=len(tokens)))):
        model = build(strategy)
        got = _forward(model, tokens)
        res[name] = {
            "defers": bool(model.reduce_in_norm),
            "equal": bool(torch.equal(got, want)),
            "fused_calls": strategy.fused_calls,
            "declined": strategy.declined,
        }
    res["plain_defers"] = bool(plain.reduce_in_norm)
    res["layers"] = cfg.num_layers
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()  # no rank tears gloo down while its peer still talks to it
    D.destroy_process_group()
    # Skip the interpreter's teardown, where gloo's threads can still abort the process ("terminate
    # called without an active exception") after the result is written.
    os._exit(0)


def test_model_sums_each_partial_once_in_the_norm(make_checkpoint: Any, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    checkpoint = make_checkpoint()
    tmp.spawn(_model_child, args=(port, str(checkpoint), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sites = 2 * res["layers"]  # after attention and after the MLP of every layer (the last: final norm)
        assert not res["plain_defers"]
        assert res["fused"] == {"defers": True, "equal": True, "fused_calls": sites, "declined": 0}, res
        assert res["declined"] == {"defers": True, "equal": True, "fused_calls": 0, "declined": sites}, res


@pytest.mark.parametrize("overrides", [{"attention_bias": True}, {"mlp_bias": True}])
def test_layers_with_a_row_parallel_bias_never_defer(make_checkpoint: Any, overrides: dict[str, Any]) -> None:
    from tp_runtime.models.registry import model_class

    cfg = build_model_config(make_checkpoint(**overrides), dtype="float32", device="cpu")
    tp = TPGroup(0, WORLD, _FusingDist())
    model = model_class(cfg.architecture)(cfg, tp, torch.float32, torch.device("cpu"))
    assert not model.reduce_in_norm


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("GemmaForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}), ("Olmo2ForCausalLM", {})],
)
def test_gemma_and_olmo2_layers_never_defer(
    make_checkpoint: Any, arch: str, overrides: dict[str, Any]
) -> None:
    """The fused all-reduce + norm kernel computes Llama's norm of the block's output plus the residual,
    not Gemma's (1 + w) one nor OLMo 2's (which norms the block's output alone, before the add, with the
    weight applied in float32): such a model reduces in its row-parallel layers even where the strategy
    fuses."""
    from tp_runtime.models.registry import model_class

    checkpoint = make_checkpoint(arch, **overrides)
    cfg = build_model_config(checkpoint, dtype="float32", device="cpu")
    tp = TPGroup(0, WORLD, _FusingDist())
    model = model_class(cfg.architecture)(cfg, tp, torch.float32, torch.device("cpu"))
    assert not model.reduce_in_norm
