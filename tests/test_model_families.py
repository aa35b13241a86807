"""Qwen3, Mixtral and Qwen3-MoE against HF transformers (fp32, CPU) on tiny random checkpoints.

- Greedy tokens equal HF's and logprobs are within 1e-4 at TP=1, 2 and (Mixtral) 4, through chunked
  prefill and preemption by recompute.
- Decode steps where most experts get no token: the CPU loop skips them and the output still equals HF.
- The CUDA expert paths ("grouped": torch._grouped_mm, "dense": every expert on every token) run on CPU
  too and equal the loop, alone and end to end in padded (decode-graph shaped) steps.
- Every rank's shards (q/k norms, router, stacked experts) equal slices cut by hand from the checkpoint, and
  each rank reads about 1/TP of the file.

Every RMSNorm weight, q_norm and k_norm included, is random here (HF initialises them to ones), so a norm
applied to the wrong heads or not at all would show.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import assert_same_tokens, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams, loader
from tp_runtime.config import build_model_config
from tp_runtime.distributed import IdentityAllReduce, TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers import moe
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.models.registry import model_class

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 32 with 4 heads: the q width (128) is not hidden_size (64).
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    # Every layer windowed (max_window_layers 0), with attention biases.
    "qwen3-window": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "attention_bias": True},
    ),
    # 8 experts, top-2, each expert as wide as a dense MLP; a sliding window as in Mistral.
    "mixtral": (
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
    # Many small experts, renormalised top-4 (as Qwen3-30B-A3B), layer 0 dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # transformers' defaults: no renormalisation; decoder_sparse_step 2 makes layer 0 dense, layer 1 sparse.
    "qwen3-moe-step2": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
}
# Expert projection names (gate, up, down) and the feed-forward's checkpoint name, per architecture.
EXPERT_NAMES = {
    "MixtralForCausalLM": (("w1", "w3", "w2"), "block_sparse_moe"),
    "Qwen3MoeForCausalLM": (("gate_proj", "up_proj", "down_proj"), "mlp"),
}

# A small token budget (prompts of 17 and 20 tokens prefill in chunks) and few KV blocks (requests are
# preempted, freed on every rank and recomputed): 22 blocks of 4 tokens hold about two ~40-token requests.
SCHED_KWARGS = dict(
    max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=22, max_model_len=48
)
PROMPTS = random_prompts((13, 7, 20, 3, 17, 10), 300, seed=5)
MAX_TOKENS = 20
TOP_K = 5


def with_random_norms(model_dir: Path) -> Path:
    """A copy of the checkpoint whose norm weights are 1 + N(0, 0.2), seeded (cached next to it)."""
    out = model_dir.with_name(model_dir.name + "-norms")
    if (out / "config.json").is_file():
        return out
    tmp = model_dir.with_name(model_dir.name + "-norms-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    tensors = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def family_dir(make_checkpoint: Callable[..., Path]) -> Callable[[str], Path]:
    def make(family: str) -> Path:
        arch, overrides = FAMILIES[family]
        return with_random_norms(make_checkpoint(arch, **overrides))

    return make


@functools.cache
def hf_model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def hf_reference(model_dir: Path) -> list[list[int]]:
    return hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def hf_logprobs(model_dir: Path, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = hf_model(model_dir)(ids).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def make_llm(model_dir: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(model=model_dir, tensor_parallel_size=tp, dtype="float32", device="cpu", seed=0, **kwargs)


def check_against_hf(llm: LLM, model_dir: Path, prompts: list[list[int]] = PROMPTS) -> None:
    """Greedy tokens equal HF's; at every position the top-k ids equal HF's and their logprobs are within
    1e-4 of HF's."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want = hf_reference(model_dir) if prompts is PROMPTS else hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_same_tokens(got, want, prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        ref = hf_logprobs(model_dir, prompt, comp.token_ids)
        for pos, entry in enumerate(comp.logprobs):
            top_lp, top_ids = ref[pos].topk(TOP_K)
            assert set(entry) == set(top_ids.tolist()), f"position {pos}: top-{TOP_K} ids differ from HF"
            for tid, lp in zip(top_ids.tolist(), top_lp.tolist(), strict=True):
                assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), f"position {pos}, token {tid}"


