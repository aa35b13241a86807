"""FP8 checkpoint variants as they are published, against HF transformers on the dequantized weights.

Each case writes a tiny random checkpoint in one variant of the two FP8 formats (compressed-tensors,
transformers' / AutoFP8's `quant_method: "fp8"`): per-tensor scales that differ between the projections
the engine fuses (q/k/v, gate/up), scales stored as [], [1], [N] or [N, 1] and in 16-bit floats, static
activation scales (`input_scale`, `activation_scale`), block scales of layers whose widths are not
multiples of the block, biases, ignore lists under their several names, and a config nested as
`compression_config`. The reference is a float32 copy whose weights are the stored FP8 values times
their stored scales, dequantized here independently of the engine. Each rank's dequantized weights must
equal the reference's slices exactly, and greedy tokens (float32 on the CPU) must equal HF's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_tokens, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams, loader
from tp_runtime.config import build_model_config
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.quantization.fp8 import dequantize
from tp_runtime.models.registry import model_class

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0
# Per-tensor scales far apart between the parts of a fused layer: one scale for all of them (or the
# wrong part's) changes the weights by up to 20x.
SPREAD = {"q_proj": 1.0, "k_proj": 7.0, "v_proj": 0.35, "gate_proj": 3.0, "up_proj": 0.5, "down_proj": 2.0}


def _quantize(
    w: torch.Tensor, scheme: str, block: tuple[int, int], stretch: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale): amax / 448 (times `stretch`, per tensor) over the tensor, each row,
    or each block (ceil-divided: the last row and column blocks may be short)."""
    w = w.float()
    if scheme == "tensor":
        scale = (w.abs().max() / E4M3_MAX * stretch).reshape(1)
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    else:
        bn, bk = block
        scale = torch.empty(math.ceil(w.shape[0] / bn), math.ceil(w.shape[1] / bk))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / E4M3_MAX
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str, block: tuple[int, int]) -> torch.Tensor:
    """What the stored values stand for: e4m3 value times its stored scale (as stored, e.g. in bfloat16)."""
    s = scale.float()
    if scheme == "tensor":
        return q.float() * s.reshape(())
    if scheme == "channel":
        return q.float() * s.reshape(-1, 1)
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def write_variant(
    src: Path,
    out: Path,
    quantization_config: dict[str, Any],
    scheme: str,
    *,
    block: tuple[int, int] = (16, 16),
    scale_name: str = "weight_scale",
    scale_shape: Callable[[torch.Tensor], torch.Tensor] = lambda s: s,
    scale_dtype: torch.dtype = torch.float32,
    ignore: tuple[str, ...] = (),
    extra: Callable[[str], dict[str, torch.Tensor]] = lambda module: {},
    config_key: str = "quantization_config",
) -> Path:
    """An FP8 copy of checkpoint `src` at out/fp8 (its config's `config_key` = `quantization_config`)
    and its dequantized float32 reference at out/ref. `ignore`: module prefixes left unquantized;
    `extra(module)`: more tensors stored beside each quantized module's weight and scale."""
    fp8_dir, ref_dir = out / "fp8", out / "ref"
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module, leaf = name.removesuffix(".weight"), name.removesuffix(".weight").rsplit(".", 1)[-1]
        skipped = any(module == i or module.startswith(i + ".") for i in ignore)
        if name.endswith(".weight") and leaf in LINEAR and not skipped:
            q, scale = _quantize(t, scheme, block, SPREAD.get(leaf, 1.0))
            scale = scale_shape(scale.to(scale_dtype))
            quantized[name], quantized[f"{module}.{scale_name}"] = q, scale
            quantized.update(extra(module))
            reference[name] = _dequantize(q, scale, scheme, block)
        else:
            quantized[name] = reference[name] = t
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config[config_key] = quantization_config
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return out


def compressed_tensors(
    strategy: str, block: tuple[int, int] | None = None, activations: dict[str, Any] | None = None
) -> dict[str, Any]:
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                               "dynamic": False}  # fmt: skip
    if block is not None:
        weights["block_structure"] = list(block)
    dynamic = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations or dynamic,
            }
        },
        "ignore": ["lm_head"],
    }


STATIC_ACTIVATIONS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}


