"""FP8 linear layers (layers/quantization/fp8.py) against HF transformers running the dequantized weights.

Each FP8 checkpoint here is written from a tiny random model: every linear weight quantized with a scale
per output channel, per tensor or per block, in compressed-tensors' or transformers' FP8 layout. Its
reference is the same model with the weights those FP8 values and scales stand for (dequantized here, in
float32, written independently of the engine's code) loaded by transformers. On the CPU the engine
multiplies by the dequantized weight in float32, so greedy tokens must be equal.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import GEMMA3, assert_same_tokens, count_checkpoint_reads, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams, loader
from tp_runtime.config import QuantConfig, build_model_config, quant_config
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.models.llama import LlamaForCausalLM
from tp_runtime.models.registry import model_class

# (Mixtral's experts: w1, w3 gate and up, w2 down)
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "w1", "w2", "w3")
E4M3_MAX = 448.0


def _quantize(w: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale) with scale = amax / 448 over a channel, the tensor or a block."""
    w = w.float()
    if scheme == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
        return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    bn, bk = block
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = tile.abs().max() / E4M3_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str, block: tuple[int, int]) -> torch.Tensor:
    if scheme != "block":
        return q.float() * scale
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def write_fp8(
    src: Path,
    out: Path,
    fmt: str,
    scheme: str,
    block: tuple[int, int] = (16, 16),
    ignore: tuple[str, ...] = (),
) -> Path:
    """An FP8 copy of checkpoint `src` at out/fp8 and its dequantized float32 reference at out/ref."""
    fp8_dir, ref_dir = out / "fp8", out / "ref"
    if (fp8_dir / "config.json").is_file():
        return out
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    scale_name = "weight_scale_inv" if fmt == "fp8" and scheme == "block" else "weight_scale"
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES and module not in ignore:
            q, scale = _quantize(t, scheme, block)
            quantized[name], quantized[f"{module}.{scale_name}"] = q, scale
            reference[name] = _dequantize(q, scale, scheme, block)
        else:
            quantized[name] = reference[name] = t
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        qc: dict[str, Any] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "modules_to_not_convert": list(ignore),
        }
        if scheme == "block":
            qc["weight_block_size"] = list(block)
    else:
        weights: dict[str, Any] = {
            "num_bits": 8,
            "type": "float",
            "strategy": scheme,
            "symmetric": True,
            "dynamic": False,
        }
        if scheme == "block":
            weights["block_structure"] = list(block)
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head", *ignore],
        }
    config["quantization_config"] = qc
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return out


def _greedy(
    model: Path, prompts: list[list[int]], tp: int, max_tokens: int = 8, **options: Any
) -> list[list[int]]:
    llm = LLM(str(model), tensor_parallel_size=tp, dtype="float32", device="cpu", **options)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


