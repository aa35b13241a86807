"""GGUF files written here the way llama.cpp writes them: what transformers' GGUF reader leaves out (rope
scaling, tensors a file lacks) is carried or refused, never run as another model."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import ConfigError

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")),
    reason="needs gguf and accelerate (scripts/setup.sh installs them)",
)

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 300
HEAD_DIM = HIDDEN // HEADS
THETA = 500000.0  # Llama 3's; the plain rope is fitted from it
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _hf_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    weights = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN, std=1.0),
        "model.norm.weight": 1 + rand(HIDDEN, std=0.05),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN, std=0.5),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN, std=0.5),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + rand(HIDDEN, std=0.05),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN, std=0.05),
        }
    return weights


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
    if name in fixed or name == "lm_head.weight":
        return fixed.get(name, "output") + ".weight"
    parts = name.split(".")
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows (interleaved rotary halves), which transformers' reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path, extra: Callable[[Any], None] = lambda writer: None, skip_layer: int | None = None
) -> None:
    import gguf

    from tp_runtime.presets import build_preset_tokenizer

    vocab = json.loads(build_preset_tokenizer(VOCAB).backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(vocab["vocab"].items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(32768)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    extra(writer)
    for name, tensor in _hf_weights().items():
        if skip_layer is not None and name.startswith(f"model.layers.{skip_layer}."):
            continue
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, KV_HEADS)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_divisors(factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Per-frequency divisors as llama.cpp's converter writes them for Llama 3's rope: the plain rope's
    frequencies over transformers' own llama3 ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="llama3", rope_theta=THETA, factor=factor, low_freq_factor=low,
                high_freq_factor=high, original_max_position_embeddings=original)  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_parameters=rope,
                                      max_position_embeddings=32768)  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    return (plain / scaled.double()).numpy().astype(np.float32)


PROMPTS = [[1, *range(5, 45)], [1, *range(200, 260, 2)]]


def _hf_tokens(rope: dict[str, Any]) -> list[list[int]]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": THETA, **rope}, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(_hf_weights())
    model.generation_config.eos_token_id = None  # full-length continuations, as ignore_eos
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        out.append(gen[0, len(prompt) :].tolist())
    return out


def _engine_tokens(path: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(path), device="cpu", dtype="float32") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("with_context", [False, True], ids=["default-context", "file-context"])
def test_llama3_rope_from_rope_freqs(tmp_path: Path, with_context: bool) -> None:
    """llama.cpp writes Llama 3.1/3.2's rope as a rope_freqs.weight tensor, which transformers' reader
    drops (the model then ran the plain rope). The converted config carries rope parameters that give the
    same divisors, so the engine equals HF on the original llama3 config."""

    # Two frequencies between the bands (wavelengths 862 and 4444 of 6 to 609,500), as in Llama 3.1's.
    low, high, original = (2.0, 20.0, 16384) if with_context else (1.0, 16.0, 8192)
    rope = dict(rope_type="llama3", factor=16.0, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=original)  # fmt: skip

    def extra(writer: Any) -> None:
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(16.0, low, high, original))
        if with_context:
            writer.add_rope_scaling_orig_ctx_len(original)

    path = tmp_path / "llama3-rope.gguf"
    _write_gguf(path, extra)
    want = _hf_tokens(rope)
    assert want != _hf_tokens({"rope_type": "default"})  # the rope changes these tokens
    assert _engine_tokens(path) == want
    if with_context:  # the file's own context length, so the file's own factors
        (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("gguf-")]
        written = json.loads((folder / "config.json").read_text())["rope_parameters"]
        assert written["rope_type"] == "llama3" and written["original_max_position_embeddings"] == original
        assert math.isclose(written["low_freq_factor"], low, rel_tol=1e-4)
        assert math.isclose(written["high_freq_factor"], high, rel_tol=1e-4)
        assert written["rope_theta"] == THETA


def test_linear_rope_scaling_keys(tmp_path: Path) -> None:
    import gguf

    def extra(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    path = tmp_path / "linear-rope.gguf"
    _write_gguf(path, extra)
    want = _hf_tokens({"rope_type": "linear", "factor": 4.0})
    assert want != _hf_tokens({"rope_type": "default"})
    assert _engine_tokens(path) == want


def _refused(path: Path, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(path), device="cpu", dtype="float32")


def test_rope_scalings_not_read_are_refused(tmp_path: Path) -> None:
    import gguf

    descending = np.linspace(4.0, 1.0, HEAD_DIM // 2, dtype=np.float32)
    cases: dict[str, tuple[Callable[[Any], None], str]] = {
        "yarn": (
            lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)),
            "rope scaling 'yarn'",
        ),
        "longrope": (
            lambda w: w.add_tensor("rope_factors_long.weight", np.ones(HEAD_DIM // 2, dtype=np.float32)),
            "rope_factors_long.weight",
        ),
        "not-llama3": (
            lambda w: w.add_tensor("rope_freqs.weight", descending),
            "not Llama 3's rope scaling",
        ),
    }
    for name, (extra, says) in cases.items():
        path = tmp_path / f"{name}.gguf"
        _write_gguf(path, extra)
        _refused(path, says)


def test_a_gguf_without_some_tensors_is_refused(tmp_path: Path) -> None:
    """The first part of a split GGUF, or a cut export: transformers only warned and left the layer's
    weights at their random initial values, which the engine then ran."""
    path = tmp_path / "model-00001-of-00002.gguf"
    _write_gguf(path, skip_layer=1)
    _refused(path, r"lacks 9 of the model's tensors .*model\.layers\.1\..*llama-gguf-split --merge")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("gguf-")]


def test_one_part_of_a_split_gguf_is_refused(tmp_path: Path) -> None:
    """A split's first part can hold every tensor but the LM head (written last): transformers then ties
    the head to the embeddings, and the part ran as another model. Any part of a split is refused."""
    for number in (0, 1):
        path = tmp_path / f"model-0000{number + 1}-of-00002.gguf"
        _write_gguf(path, lambda w, n=number: (w.add_uint16("split.no", n), w.add_uint16("split.count", 2)))
        _refused(path, rf"is part {number + 1} of a GGUF split into 2 files; merge them first")


def test_tensors_transformers_does_not_read_are_refused(tmp_path: Path) -> None:
    """A llama file with attention biases (llama.cpp runs them): transformers' reader skips tensors its
    name map lacks, so the model ran without them."""

    def biases(writer: Any) -> None:
        for i in range(LAYERS):
            for proj, rows in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
                writer.add_tensor(f"blk.{i}.{proj}.bias", np.full(rows * HEAD_DIM, 0.1, dtype=np.float32))

    path = tmp_path / "biased.gguf"
    _write_gguf(path, biases)
    _refused(path, r"holds 256 weights more than transformers reads .*blk\.N\.attn_k\.bias")


@pytest.mark.parametrize("factor", [None, 0.0])
def test_linear_scaling_without_a_factor_is_no_scaling(tmp_path: Path, factor: float | None) -> None:
    """As llama.cpp reads it (a missing factor raised TypeError; 0 blamed config.json's rope)."""
    import gguf

    def extra(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        if factor is not None:
            writer.add_rope_scaling_factor(factor)

    path = tmp_path / "Linear-Rope.GGUF"  # (the extension in capitals, as some downloads name it)
    _write_gguf(path, extra)
    assert _engine_tokens(path) == _hf_tokens({"rope_type": "default"})


def test_gemma3_linear_scaling_goes_to_the_global_layers(tmp_path: Path) -> None:
    """Gemma 3's rope is per layer type in transformers 5: llama.cpp's linear scaling (Gemma 3 4B-27B, factor
    8) is the global layers' and the windowed layers keep theirs; it had been put beside the per-type
    settings, where nothing read it (the global layers ran unscaled)."""
    import gguf

    from tp_runtime.config import _rope_config
    from tp_runtime.gguf_checkpoint import _carry_rope_scaling

    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300)  # fmt: skip
    config = transformers.Gemma3TextConfig(**shape)
    _carry_rope_scaling(path, config)
    want = transformers.Gemma3TextConfig(**shape, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})  # fmt: skip
    for layer in ("full_attention", "sliding_attention"):
        got, expected = _rope_config(config, 16, layer), _rope_config(want, 16, layer)
        assert got.rope_type == expected.rope_type
        torch.testing.assert_close(torch.as_tensor(got.inv_freq), torch.as_tensor(expected.inv_freq))
    assert _rope_config(config, 16, "full_attention").rope_type == "linear"


def test_files_converted_by_an_earlier_conversion_are_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tp_runtime import gguf_checkpoint

    path = tmp_path / "plain.gguf"
    _write_gguf(path)
    first = gguf_checkpoint.gguf_checkpoint_dir(path)
    assert gguf_checkpoint.gguf_checkpoint_dir(path) == first
    monkeypatch.setattr(gguf_checkpoint, "_CONVERSION", gguf_checkpoint._CONVERSION + 1)
    assert gguf_checkpoint.gguf_checkpoint_dir(path) != first