# ----------------------------------------------------------------------------- equivalence with HF

CASES = [
    ("qwen3", 1),
    ("qwen3", 2),
    ("qwen3-window", 1),
    ("mixtral", 1),
    ("mixtral", 2),
    ("mixtral", 4),  # 2 KV heads replicated over 4 ranks; each expert's 128 rows cut in 4
    ("qwen3-moe", 1),
    ("qwen3-moe", 2),
    ("qwen3-moe-step2", 1),
]


@pytest.mark.parametrize(("family", "tp"), CASES, ids=[f"{f}-tp{tp}" for f, tp in CASES])
def test_matches_hf_with_chunked_prefill_and_preemption(
    family: str, tp: int, family_dir: Callable[[str], Path]
) -> None:
    model_dir = family_dir(family)
    with make_llm(model_dir, tp, **SCHED_KWARGS) as llm:
        check_against_hf(llm, model_dir)
        assert llm.engine.scheduler.num_preemptions > 0, "the test did not force a preemption"
    assert max(map(len, PROMPTS)) > SCHED_KWARGS["max_num_batched_tokens"], "no prompt was chunked"


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_decode_steps_with_idle_experts_match_hf(
    family: str, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests decode together: 2 tokens choose at most 2·top-k experts, so most get none; the loop
    runs exactly the experts that got tokens."""
    model_dir = family_dir(family)
    steps: list[tuple[int, int, int]] = []  # (tokens, experts that got tokens, experts run)
    route, expert_mlp = SparseMoE.route, SparseMoE._expert_mlp

    def spy_route(self: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(self, x)
        steps.append((x.shape[0], ids.unique().numel(), 0))
        return weights, ids

    def spy_expert_mlp(self: SparseMoE, x: torch.Tensor, expert: int) -> torch.Tensor:
        tokens, hit, run = steps[-1]
        steps[-1] = (tokens, hit, run + 1)
        return expert_mlp(self, x, expert)

    monkeypatch.setattr(SparseMoE, "route", spy_route)
    monkeypatch.setattr(SparseMoE, "_expert_mlp", spy_expert_mlp)
    prompts = random_prompts((9, 4), 300, seed=3)
    with make_llm(model_dir, 1, max_num_seqs=2) as llm:
        num_experts = llm.config.model.num_experts
        check_against_hf(llm, model_dir, prompts)
    assert all(hit == run for _, hit, run in steps), "the loop ran an expert no token chose, or missed one"
    idle_steps = [s for s in steps if s[0] <= 2 and s[1] < num_experts]
    assert idle_steps, f"no decode step left an expert idle: {steps[:8]}"


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_cuda_expert_paths_in_padded_decode_steps_match_hf(
    impl: str, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts as the GPU runs them (sync-free, no per-expert host loop), in the decode-graph path's
    padded steps (run eagerly on CPU), through chunked prefill and preemption."""
    monkeypatch.setattr(moe, "pick_moe_impl", lambda *args: impl)
    model_dir = family_dir("mixtral")
    with make_llm(model_dir, 1, cuda_graphs="padded", **SCHED_KWARGS) as llm:
        check_against_hf(llm, model_dir)


# ----------------------------------------------------------------------------- the MoE layer alone


def _moe(tp: TPGroup, impl: str, **kwargs: Any) -> SparseMoE:
    """A SparseMoE filled with dummy weights, which give every rank its slice of the same full tensors."""
    layer = SparseMoE(
        hidden_size=64, intermediate_size=64, num_experts=8, top_k=2, expert_names=("w1", "w3", "w2"),
        tp=tp, dtype=torch.float32, device=torch.device("cpu"), fused=False, impl=impl, **kwargs,
    )  # fmt: skip
    for index, (_, shape, param, shard) in enumerate(layer.checkpoint_entries("")):
        source = loader.DummyTensor(
            shape, 11 + index, shape[-1] ** -0.5, 0.0, torch.float32, torch.device("cpu")
        )
        param.weight_loader(param, source, shard)  # type: ignore[attr-defined]
    return layer


@pytest.mark.parametrize(
    "routing",
    [dict(renormalize=True, fp32_weights=True), dict(renormalize=False, fp32_weights=False)],
    ids=["mixtral-routing", "qwen3-moe-routing"],
)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_paths_and_tp_shards_agree(tokens: int, routing: dict[str, bool]) -> None:
    """loop == grouped == dense at TP=1, and at TP=2 and 4 the ranks' partial outputs (each rank's experts
    summed before the one all-reduce, done here by hand) add up to the TP=1 output."""
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = _moe(TPGroup(0, 1), "loop", **routing)(x)
        for impl in ("grouped", "dense"):
            torch.testing.assert_close(_moe(TPGroup(0, 1), impl, **routing)(x), want, rtol=0, atol=1e-5)
        for tp in (2, 4):
            for impl in ("loop", "grouped", "dense"):
                parts = [_moe(TPGroup(r, tp, IdentityAllReduce()), impl, **routing)(x) for r in range(tp)]
                torch.testing.assert_close(torch.stack(parts).sum(0), want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- sharding


def _expected(
    hf: dict[str, torch.Tensor], name: str, arch: str, cfg: Any, tp: int, rank: int
) -> torch.Tensor:
    """The slice of HF tensors rank `rank` must hold for our parameter `name` (written independently)."""

    def rows(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        size = t.shape[0] // parts
        return t[index * size : (index + 1) * size]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return rows(t.T, tp, rank).T

    layer, _, leaf = name.rpartition(".")
    kv_heads = cfg.num_kv_heads
    kv_index, kv_parts = (rank, tp) if kv_heads >= tp else (rank * kv_heads // tp, kv_heads)
    if leaf == "weight" and layer.endswith("qkv_proj"):
        base = layer.removesuffix("qkv_proj")
        q = rows(hf[f"{base}q_proj.weight"], tp, rank)
        k = rows(hf[f"{base}k_proj.weight"], kv_parts, kv_index)
        v = rows(hf[f"{base}v_proj.weight"], kv_parts, kv_index)
        return torch.cat([q, k, v])
    if layer.endswith("gate_up_proj"):
        base = layer.removesuffix("gate_up_proj")
        return torch.cat(
            [rows(hf[f"{base}gate_proj.weight"], tp, rank), rows(hf[f"{base}up_proj.weight"], tp, rank)]
        )
    if layer.endswith(("o_proj", "down_proj")):
        return cols(hf[name])
    if leaf in ("router", "w13", "w2"):
        (gate, up, down), ffn = EXPERT_NAMES[arch]
        ffn = layer.removesuffix("mlp") + ffn
        if leaf == "router":
            return hf[f"{ffn}.gate.weight"]
        experts = range(cfg.num_experts)
        if leaf == "w2":
            return torch.stack([cols(hf[f"{ffn}.experts.{e}.{down}.weight"]) for e in experts])
        return torch.stack(
            [
                torch.cat([rows(hf[f"{ffn}.experts.{e}.{p}.weight"], tp, rank) for p in (gate, up)])
                for e in experts
            ]
        )
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = hf.get(name, hf["model.embed_tokens.weight"])
        per = -(-cfg.vocab_size // tp)
        shard = torch.zeros(per, full.shape[1])
        part = full[rank * per : min((rank + 1) * per, cfg.vocab_size)]
        shard[: part.shape[0]] = part
        return shard
    return hf[name]  # layer norms and q_norm / k_norm are replicated


SHARD_CASES = [("qwen3", 2), ("qwen3", 4), ("mixtral", 2), ("mixtral", 4), ("qwen3-moe", 2)]


@pytest.mark.parametrize(("family", "tp"), SHARD_CASES, ids=[f"{f}-tp{tp}" for f, tp in SHARD_CASES])
def test_each_rank_holds_its_slice(
    family: str, tp: int, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = family_dir(family)
    arch = FAMILIES[family][0]
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    hf = load_file(str(model_dir / "model.safetensors"))
    full_elements = sum(t.numel() for t in hf.values())
    read: list[int] = []
    original_init = loader.CheckpointTensor.__init__

    class CountingSlice:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def get_shape(self) -> list[int]:
            return list(self.inner.get_shape())

        def __getitem__(self, index: Any) -> torch.Tensor:
            out: torch.Tensor = self.inner[index]
            read.append(out.numel())
            return out

    def counting_init(self: loader.CheckpointTensor, handle: Any, name: str, dtype: torch.dtype) -> None:
        original_init(self, handle, name, dtype)
        self._slice = CountingSlice(self._slice)

    monkeypatch.setattr(loader.CheckpointTensor, "__init__", counting_init)
    for rank in range(tp):
        read.clear()
        model = model_class(arch)(cfg, TPGroup(rank, tp), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(model_dir), torch.float32)
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            assert torch.equal(param.data, _expected(hf, name, arch, cfg, tp, rank)), f"rank {rank}: {name}"
        # Norms, routers and replicated KV heads are read in full; everything else only this rank's part.
        assert sum(read) < full_elements / tp * 1.35, (rank, sum(read), full_elements)


def test_checkpoint_missing_an_expert_is_config_error(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Experts share one stacked parameter, so completeness is checked by checkpoint name."""
    model_dir = family_dir("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    cfg = build_model_config(broken, dtype="float32", device="cpu")
    model = model_class(cfg.architecture)(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"lacks tensors for: model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"
    ):
        loader.load_weights(model, str(broken), torch.float32)


# ----------------------------------------------------------------------------- config


def test_dummy_weights_load_for_every_family(family_dir: Callable[[str], Path]) -> None:
    for family in ("qwen3", "mixtral", "qwen3-moe"):
        cfg = build_model_config(family_dir(family), dtype="float32", device="cpu", load_format="dummy")
        model = model_class(cfg.architecture)(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
        loader.init_dummy_weights(model, 0, torch.float32, torch.device("cpu"))
        assert all(torch.isfinite(p).all() for p in model.parameters())  # type: ignore[attr-defined]


def test_config_fields(family_dir: Callable[[str], Path]) -> None:
    mixtral = build_model_config(family_dir("mixtral"), device="cpu")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and mixtral.sliding_window == 8
    window = build_model_config(family_dir("qwen3-window"), device="cpu")
    assert window.sliding_window == 8 and window.qkv_bias and window.o_proj_bias and window.moe_layers == ()
    qwen = build_model_config(family_dir("qwen3-moe"), device="cpu")
    assert qwen.moe_layers == (1,) and qwen.norm_topk_prob and qwen.head_dim == 16
    step2 = build_model_config(family_dir("qwen3-moe-step2"), device="cpu")
    assert step2.moe_layers == (1,) and not step2.norm_topk_prob


def test_tp_size_that_does_not_divide_the_experts_is_config_error(
    make_checkpoint: Callable[..., Path],
) -> None:
    model_dir = make_checkpoint(
        "Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=30,
        num_hidden_layers=1,
    )
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size=4 does not divide the experts' intermediate size 30"
    ):
        make_llm(model_dir, 4)


def test_qwen3_window_on_some_layers_is_config_error(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint(
        "Qwen3ForCausalLM", head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    with pytest.raises(ConfigError, match="sliding-window attention on some layers only"):
        make_llm(model_dir, 1)