def assert_ranks_hold_reference(out: Path, tp: int) -> None:
    """Each rank's dequantized FP8 weights equal the same rank's weights of the reference loaded unquantized
    (fused layers included: each part with its own scales)."""
    cfg = build_model_config(out / "fp8", dtype="float32")
    plain = dataclasses.replace(cfg, quantization=None)
    cpu = torch.device("cpu")
    checked = 0
    for rank in range(tp):
        model = model_class(cfg.architecture)(cfg, TPGroup(rank, tp), torch.float32, cpu)
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)
        ref = model_class(cfg.architecture)(plain, TPGroup(rank, tp), torch.float32, cpu)
        loader.load_weights(ref, str(out / "ref"), torch.float32, None)
        ref_modules = dict(ref.named_modules())  # type: ignore[attr-defined]
        for name, module in model.named_modules():  # type: ignore[attr-defined]
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
                got = dequantize(weight, module.weight_scale, module.scale_block_k, torch.float32)
                assert torch.equal(got, ref_modules[name].weight), (rank, name)
                checked += 1
    assert checked, "no FP8 layer was loaded"


def greedy(model: Path, prompts: list[list[int]], tp: int) -> list[list[int]]:
    llm = LLM(str(model), tensor_parallel_size=tp, dtype="float32", device="cpu")
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_matches_hf(out: Path, tp: int) -> None:
    assert_ranks_hold_reference(out, tp)
    prompts = random_prompts((6, 19), 300, seed=21)
    assert_same_tokens(greedy(out / "fp8", prompts, tp), hf_greedy(out / "ref", prompts, 8), prompts)


# ------------------------------------------------------------------------------------ compressed-tensors


@pytest.mark.parametrize(
    ("shape", "dtype", "tp"),
    [("[]", torch.bfloat16, 2), ("[1]", torch.float16, 1)],
    ids=["scalar-bf16-tp2", "one-fp16"],
)
def test_per_tensor_scales_of_fused_projections(
    shape: str, dtype: torch.dtype, tp: int, make_checkpoint: Any, tmp_path: Path
) -> None:
    """q, k, v (and gate, up) each with a scale of its own, 20x apart, stored as a 0-d or [1] tensor in a
    16-bit float: the fused layers keep each part's scale (GQA, 2 KV heads, at TP 2: one each)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    to_shape = (lambda s: s.reshape(())) if shape == "[]" else (lambda s: s.reshape(1))
    out = write_variant(src, tmp_path, compressed_tensors("tensor"), "tensor", scale_shape=to_shape,
                        scale_dtype=dtype)  # fmt: skip
    assert_matches_hf(out, tp)


def test_per_channel_scales_as_vectors_in_bfloat16(make_checkpoint: Any, tmp_path: Path) -> None:
    """Per-channel scales stored [N] (not [N, 1]) in bfloat16, at TP 2: each rank its rows' scales."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    out = write_variant(src, tmp_path, compressed_tensors("channel"), "channel",
                        scale_shape=lambda s: s.reshape(-1), scale_dtype=torch.bfloat16)  # fmt: skip
    assert_ranks_hold_reference(out, 2)


def test_static_activation_scales_are_read_and_dropped(make_checkpoint: Any, tmp_path: Path) -> None:
    """`input_activations: {dynamic: false, strategy: tensor}` with `input_scale` tensors ([] and [1],
    16-bit): the activation scales are dropped (on the CPU activations stay unquantized), the weights are
    the checkpoint's, and greedy tokens are HF's at TP 2."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)

    def input_scale(module: str) -> dict[str, torch.Tensor]:
        shape = () if "self_attn" in module else (1,)
        return {f"{module}.input_scale": torch.full(shape, 0.013, dtype=torch.bfloat16)}

    out = write_variant(src, tmp_path, compressed_tensors("tensor", activations=STATIC_ACTIVATIONS), "tensor",
                        extra=input_scale)  # fmt: skip
    assert_matches_hf(out, 2)


def test_an_activation_scale_does_not_stand_in_for_a_missing_weight_scale(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    """A weight whose weight_scale is missing is refused even where its input_scale is there (it loaded
    with a scale of 1.0: weights off by a factor of hundreds, silently)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    out = write_variant(src, tmp_path, compressed_tensors("tensor", activations=STATIC_ACTIVATIONS), "tensor",
                        extra=lambda m: {f"{m}.input_scale": torch.tensor([0.02])})  # fmt: skip
    tensors = load_file(str(out / "fp8" / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale"]
    save_file(tensors, str(out / "fp8" / "model.safetensors"))
    cfg = build_model_config(out / "fp8", dtype="float32")
    model = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"FP8 weights without their scales \(\*\.weight_scale\): .*o_proj"):
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)


