"""`kv_cache_dtype="fp8"`: keys and values stored as e4m3 with one scale per layer each (layers/kv_fp8.py).

The reference is HF transformers (fp32) with a KV cache that stores what an FP8 cache holds: every key
and value, as it enters the cache, divided by its layer's scale (as x times the float32 reciprocal),
saturated to +-448, rounded to e4m3 and multiplied back. The engine's greedy tokens must equal it for
every family, at TP 1 and 2, through chunked prefill, preemption and prefix-cache hits, and with the
checkpoint's own scales. The Triton kernels (the fused rotary + cache write, split-KV decode, paged
prefill) run in Triton's interpreter against the PyTorch ops and a float64 brute force.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import GEMMA2, hf_greedy, random_prompts, run_interpreted
from safetensors.torch import load_file, save_file
from test_fp8 import online_fp8_reference
from test_triton_decode import BRUTE_FORCE, CHUNKED_PREEMPTED, ENGINE_VS_HF

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import ConfigError

E4M3_MAX = 448.0
MAX_TOKENS = 10
PROMPTS = random_prompts((13, 7, 20, 3, 17), 300, seed=11)


def fp8_rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    stored = (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


class FP8RoundedCache(transformers.DynamicCache):
    """HF's dynamic cache holding each layer's keys and values as an FP8 cache would."""

    def __init__(self, scales: list[tuple[float, float]], config: Any) -> None:
        super().__init__(config=config)
        self.scales = scales

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        k_scale, v_scale = self.scales[layer_idx]
        return super().update(
            fp8_rounded(key_states, k_scale), fp8_rounded(value_states, v_scale), layer_idx, *args, **kwargs
        )


def hf_fp8_greedy(
    model_dir: Path, prompts: list[list[int]], scales: list[tuple[float, float]] | None = None
) -> list[list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    eager = {"attn_implementation": "eager"} if config["architectures"][0] == "Gemma2ForCausalLM" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **eager).eval()
    model.generation_config.eos_token_id = None
    layers = model.config.num_hidden_layers
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        cache = FP8RoundedCache(scales or [(1.0, 1.0)] * layers, model.config)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0, past_key_values=cache,
        )  # fmt: skip
        outs.append(gen[0, len(p) :].tolist())
    return outs


def engine_greedy(model_dir: Path, prompts: list[list[int]], **options: Any) -> list[list[int]]:
    options = {"dtype": "float32", "device": "cpu", "seed": 0, **options}
    with LLM(model=model_dir, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "mixtral": (
        "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
    ),
    "gemma2": ("Gemma2ForCausalLM", GEMMA2),
}
# Prompts of 13-20 tokens prefill in chunks of at most 16; 22 blocks of 4 tokens make requests preempt.
CHUNKED = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "block_size": 4, "num_kv_blocks": 22,
           "max_model_len": 48}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("tp", "options"), [(1, {}), (1, CHUNKED), (2, CHUNKED)], ids=["tp1", "tp1-chunked",
                                                                                         "tp2-chunked"])
def test_greedy_equals_hf_with_an_fp8_rounded_cache(
    make_checkpoint: Callable[..., Path], family: str, tp: int, options: dict[str, Any]
) -> None:
    arch, overrides = FAMILIES[family]
    model_dir = make_checkpoint(arch, **overrides)
    want = hf_fp8_greedy(model_dir, PROMPTS)
    got = engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8", tensor_parallel_size=tp, **options)
    assert got == want


def test_fp8_cache_changes_the_tokens_it_should(make_checkpoint: Callable[..., Path]) -> None:
    """The rounding is in effect: the reference with an FP8-rounded cache differs from plain fp32 HF on
    these prompts (else the test above could not tell an FP8 cache from a full-precision one)."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    plain = engine_greedy(model_dir, PROMPTS)
    assert hf_fp8_greedy(model_dir, PROMPTS) != plain
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8_e4m3") != plain