CASES = {
    "llama-ct-channel-tp2": ("LlamaForCausalLM", "compressed-tensors", "channel", 2),
    "qwen3-ct-tensor": ("Qwen3ForCausalLM", "compressed-tensors", "tensor", 1),
    "llama-fp8-block-tp2": ("LlamaForCausalLM", "fp8", "block", 2),
    "qwen3-ct-block": ("Qwen3ForCausalLM", "compressed-tensors", "block", 1),
    "llama-fp8-tensor": ("LlamaForCausalLM", "fp8", "tensor", 1),
    "gemma3-ct-channel-tp2": ("Gemma3ForCausalLM", "compressed-tensors", "channel", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(
    case: str, make_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    arch, fmt, scheme, tp = CASES[case]
    extra = {"Qwen3ForCausalLM": {"head_dim": 32}, "Gemma3ForCausalLM": GEMMA3}.get(arch, {})
    src = make_checkpoint(arch, seed=3, **extra)
    out = write_fp8(src, tmp_path_factory.mktemp(case), fmt, scheme)
    prompts = random_prompts((5, 17, 33), 300, seed=11)
    want = hf_greedy(out / "ref", prompts, 8)
    assert_same_tokens(_greedy(out / "fp8", prompts, tp), want, prompts)


def test_fp8_ignore_list_keeps_modules_unquantized(make_checkpoint: Any, tmp_path: Path) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    mlp = tuple(f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    out = write_fp8(src, tmp_path, "compressed-tensors", "channel", ignore=mlp)
    cfg = build_model_config(out / "fp8", dtype="float32")
    model = LlamaForCausalLM(cfg, TPGroup(), torch.float32, torch.device("cpu"))
    loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)
    layers = model.model.layers
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32  # type: ignore[union-attr]
    param, _ = next(model.checkpoint_targets("model.layers.1.mlp.down_proj.weight"))
    assert param is layers[1].mlp.down_proj.weight  # type: ignore[union-attr]
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn  # type: ignore[union-attr]
    prompts = random_prompts((9, 21), 300, seed=5)
    assert_same_tokens(_greedy(out / "fp8", prompts, 1), hf_greedy(out / "ref", prompts, 8), prompts)


def test_fp8_ignore_list_names_modules_as_the_checkpoint_does(make_checkpoint: Any, tmp_path: Path) -> None:
    """A Gemma 3 multimodal checkpoint names its language model's modules language_model.model.*, and so
    does its ignore list (the model calls them model.*): those modules stay unquantized."""
    src = make_checkpoint("Gemma3ForConditionalGeneration", seed=3, **GEMMA3)
    assert any(name.startswith("language_model.model.") for name in load_file(str(src / "model.safetensors")))
    mlp = tuple(f"language_model.model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    out = write_fp8(src, tmp_path, "compressed-tensors", "channel", ignore=mlp)
    prompts = random_prompts((5, 17), 300, seed=11)
    assert_same_tokens(_greedy(out / "fp8", prompts, 1), hf_greedy(out / "ref", prompts, 8), prompts)


def _qdq_per_channel(w: torch.Tensor) -> torch.Tensor:
    """What online quantization must give: per-output-row amax / 448 scales, round to e4m3, back."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def online_fp8_reference(src: Path, ref: Path) -> Path:
    """A copy of checkpoint `src` at `ref` whose linear weights are what online FP8 makes of them, for HF."""
    shutil.copytree(src, ref)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
            tensors[name] = _qdq_per_channel(t)
    save_file(tensors, str(ref / "model.safetensors"))
    return ref


@pytest.mark.parametrize("tp", [1, 2])
def test_online_fp8_matches_hf_on_quantized_weights(tp: int, make_checkpoint: Any, tmp_path: Path) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=4)
    ref = online_fp8_reference(src, tmp_path / "ref")
    prompts = random_prompts((6, 19, 40), 300, seed=8)
    got = _greedy(src, prompts, tp, quantization="fp8")
    assert_same_tokens(got, hf_greedy(ref, prompts, 8), prompts)


def test_online_fp8_weights_are_fp8_and_counted_at_their_size(make_checkpoint: Any) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=4)
    plain = build_model_config(src, dtype="float32")
    cfg = build_model_config(src, dtype="float32", quantization="fp8")
    assert cfg.quantization == QuantConfig(checkpoint_format="online", weight_scales="channel")
    models = []
    for c in (plain, cfg):
        m = LlamaForCausalLM(c, TPGroup(), torch.float32, torch.device("cpu"))
        loader.load_weights(m, str(src), torch.float32, c.quantization)
        models.append(m)
    qkv = models[1].model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    # Each linear weight: 1 byte per element plus a float32 scale per row, instead of 4 bytes.
    linear = sum(p.numel() for n, p in models[0].named_parameters() if n.endswith("proj.weight"))
    rows = sum(p.shape[0] for n, p in models[0].named_parameters() if n.endswith("proj.weight"))
    assert models[0].decode_weight_bytes() - models[1].decode_weight_bytes() == 3 * linear - 4 * rows


def test_block_checkpoint_loads_each_ranks_slice_only(
    make_checkpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    out = write_fp8(src, tmp_path, "fp8", "block")
    cfg = build_model_config(out / "fp8", dtype="float32")
    stored = load_file(str(out / "fp8" / "model.safetensors"))
    ref = load_file(str(out / "ref" / "model.safetensors"))
    read = count_checkpoint_reads(monkeypatch)
    full = sum(t.numel() for t in stored.values())
    for rank in range(2):
        read.clear()
        model = LlamaForCausalLM(cfg, TPGroup(rank, 2), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)
        assert sum(read) < full / 2 * 1.35, (rank, sum(read), full)
        # The rank's dequantized down projection is its columns of the reference's.
        down = model.model.layers[0].mlp.down_proj  # type: ignore[union-attr]
        from tp_runtime.layers.quantization.fp8 import dequantize

        got = dequantize(down.weight, down.weight_scale, down.scale_block_k, torch.float32)
        want = ref["model.layers.0.mlp.down_proj.weight"].chunk(2, dim=1)[rank]
        assert torch.equal(got, want)


def test_blocks_that_do_not_divide_across_ranks_are_a_config_error(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    # 32-row blocks: each rank's 16 rows of k (2 KV heads of 16 over 2 ranks) would start inside one.
    out = write_fp8(src, tmp_path, "fp8", "block", block=(32, 32))
    with pytest.raises(ConfigError, match="block"):
        LLM(str(out / "fp8"), tensor_parallel_size=2, dtype="float32", device="cpu")
    # The loader refuses it too, on the rank whose part starts inside a block (the engine checks the
    # config first, above).
    cfg = build_model_config(out / "fp8", dtype="float32")
    model = LlamaForCausalLM(cfg, TPGroup(1, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="starts inside a 32x32 FP8 scale block"):
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)


def test_blocks_cut_only_in_unquantized_layers_load_at_tp2(make_checkpoint: Any, tmp_path: Path) -> None:
    """TP=2 cuts the 32x32 blocks only of k and v, which the checkpoint keeps unquantized with q
    (modules_to_not_convert); and dummy weights of a block-scaled config are quantized at load, with no
    blocks to cut. Both were refused before any weight was read; both give the same tokens as HF
    transformers (and as TP=1)."""
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    qkv = tuple(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    out = write_fp8(src, tmp_path, "fp8", "block", block=(32, 32), ignore=qkv)
    prompts = random_prompts((5, 17), 300, seed=11)
    assert_same_tokens(_greedy(out / "fp8", prompts, 2), hf_greedy(out / "ref", prompts, 8), prompts)
    cut = write_fp8(src, tmp_path / "cut", "fp8", "block", block=(32, 32))
    want = _greedy(cut / "fp8", prompts, 1, load_format="dummy")
    assert_same_tokens(_greedy(cut / "fp8", prompts, 2, load_format="dummy"), want, prompts)


def test_one_kv_head_in_blocks_wider_than_it_loads_at_tp2(make_checkpoint: Any, tmp_path: Path) -> None:
    """One KV head of 16 rows in 32x32 blocks: each of 2 ranks holds the whole k and v tensors, which cuts
    no block (it was refused as a cut)."""
    src = make_checkpoint("LlamaForCausalLM", seed=3, num_key_value_heads=1)
    out = write_fp8(src, tmp_path, "fp8", "block", block=(32, 32))
    prompts = random_prompts((5, 17), 300, seed=11)
    assert_same_tokens(_greedy(out / "fp8", prompts, 2), hf_greedy(out / "ref", prompts, 8), prompts)


@pytest.mark.parametrize(
    ("arch", "fmt", "scheme", "tp"),
    [("LlamaForCausalLM", "fp8", "block", 2), ("LlamaForCausalLM", "compressed-tensors", "channel", 1),
     ("LlamaForCausalLM", "compressed-tensors", "tensor", 2), ("Qwen3MoeForCausalLM", "fp8", "block", 2)],
)  # fmt: skip
def test_dummy_weights_of_an_fp8_checkpoint_config(
    arch: str, fmt: str, scheme: str, tp: int, make_checkpoint: Any, tmp_path: Path
) -> None:
    """load_format="dummy" with an FP8 checkpoint's config (benchmarking its shape without its weights):
    the dummy weights quantized as quantization="fp8" quantizes them for the unquantized config (it was
    a ConfigError about 32-bit tensors), the same tokens at any TP size."""
    src = make_checkpoint(arch, seed=3, **(QWEN3_MOE if arch == "Qwen3MoeForCausalLM" else {}))
    out = write_fp8(src, tmp_path, fmt, scheme)
    prompts = random_prompts((5, 17), 300, seed=11)
    want = _greedy(out / "ref", prompts, 1, load_format="dummy", quantization="fp8")
    assert_same_tokens(_greedy(out / "fp8", prompts, tp, load_format="dummy"), want, prompts)


def test_fp8_checkpoint_errors(make_checkpoint: Any, tmp_path: Path) -> None:
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    out = write_fp8(src, tmp_path / "a", "compressed-tensors", "channel")
    cfg = build_model_config(out / "fp8", dtype="float32")

    def load(folder: Path) -> None:
        model = LlamaForCausalLM(cfg, TPGroup(), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(folder), torch.float32, cfg.quantization)

    tensors = load_file(str(out / "fp8" / "model.safetensors"))
    broken = tmp_path / "missing-scale"
    shutil.copytree(out / "fp8", broken)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.k_proj.weight_scale"},
              str(broken / "model.safetensors"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"without their scales.*k_proj"):
        load(broken)
    # Scales of the wrong shape (one too many rows) are refused, not cut to fit.
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.k_proj.weight_scale"] = torch.ones(33, 1)
    save_file(wrong, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"k_proj\.weight_scale has shape \[33, 1\]"):
        load(broken)
    # A 32-bit weight where the config says FP8, its scale beside it: not silently used.
    unquantized = dict(tensors)
    unquantized["model.layers.0.self_attn.o_proj.weight"] = torch.ones(64, 64)
    save_file(unquantized, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"scales of layers whose weights are not FP8 \(.*o_proj\.weight\)"):
        load(broken)
    # Part of a fused projection ignored.
    partial = tmp_path / "partial"
    write_fp8(src, partial, "compressed-tensors", "channel", ignore=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ConfigError, match="some of the projections"):
        LLM(str(partial / "fp8"), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="'awq', which is not supported"):
        quant_config({"quant_method": "awq", "bits": 4}, None)
    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        quant_config(None, "int8")
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group"}}
    with pytest.raises(ConfigError, match="strategy 'group'"):
        quant_config(
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": group},
            },
            None,
        )
    # A weight group naming the attention's projections is a weight group, not attention quantization
    # (which was dropped, leaving "unexpected tensor" errors for the scales at load).
    weights = {"num_bits": 8, "type": "float", "strategy": "channel"}
    by_name = {"targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"], "weights": weights}
    # Fields of the wrong kind: a clear error, not a TypeError or AttributeError from the walk.
    malformed = [
        "fp8", [{"quant_method": "fp8"}],
        {"quant_method": "compressed-tensors", "config_groups": [group]},
        {"quant_method": "compressed-tensors", "config_groups": {"g": "Linear"}},
        {"quant_method": "compressed-tensors",
         "config_groups": {"g": {"targets": ["Linear"], "weights": "fp8"}}},
    ]  # fmt: skip
    for config in malformed:
        with pytest.raises(ConfigError, match="quantization_config is malformed"):
            quant_config(config, None)
    for config in ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"},
                   {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"g": {**group, "weights": {**group["weights"], "strategy": "channel"}}},
                    "ignore": "lm_head"}):  # fmt: skip
        with pytest.raises(ConfigError, match="must be a list of module names, got 'lm_head'"):
            quant_config(config, None)
    with pytest.raises(ConfigError, match=r"1 quantization groups \(targets .*self_attn.*include \"Linear\""):
        quant_config({"quant_method": "compressed-tensors", "format": "float-quantized",
                      "config_groups": {"g": by_name}}, None)  # fmt: skip
    # What this engine would run wrong, refused: rotated (QuIP / SpinQuant) or compressed sparse weights,
    # quantized outputs.
    plain = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    refused = [
        ({**plain, "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config"),
        ({**plain, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse weights"),
        ({**plain, "config_groups": {"g": {"targets": ["Linear"], "weights": weights,
                                           "output_activations": weights}}}, "output activation"),
        # zero points: refused up front, not as an "unexpected tensor" input_zero_point at load
        ({**plain, "config_groups": {"g": {"targets": ["Linear"], "weights": weights, "input_activations":
                                           {"num_bits": 8, "type": "float", "symmetric": False}}}},
         "asymmetric input activations"),
        # a broken regex: named here, not a re.error from deep in the load (or a worker's traceback)
        ({**plain, "ignore": ["lm_head", "re:model.layers.[0"]},
         r"ignore entry 're:model\.layers\.\[0' is not a valid regex"),
    ]  # fmt: skip
    for config, message in refused:
        with pytest.raises(ConfigError, match=message):
            quant_config(config, None)
    assert quant_config({**plain, "sparsity_config": {"format": "dense"}}, None) == quant_config(plain, None)
    # Beside a "Linear" group of the same scheme it changes nothing; of another scheme it is refused.
    linear = {"targets": ["Linear"], "weights": weights}
    both = {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"a": linear, "b": by_name}}  # fmt: skip
    assert quant_config(both, None) == quant_config({**both, "config_groups": {"a": linear}}, None)
    other = {**by_name, "weights": {**weights, "strategy": "tensor"}}
    with pytest.raises(ConfigError, match=r"2 quantization groups"):
        quant_config({**both, "config_groups": {"a": linear, "b": other}}, None)


def test_quantization_option_on_the_command_line() -> None:
    from tp_runtime.engine.args import EngineArgs

    parser = __import__("argparse").ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


def test_transformers_reads_the_written_configs(make_checkpoint: Any, tmp_path: Path) -> None:
    """The written configs are ones transformers accepts (its AutoConfig is what the engine reads)."""
    src = make_checkpoint("LlamaForCausalLM", seed=3)
    for fmt in ("fp8", "compressed-tensors"):
        out = write_fp8(src, tmp_path / fmt, fmt, "block")
        hf = transformers.AutoConfig.from_pretrained(out / "fp8")
        assert quant_config(getattr(hf, "quantization_config", None), None) is not None


QWEN3_MOE = {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True, "mlp_only_layers": [0]}  # fmt: skip


MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    ("arch", "extra", "scheme", "tp"),
    [("Qwen3MoeForCausalLM", QWEN3_MOE, "block", 2), ("Qwen3MoeForCausalLM", QWEN3_MOE, "channel", 1),
     ("MixtralForCausalLM", MIXTRAL, "tensor", 1),
     # 24 or 12 expert rows a rank: ranks' rows and columns start inside a 16x16 block, and at TP=4 a
     # rank's part spans the ends of two blocks
     ("Qwen3MoeForCausalLM", {**QWEN3_MOE, "moe_intermediate_size": 48}, "block", 2),
     ("Qwen3MoeForCausalLM", {**QWEN3_MOE, "moe_intermediate_size": 48}, "block", 4)],
    ids=["qwen3-moe-block-tp2", "qwen3-moe-channel", "mixtral-tensor", "qwen3-moe-block-cut-tp2",
         "qwen3-moe-block-cut-tp4"],
)  # fmt: skip
def test_fp8_moe_checkpoints_match_hf_on_dequantized_weights(
    arch: str, extra: dict[str, Any], scheme: str, tp: int, make_checkpoint: Any, tmp_path: Path
) -> None:
    """Every linear weight FP8, experts included, and every one stays FP8 in the engine: each rank holds
    its slice of each expert, which dequantizes to the reference's slice (also where a rank's part of an
    expert starts inside a scale block: the experts loaded so when they were dequantized at load)."""
    src = make_checkpoint(arch, seed=3, **extra)
    names = load_file(str(src / "model.safetensors"))
    assert any(".experts." in n for n in names), sorted(names)[:20]
    out = write_fp8(src, tmp_path, "fp8" if scheme == "block" else "compressed-tensors", scheme)
    quantized = load_file(str(out / "fp8" / "model.safetensors"))
    assert any(".experts." in n and t.dtype == torch.float8_e4m3fn for n, t in quantized.items())
    ref = load_file(str(out / "ref" / "model.safetensors"))
    cfg = build_model_config(out / "fp8", dtype="float32")
    layer = cfg.moe_layers[-1]
    (gate, up, down), ffn = (("w1", "w3", "w2"), "block_sparse_moe") if "Mixtral" in arch else (
        ("gate_proj", "up_proj", "down_proj"), "mlp")  # fmt: skip
    for rank in range(tp):
        model = model_class(arch)(cfg, TPGroup(rank, tp), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)
        moe = model.model.layers[layer].mlp  # type: ignore[union-attr]
        assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
        for e in range(cfg.num_experts):
            p = f"model.layers.{layer}.{ffn}.experts.{e}."
            rows = [ref[f"{p}{name}.weight"].chunk(tp)[rank] for name in (gate, up)]
            assert torch.equal(moe.w13_stack.dequantized(torch.float32, e), torch.cat(rows))
            want = ref[f"{p}{down}.weight"].chunk(tp, dim=1)[rank]
            assert torch.equal(moe.w2_stack.dequantized(torch.float32, e), want)
    prompts = random_prompts((7, 23), 300, seed=9)
    assert_same_tokens(_greedy(out / "fp8", prompts, tp), hf_greedy(out / "ref", prompts, 8), prompts)


def test_fp8_expert_ignore_lists(make_checkpoint: Any, tmp_path: Path) -> None:
    """A layer's experts are quantized or not per stack (gate/up, down): an ignore list may keep every
    expert of a layer, or only their down projections, in the model dtype; ignoring some experts of a
    layer and not the others is a ConfigError that says so."""
    src = make_checkpoint("Qwen3MoeForCausalLM", seed=3, **QWEN3_MOE)
    experts = [f"model.layers.1.mlp.experts.{e}." for e in range(QWEN3_MOE["num_experts"])]
    prompts = random_prompts((7, 23), 300, seed=9)
    cases = {"all": ("gate_proj", "up_proj", "down_proj"), "down": ("down_proj",)}
    for case, projections in cases.items():
        ignore = tuple(f"{e}{p}" for e in experts for p in projections)
        out = write_fp8(src, tmp_path / case, "compressed-tensors", "channel", ignore=ignore)
        cfg = build_model_config(out / "fp8", dtype="float32")
        model = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(out / "fp8"), torch.float32, cfg.quantization)
        moe = model.model.layers[1].mlp  # type: ignore[union-attr]
        assert moe.w2.dtype == torch.float32 and moe.w2_scale is None
        # The checkpoint map holds the live stack (the FP8 one it replaced is not kept alive).
        param, _ = next(model.checkpoint_targets(f"{experts[0]}down_proj.weight"))
        assert param is moe.w2
        assert moe.w13.dtype == (torch.float32 if case == "all" else torch.float8_e4m3fn)
        assert_same_tokens(_greedy(out / "fp8", prompts, 1), hf_greedy(out / "ref", prompts, 8), prompts)
    one = (f"{experts[0]}down_proj",)
    out = write_fp8(src, tmp_path / "one", "compressed-tensors", "channel", ignore=one)
    with pytest.raises(ConfigError, match="experts"):
        LLM(str(out / "fp8"), dtype="float32", device="cpu")


def test_fp8_experts_kernel_choice() -> None:
    """Where FP8 experts run: the Triton grouped GEMM on GPUs with the Triton FP8 GEMM (per-row scales or
    scale blocks an FP8 MMA's K divides), dequantized elsewhere, their dequantized weights on the CPU."""
    from tp_runtime.layers.moe import pick_moe_impl
    from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels, Fp8Kernels, Fp8LinearMethod

    config = QuantConfig("compressed-tensors", "channel")
    hopper = Fp8LinearMethod(config, CudaFp8Kernels(132, triton_gemm=True))
    ada = Fp8LinearMethod(config, CudaFp8Kernels(128, triton_gemm=False))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick_moe_impl(cuda, torch.bfloat16, 2048, 768, hopper, 0) == "fp8_grouped"
    assert pick_moe_impl(cuda, torch.float16, 2048, 768, hopper, 128) == "fp8_grouped"
    assert pick_moe_impl(cuda, torch.bfloat16, 2048, 768, hopper, 16) == "dense"  # blocks under an MMA's K
    assert pick_moe_impl(cuda, torch.bfloat16, 2048, 768, ada, 0) == "dense"
    assert pick_moe_impl(cpu, torch.bfloat16, 2048, 768, Fp8LinearMethod(config, Fp8Kernels()), 0) == "loop"
    # Asked for by name, a path that cannot run the experts is refused when the layer is made.
    from tp_runtime.layers.moe import SparseMoE

    blocks16 = Fp8LinearMethod(QuantConfig("fp8", "block", (16, 16)), Fp8Kernels())
    for impl, method in (("fp8_grouped", blocks16), ("fp8_grouped", None), ("grouped", blocks16)):
        with pytest.raises(ValueError, match=f"MoE impl '{impl}' cannot run these experts"):
            SparseMoE(64, 64, 4, 2, True, True, ("w1", "w3", "w2"), TPGroup(), torch.float32, cpu, False,
                      impl=impl, **({"method": method} if method else {}))  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_online_fp8_of_a_moe_model_quantizes_every_linear_layer(
    tp: int, make_checkpoint: Any, tmp_path: Path
) -> None:
    """Attention, the dense layer's MLP and every expert are quantized per channel (the router stays in
    the model dtype); greedy tokens at TP 1 and 2."""
    src = make_checkpoint("Qwen3MoeForCausalLM", seed=3, **QWEN3_MOE)
    ref = online_fp8_reference(src, tmp_path / "ref")
    tensors = load_file(str(ref / "model.safetensors"))
    cfg = build_model_config(src, dtype="float32", quantization="fp8")
    model = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"))
    loader.load_weights(model, str(src), torch.float32, cfg.quantization)
    moe = model.model.layers[1].mlp  # type: ignore[union-attr]
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.router.dtype == torch.float32
    down = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(moe.w2_stack.dequantized(torch.float32, 3), tensors[down])
    prompts = random_prompts((7, 23), 300, seed=9)
    assert_same_tokens(_greedy(src, prompts, tp, quantization="fp8"), hf_greedy(ref, prompts, 8), prompts)