def test_naive_quantized_format(make_checkpoint: Any, tmp_path: Path) -> None:
    """Early llm-compressor releases: format "naive-quantized" (the weights are e4m3 all the same)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    naive = {**compressed_tensors("channel"), "format": "naive-quantized"}
    assert_ranks_hold_reference(write_variant(src, tmp_path, naive, "channel"), 1)


def test_config_nested_as_compression_config(make_checkpoint: Any, tmp_path: Path) -> None:
    """Older llm-compressor releases name the config `compression_config` (vLLM reads both names)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    out = write_variant(
        src, tmp_path, compressed_tensors("tensor"), "tensor", config_key="compression_config"
    )
    assert build_model_config(out / "fp8", dtype="float32").quantization is not None
    assert_matches_hf(out, 1)


@pytest.mark.parametrize("config_key", ["quantization_config", "compression_config"])
def test_an_fp8_phi3_checkpoint_is_refused_under_either_name(
    make_checkpoint: Any, tmp_path: Path, config_key: str
) -> None:
    """Its fused qkv_proj / gate_up_proj scales are not read: a clear refusal, whichever name the config
    has (not an unexpected-tensor error at load)."""
    src = make_checkpoint("Phi3ForCausalLM", seed=5)
    out = write_variant(src, tmp_path, compressed_tensors("tensor"), "tensor", config_key=config_key)
    with pytest.raises(ConfigError, match="quantized Phi-3 checkpoints"):
        build_model_config(out / "fp8", dtype="float32")


# --------------------------------------------------------------------------- transformers / AutoFP8 "fp8"


def test_transformers_per_tensor_scales_named_weight_scale_inv(make_checkpoint: Any, tmp_path: Path) -> None:
    """transformers' FP8Linear without a weight_block_size saves its per-tensor scale as a 0-d
    `weight_scale_inv`."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}
    out = write_variant(src, tmp_path, qc, "tensor", scale_name="weight_scale_inv",
                        scale_shape=lambda s: s.reshape(()))  # fmt: skip
    assert_ranks_hold_reference(out, 2)


def test_autofp8_static_checkpoint_with_ignored_layers(make_checkpoint: Any, tmp_path: Path) -> None:
    """AutoFP8's layout: per-tensor `weight_scale`, static `input_scale`, the unquantized modules listed
    as `ignored_layers` (transformers and vLLM read that name too)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    mlp = "model.layers.1.mlp"
    qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", mlp]}
    out = write_variant(src, tmp_path, qc, "tensor", ignore=(mlp,),
                        extra=lambda m: {f"{m}.input_scale": torch.tensor([0.02])})  # fmt: skip
    assert_matches_hf(out, 2)


# hidden 72 and MLP 80: neither is a multiple of a 32-wide block (scale grids by ceil division); every
# projection has a bias.
ODD_WIDTHS = {"hidden_size": 72, "head_dim": 16, "intermediate_size": 80, "attention_bias": True,
              "mlp_bias": True}  # fmt: skip


@pytest.mark.parametrize("block", [(32, 32), (16, 32)], ids=["32x32", "16x32"])
def test_block_scales_of_widths_that_are_not_block_multiples(
    block: tuple[int, int], make_checkpoint: Any, tmp_path: Path
) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=5, **ODD_WIDTHS)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]}  # fmt: skip
    out = write_variant(src, tmp_path, qc, "block", block=block, scale_name="weight_scale_inv",
                        ignore=("model.layers.0.mlp",))  # fmt: skip
    assert_matches_hf(out, 1)