def test_fp8_weights_with_an_fp8_cache(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Online FP8 weights and the FP8 cache together: HF on the quantized-and-back weights, rounded cache."""
    src = make_checkpoint("LlamaForCausalLM", seed=4)
    ref = online_fp8_reference(src, tmp_path / "ref")
    got = engine_greedy(src, PROMPTS, kv_cache_dtype="fp8", quantization="fp8", tensor_parallel_size=2)
    assert got == hf_fp8_greedy(ref, PROMPTS)


def test_prefix_cache_hits_read_the_fp8_blocks(make_checkpoint: Callable[..., Path]) -> None:
    """Later prompts share a cached 16-token prefix (four blocks of 4): the hit's keys come from the FP8
    blocks, the rest from the step; both as HF's rounded cache holds them."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    prefix = PROMPTS[2][:16]
    prompts = [PROMPTS[2], [*prefix, 7, 8, 9], prefix + PROMPTS[1]]
    with LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", block_size=4) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in got] == [0, 16, 16]
    assert [o.outputs[0].token_ids for o in got] == hf_fp8_greedy(model_dir, prompts)


SCALES = [(0.37, 0.021), (0.53, 0.17)]  # (key, value) per layer; not powers of two: the grid moves


def _with_kv_scales(model_dir: Path, names: dict[str, Callable[[int], float]], tag: str,
                    shape: tuple[int, ...] = ()) -> Path:  # fmt: skip
    """A copy of the checkpoint with KV-scale tensors: name suffix (after "self_attn.") -> layer -> value."""
    out = model_dir.with_name(f"{model_dir.name}-kv-{tag}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    for i in range(len(SCALES)):
        for suffix, value in names.items():
            weights[f"model.layers.{i}.self_attn.{suffix}"] = torch.full(shape, value(i), dtype=torch.float32)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("form", ["k_scale", "output_scale"])
def test_checkpoint_kv_scales_are_used(make_checkpoint: Callable[..., Path], form: str) -> None:
    """llm-compressor's kv_cache_scheme tensors (self_attn.k_scale / v_scale, or the older
    k_proj.output_scale / v_proj.output_scale): used with an FP8 cache at TP 1 and 2, ignored with
    kv_cache_dtype="auto"."""
    base = make_checkpoint("LlamaForCausalLM")
    k_name, v_name = (
        ("k_scale", "v_scale") if form == "k_scale" else ("k_proj.output_scale", "v_proj.output_scale")
    )
    model_dir = _with_kv_scales(base, {k_name: lambda i: SCALES[i][0], v_name: lambda i: SCALES[i][1]}, form)
    want = hf_fp8_greedy(base, PROMPTS, SCALES)
    assert want != hf_fp8_greedy(base, PROMPTS)  # these scales change the tokens
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8") == want
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8", tensor_parallel_size=2) == want
    assert engine_greedy(model_dir, PROMPTS) == hf_greedy(base, PROMPTS, MAX_TOKENS)


def test_checkpoint_kv_scales_leave_a_16_bit_cache_alone(make_checkpoint: Callable[..., Path]) -> None:
    """With kv_cache_dtype="auto" the Triton kernels (the GPU's default) ignore a checkpoint's KV scales too,
    decode and chunked prefill over cached context alike, in Triton's interpreter."""
    base = make_checkpoint("LlamaForCausalLM")
    model_dir = _with_kv_scales(base, {"k_scale": lambda i: SCALES[i][0], "v_scale": lambda i: SCALES[i][1]},
                                "auto")  # fmt: skip
    script = ENGINE_VS_HF.replace("max_tokens=8", f"max_tokens={MAX_TOKENS}")
    args = (str(model_dir), json.dumps(PROMPTS), "padded", json.dumps(CHUNKED))
    got = json.loads(run_interpreted(script, *args))
    assert got["tokens"] == hf_greedy(base, PROMPTS, MAX_TOKENS)


def test_query_and_probability_scales_are_dropped(make_checkpoint: Callable[..., Path]) -> None:
    """An attention-quantized checkpoint's q_scale / prob_scale (and q_proj.output_scale) load and change
    nothing: attention runs in the model dtype."""
    base = make_checkpoint("LlamaForCausalLM")
    names = {"q_scale": lambda i: 0.3, "prob_scale": lambda i: 1 / 448, "q_proj.output_scale": lambda i: 0.2,
             "k_scale": lambda i: SCALES[i][0], "v_scale": lambda i: SCALES[i][1]}  # fmt: skip
    model_dir = _with_kv_scales(base, names, "attn")
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8") == hf_fp8_greedy(base, PROMPTS, SCALES)
    assert engine_greedy(model_dir, PROMPTS) == hf_greedy(base, PROMPTS, MAX_TOKENS)


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _with_quantization_config(model_dir: Path, quantization_config: dict[str, Any]) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(
    ("architecture", "attention_group"),
    [("LlamaForCausalLM", False), ("LlamaForCausalLM", True), ("Phi3ForCausalLM", False)],
)
def test_compressed_tensors_kv_only_checkpoints(
    make_checkpoint: Callable[..., Path], architecture: str, attention_group: bool
) -> None:
    """llm-compressor's KV-cache-only checkpoints (no weight groups, a kv_cache_scheme, 16-bit weights) and
    its attention-quantized ones (a group targeting attention, with query scales) load with their scales;
    also for Phi-3, whose FP8-weight checkpoints are refused."""
    base = make_checkpoint(architecture)
    names = {"k_scale": lambda i: SCALES[i][0], "v_scale": lambda i: SCALES[i][1]}
    groups: dict[str, Any] = {}
    if attention_group:
        names["q_scale"] = lambda i: 0.25
        groups["group_0"] = {"targets": ["LlamaAttention"], "input_activations": KV_SCHEME}
    model_dir = _with_kv_scales(base, names, f"ct-{architecture}-{attention_group}")
    _with_quantization_config(model_dir, {"quant_method": "compressed-tensors", "format": "dense",
                                          "config_groups": groups, "kv_cache_scheme": KV_SCHEME})  # fmt: skip
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8") == hf_fp8_greedy(base, PROMPTS, SCALES)
    assert engine_greedy(model_dir, PROMPTS) == hf_greedy(base, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("change", [{"strategy": "head"}, {"dynamic": True}, {"num_bits": 4, "type": "int"},
                                    {"symmetric": False}])  # fmt: skip
def test_unsupported_kv_cache_schemes_are_refused(
    make_checkpoint: Callable[..., Path], change: dict[str, Any]
) -> None:
    base = make_checkpoint("LlamaForCausalLM")
    model_dir = _with_kv_scales(base, {"k_scale": lambda i: 0.5}, "ct-bad")
    _with_quantization_config(model_dir, {"quant_method": "compressed-tensors", "config_groups": {},
                                          "kv_cache_scheme": {**KV_SCHEME, **change}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"kv_cache_scheme .* is not supported"):
        LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8")


def test_one_kv_scale_for_both(make_checkpoint: Callable[..., Path]) -> None:
    """AutoFP8's self_attn.kv_scale: one scale for keys and values."""
    base = make_checkpoint("LlamaForCausalLM")
    model_dir = _with_kv_scales(base, {"kv_scale": lambda i: SCALES[i][0]}, "both")
    both = [(k, k) for k, _ in SCALES]
    assert engine_greedy(model_dir, PROMPTS, kv_cache_dtype="fp8") == hf_fp8_greedy(base, PROMPTS, both)


@pytest.mark.parametrize(
    ("shape", "value", "match"),
    [((2,), 0.5, "only one scale per layer"), ((), 0.0, "positive finite"), ((1,), -1.0, "positive finite")],
)
def test_bad_checkpoint_kv_scales_are_refused(
    make_checkpoint: Callable[..., Path], shape: tuple[int, ...], value: float, match: str
) -> None:
    base = make_checkpoint("LlamaForCausalLM")
    model_dir = _with_kv_scales(base, {"k_scale": lambda i: value}, f"bad{len(shape)}{value}", shape)
    with pytest.raises(ConfigError, match=match):
        LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8")


def test_fp8_cache_holds_four_times_the_fp32_blocks(make_checkpoint: Callable[..., Path]) -> None:
    """The cache is sized at its stored size: the same memory holds 4x the blocks of an fp32 cache. The
    gather path's decode reserve counts what it builds: an FP8 layer's bytes and then their fp32 copy."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    blocks, reserve_per_element = {}, {}
    for kv in ("auto", "fp8"):
        options = {"cpu_kv_cache_gib": 0.01, "kv_cache_dtype": kv}
        with LLM(model=model_dir, dtype="float32", device="cpu", **options) as llm:
            runner = llm.engine.executor.worker.runner
            assert runner.kv_caches[0][0].dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
            blocks[kv] = llm.engine.scheduler.kv.pool.num_blocks
            elements = (2 * runner.config.scheduler.max_num_seqs * runner.max_blocks * runner.block_size
                        * runner.model.num_local_kv_heads * runner.config.model.head_dim)  # fmt: skip
            reserve_per_element[kv] = runner.decode_reserve_bytes() / elements
    assert blocks["fp8"] // 4 == blocks["auto"]  # the same bytes, each count rounded down
    assert reserve_per_element == {"auto": 4, "fp8": 5}


# Triton's interpreter converts float32 to e4m3 by truncating the mantissa, with a wrong exponent where
# rounding carries (7.9 -> 4); the GPU's cvt rounds to nearest even. Under the interpreter these checks
# convert to e4m3 the way PyTorch (and the GPU) do.
INTERPRETER_FP8 = """
import numpy as np, torch, triton.language as tl
from triton.runtime import interpreter
_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
def _rne_fp_to_fp(self, src, dst_type, rounding_mode):
    if dst_type.scalar != tl.float8e4nv:
        return _to_fp(self, src, dst_type, rounding_mode)
    data = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32)).to(torch.float8_e4m3fn)
    return interpreter.TensorHandle(data.view(torch.uint8).numpy(), tl.float8e4nv)
interpreter.InterpreterBuilder.create_fp_to_fp = _rne_fp_to_fp
"""

FUSED_WRITE = """
from tp_runtime.layers import kv_fp8
from tp_runtime.layers.attention import write_kv
from tp_runtime.layers.fused_triton import rotary_and_cache_
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    T, H, KVH, D, BS = 9, 4, 2, 24, 8
    q, k = torch.randn(T, H, D).to(dtype), (3 * torch.randn(T, KVH, D)).to(dtype)
    v = (0.05 * torch.randn(T, KVH, D)).to(dtype)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 447.9])  # saturates
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    slots = torch.tensor([3, 0, 5, 9, -1, 1, 2, 15, 8])
    scales = (0.37, 0.013)
    caches = [torch.zeros(2, BS, KVH, D, dtype=torch.float8_e4m3fn) for _ in range(4)]
    rotary_and_cache_(q, k, v, cos, sin, caches[0], caches[1], slots, scales)
    keep = slots >= 0
    write_kv(caches[2], caches[3], k[keep], v[keep], slots[keep], scales)  # k: the kernel's rotated keys
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        differ = (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
        assert differ == 0, (dtype, differ)
    assert caches[0].float().abs().max() == 448.0 and not caches[0].float().isnan().any()
print("OK")
"""

# The brute force reads the dequantized caches (e4m3 times the scale, in float64).
KERNELS_FP8 = """
def fp8_cache(cache, scale):
    return (cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

def decode(dtype, H, KVH, D, BS, lens, windows, splits_list, softcap=None, scales=(0.3, 0.07)):
    kc, vc, tables, tables_dev = paged_cache(lens, BS, KVH, D, torch.float32)
    kc8, vc8 = fp8_cache(kc, scales[0]), fp8_cache(vc, scales[1])
    kd, vd = kc8.double() * scales[0], vc8.double() * scales[1]
    q = torch.randn(len(lens), H, D).to(dtype)
    lens_dev = torch.tensor(lens).to(DEVICE)
    for window in windows:
        want = torch.cat([
            attend(q[b : b + 1], kd[tables[b]].view(-1, KVH, D)[:L], vd[tables[b]].view(-1, KVH, D)[:L],
                   torch.tensor([L - 1]), window, D ** -0.5, softcap)
            for b, L in enumerate(lens)
        ])
        for splits in splits_list:
            got = kernels.paged_decode_attention(q.to(DEVICE), kc8.to(DEVICE), vc8.to(DEVICE), tables_dev,
                                                 lens_dev, D ** -0.5, window, splits, softcap=softcap,
                                                 kv_scales=scales)
            ok, err = close(got.cpu(), want, dtype)
            assert ok, ("decode", dtype, H, KVH, D, lens, window, splits, softcap, err)

def prefill(dtype, H, KVH, D, BS, cases, windows, softcap=None, scales=(0.3, 0.07)):
    for context_len, chunk_len in cases:
        T = context_len + chunk_len
        kc, vc, tables, _ = paged_cache([T], BS, KVH, D, torch.float32)
        kc8, vc8 = fp8_cache(kc, scales[0]), fp8_cache(vc, scales[1])
        kd, vd = kc8.double() * scales[0], vc8.double() * scales[1]
        table = tables[0][: math.ceil(T / BS)]
        q = torch.randn(chunk_len, H, D).to(dtype)
        for window in windows:
            want = attend(q, kd[table].view(-1, KVH, D)[:T], vd[table].view(-1, KVH, D)[:T],
                          torch.arange(context_len, T), window, D ** -0.5, softcap)
            got = kernels.paged_prefill_attention(q.to(DEVICE), kc8.to(DEVICE), vc8.to(DEVICE),
                                                  table.to(DEVICE), context_len, D ** -0.5, window,
                                                  softcap=softcap, kv_scales=scales)
            ok, err = close(got.cpu(), want, dtype)
            assert ok, ("prefill", dtype, H, KVH, D, context_len, chunk_len, window, softcap, err)

f32, bf16 = torch.float32, torch.bfloat16
decode(f32, 8, 2, 24, 16, [1, 37, 130], [None, 20], [1, 3])
decode(f32, 4, 1, 80, 32, [65, 2], [None], [1, 4], softcap=1.5)
decode(bf16, 8, 2, 128, 16, [90, 257], [None, 64], [1, 4])
prefill(f32, 8, 2, 24, 16, [(0, 20), (37, 5), (64, 70)], [None, 24])
prefill(f32, 4, 1, 80, 32, [(45, 30)], [None], softcap=1.5)
prefill(bf16, 4, 2, 128, 16, [(20, 33)], [None, 16])
print("OK")
"""


def test_fused_rotary_cache_write_stores_write_kvs_bytes() -> None:
    assert run_interpreted(INTERPRETER_FP8 + FUSED_WRITE) == "OK"


def test_triton_kernels_read_fp8_caches() -> None:
    assert run_interpreted(INTERPRETER_FP8 + BRUTE_FORCE + KERNELS_FP8, "cpu") == "OK"


@pytest.mark.parametrize(("arch", "overrides"), [("LlamaForCausalLM", {}), ("Gemma2ForCausalLM", GEMMA2)])
def test_engine_with_triton_kernels_equals_hf_with_an_fp8_rounded_cache(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    """The fused rotary + FP8 cache write, the Triton decode and prefill kernels and the padded mixed-step
    path, through chunked prefill and preemption, in Triton's interpreter."""
    model_dir = make_checkpoint(arch, **overrides)
    prompts = [list(range(3, 30)), list(range(5, 35)), [5, 9, 200]]
    options = {**CHUNKED_PREEMPTED, "kv_cache_dtype": "fp8"}
    script = INTERPRETER_FP8 + ENGINE_VS_HF.replace("max_tokens=8", f"max_tokens={MAX_TOKENS}")
    args = (str(model_dir), json.dumps(prompts), "padded", json.dumps(options))
    got = json.loads(run_interpreted(script, *args))
    assert got["preemptions"] > 0
    assert got["tokens"] == hf_fp8_greedy(model_dir, prompts)