def test_static_block_checkpoint_with_activation_scales_at_tp2(make_checkpoint: Any, tmp_path: Path) -> None:
    """transformers' FP8 with `activation_scheme: "static"` saves an `activation_scale` per layer (read
    and dropped as input_scale is); hidden 72 is not a multiple of the 16x16 blocks, bf16 block scales,
    biases, an ignored MLP, GQA at TP 2."""
    src = make_checkpoint("LlamaForCausalLM", seed=5, **{**ODD_WIDTHS, "intermediate_size": 96})
    qc = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16],
          "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"]}  # fmt: skip
    out = write_variant(src, tmp_path, qc, "block", scale_name="weight_scale_inv", scale_dtype=torch.bfloat16,
                        ignore=("model.layers.1.mlp",),
                        extra=lambda m: {f"{m}.activation_scale": torch.tensor(0.02)})  # fmt: skip
    assert_matches_hf(out, 2)


def test_ignored_module_prefixes_stop_at_a_module_boundary(make_checkpoint: Any, tmp_path: Path) -> None:
    """`modules_to_not_convert: ["model.layers.1"]` leaves layer 1 unquantized and not layers 10 and 11,
    as transformers reads the list; the checkpoint quantizes those."""
    src = make_checkpoint("LlamaForCausalLM", seed=5, num_hidden_layers=12)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
          "modules_to_not_convert": ["lm_head", "model.layers.1"]}  # fmt: skip
    out = write_variant(src, tmp_path, qc, "block", scale_name="weight_scale_inv", ignore=("model.layers.1",))
    assert_matches_hf(out, 1)


@pytest.mark.parametrize(
    "pattern",
    ["lm_head", "model.layers.1", "model.layers.1.mlp", "mlp.gate", "model.layers.3.mlp.gate", "gate",
     r"model\.layers\.\d+\.mlp", "model.layers.*.self_attn", "proj", "layers.1(", "model.layers.1."],
)  # fmt: skip
def test_ignore_list_matching_follows_transformers(pattern: str) -> None:
    """QuantConfig.is_ignored against transformers' own rule for `modules_to_not_convert`, over module
    names where prefixes, suffixes and module boundaries differ."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from tp_runtime.config import QuantConfig

    quant = QuantConfig("fp8", "block", (16, 16), ignore=(pattern,), ignore_like_transformers=True)
    names = ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.10.mlp.down_proj",
             "model.layers.11.self_attn.q_proj", "model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj",
             "model.layers.1.self_attn.o_proj", "model.layers.21.mlp.up_proj"]  # fmt: skip
    for name in names:
        try:
            want = not should_convert_module(name, [pattern])
        except Exception:  # transformers raises on a pattern that is no regex; the engine takes it literally
            want = name.endswith(pattern) or name.startswith(pattern.rstrip(".") + ".") or name == pattern
        assert quant.is_ignored(name) == want, (pattern, name)


# ------------------------------------------------------------------ FP8 tensors outside the linear layers


def _edit(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _quantize_as_stored(
    out: Path, name: str, scheme: str, scale_name: str = "weight_scale"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store `name` of out/fp8 in FP8 with its scale, and its dequantized values in out/ref."""
    weight = load_file(str(out / "ref" / "model.safetensors"))[name]
    q, scale = _quantize(weight, scheme, (16, 16), 1.0)
    module = name.removesuffix(".weight")
    _edit(out / "fp8", lambda t: t.update({name: q, f"{module}.{scale_name}": scale}))
    _edit(out / "ref", lambda t: t.update({name: _dequantize(q, scale, scheme, (16, 16))}))
    return q, scale


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_lm_head_and_embedding_are_dequantized(tp: int, make_checkpoint: Any, tmp_path: Path) -> None:
    """An LM head stored in FP8 with per-channel scales (compressed-tensors whose ignore list leaves it
    in), and an embedding table stored in FP8 with one scale (transformers' FP8Embedding): the engine
    keeps both unquantized, so it multiplies them by their scales at load, as transformers does. (They
    were read as raw e4m3 values, the scales dropped.) Each rank holds its slice of the vocabulary."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    qc = {**compressed_tensors("channel"), "ignore": []}
    out = write_variant(src, tmp_path / "head", qc, "channel")
    _quantize_as_stored(out, "lm_head.weight", "channel")
    assert_matches_hf(out, tp)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"],
          "modules_to_convert": ["embed_tokens"]}  # fmt: skip
    out = write_variant(src, tmp_path / "embed", qc, "tensor", scale_name="weight_scale_inv")
    _quantize_as_stored(out, "model.embed_tokens.weight", "tensor")
    assert_matches_hf(out, tp)
    # Block-scaled: FP8Embedding's one scale is `weight_scale` there too (the layers' are
    # `weight_scale_inv`), and an LM head in 16x16 blocks (the vocabulary's last block is partial).
    block = {**qc, "weight_block_size": [16, 16], "modules_to_not_convert": []}
    out = write_variant(src, tmp_path / "block", block, "block", scale_name="weight_scale_inv")
    _quantize_as_stored(out, "model.embed_tokens.weight", "tensor")
    _quantize_as_stored(out, "lm_head.weight", "block", scale_name="weight_scale_inv")
    assert_matches_hf(out, tp)


def test_a_tied_lm_head_stored_in_fp8_is_refused_as_such(make_checkpoint: Any, tmp_path: Path) -> None:
    """A tied model whose file also holds lm_head.weight in FP8 with its scale: the error says the tied
    tensor is FP8 (it said the scale belonged to a weight that is not FP8)."""
    src = make_checkpoint("Qwen3ForCausalLM", seed=5, head_dim=16, tie_word_embeddings=True)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    out = write_variant(src, tmp_path, qc, "block", scale_name="weight_scale_inv")
    q, scale = _quantize_as_stored(out, "model.embed_tokens.weight", "tensor")
    head = {"lm_head.weight": q.clone(), "lm_head.weight_scale": scale.clone()}
    _edit(out / "fp8", lambda t: t.update(head))
    with pytest.raises(ConfigError, match=r"'lm_head\.weight' of a tied model is stored in FP8"):
        LLM(str(out / "fp8"), dtype="float32", device="cpu")


def test_per_channel_scales_stored_as_one_row_at_tp2(make_checkpoint: Any, tmp_path: Path) -> None:
    """Per-channel scales stored [1, N]: each rank reads its rows' values (a column-parallel layer raised
    an IndexError from inside torch)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    out = write_variant(src, tmp_path, compressed_tensors("channel"), "channel",
                        scale_shape=lambda s: s.reshape(1, -1))  # fmt: skip
    assert_ranks_hold_reference(out, 2)


def test_layers_stored_in_16_or_32_bits_run_unquantized(make_checkpoint: Any, tmp_path: Path) -> None:
    """An FP8 checkpoint that stores some layers (here the MLPs, 80 wide: no whole 32x32 block) in 16 or 32
    bits with no scale, without naming them in modules_to_not_convert: they run unquantized (they were
    refused). With a scale beside such a weight the checkpoint is refused (see the next test)."""
    src = make_checkpoint("LlamaForCausalLM", seed=5, **ODD_WIDTHS)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
          "modules_to_not_convert": None}  # fmt: skip
    mlps = tuple(f"model.layers.{i}.mlp" for i in range(2))
    out = write_variant(
        src, tmp_path, qc, "block", block=(32, 32), scale_name="weight_scale_inv", ignore=mlps
    )
    assert_matches_hf(out, 1)


def test_broken_fp8_tensors_outside_linear_layers_are_config_errors(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    """An FP8 embedding without its scale, NaN or infinite scales, a scale beside a 32-bit weight, and
    FP8 weights without any quantization_config (with quantization="fp8" too): ConfigErrors that say
    what is wrong, never raw e4m3 values, NaN outputs or a traceback from torch."""
    src = make_checkpoint("LlamaForCausalLM", seed=5)
    out = write_variant(src, tmp_path / "a", compressed_tensors("channel"), "channel")
    fp8 = out / "fp8"
    cfg = build_model_config(fp8, dtype="float32")

    def load(quant: Any = cfg.quantization) -> None:
        model = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(fp8), torch.float32, quant)

    good = load_file(str(fp8 / "model.safetensors"))
    embed = good["model.embed_tokens.weight"]
    _edit(fp8, lambda t: t.update({"model.embed_tokens.weight": embed.to(torch.float8_e4m3fn)}))
    no_scale = r"embed_tokens.weight' is stored in FP8, but the checkpoint holds no scale for it \(model\.emb"
    with pytest.raises(ConfigError, match=no_scale):
        load()
    for bad in (float("nan"), float("inf"), -0.01):
        scale = good["model.layers.1.mlp.down_proj.weight_scale"].clone()
        scale[3] = bad
        _edit(fp8, lambda t, s=scale: t.update({**good, "model.layers.1.mlp.down_proj.weight_scale": s}))
        with pytest.raises(ConfigError, match=r"down_proj\.weight_scale holds NaN, infinite or negative FP8"):
            load()
    # One scale per row, but not laid out as rows ([rows], [rows, 1] or [1, rows]): refused, not read
    # row by row.
    rows = good["model.layers.1.mlp.down_proj.weight_scale"]
    _edit(fp8, lambda t: t.update({**good, "model.layers.1.mlp.down_proj.weight_scale": rows.reshape(2, -1)}))
    with pytest.raises(ConfigError, match=r"down_proj\.weight_scale has shape \[2, 32\]; channel FP8 scales"):
        load()
    _edit(fp8, lambda t: t.update({**good, "model.layers.0.self_attn.o_proj.weight": torch.ones(64, 64)}))
    with pytest.raises(ConfigError, match=r"weight scales of layers whose weights are not FP8 \(model\.layers"
                       r"\.0\.self_attn\.o_proj\.weight\)"):  # fmt: skip
        load()
    # An integer weight where the layer is FP8: the message names the file's dtype (it named float32, the
    # dtype the tensor is read in).
    ints = torch.ones(64, 64, dtype=torch.int8)
    _edit(fp8, lambda t: t.update({**good, "model.layers.0.self_attn.o_proj.weight": ints}))
    with pytest.raises(ConfigError, match=r"o_proj\.weight is torch\.int8, but the checkpoint's quantiza"):
        load()
    # FP8 weights whose config lost its quantization_config.
    _edit(fp8, lambda t: (t.clear(), t.update({k: v for k, v in good.items() if "scale" not in k})))
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"stored in FP8, but the checkpoint's config.json has no quant"):
        LLM(str(fp8), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="stored in FP8, but quantization='fp8' quantizes a 16- or 32-bit"):
        LLM(str(fp8), dtype="float32", device="cpu", quantization="fp8")


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_dequantized_rows_read_in_chunks(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's rows of an FP8 tensor kept unquantized, read a few rows at a time (here 1-3 rows a chunk,
    starting inside a 16x16 block), equal the brute-force dequantization's rows."""
    weight = torch.randn(37, 20, generator=torch.Generator().manual_seed(4))
    q, scale = _quantize(weight, scheme, (16, 16), 1.0)
    save_file({"w": q, "w_scale": scale}, str(tmp_path / "t.safetensors"))
    want = _dequantize(q, scale, scheme, (16, 16))
    for chunk in (20, 45, 1 << 22):
        monkeypatch.setattr(loader.DequantizedTensor, "_CHUNK", chunk)
        with loader.open_weight_file(str(tmp_path / "t.safetensors")) as handle:
            source = loader.DequantizedTensor(handle, "w", scale, (16, 16), torch.float32)
            assert torch.equal(source.narrow(0, 5, 30), want[5:35]) and torch.equal(source.full(), want)
            assert torch.equal(source.narrow(1, 3, 9), want[:, 3:12])


def test_a_block_grid_shaped_like_row_scales_is_read_as_blocks(tmp_path: Path) -> None:
    """A [4, 64] tensor (an FP8 router of 4 experts) in 16x16 blocks has a [1, 4] grid of scales: as many
    as rows, in a shape with a 1, yet one per block. It was read as one per row."""
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    q, scale = _quantize(weight, "block", (16, 16), 1.0)
    assert tuple(scale.shape) == (1, 4)
    save_file({"w": q, "w_scale": scale}, str(tmp_path / "t.safetensors"))
    with loader.open_weight_file(str(tmp_path / "t.safetensors")) as handle:
        source = loader.DequantizedTensor(handle, "w", scale, (16, 16), torch.float32)
        assert torch.equal(source.full(), _dequantize(q, scale, "block", (16, 16)))
