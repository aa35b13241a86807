"""Checkpoint layouts and config files as real releases ship them, against HF transformers (fp32, CPU).

Covered: a tied model whose checkpoint holds lm_head.weight (equal to the embeddings: loads; different:
transformers unties them, so a ConfigError that says to untie, after which the tokens are HF's) or only
lm_head.weight (transformers fills the embeddings from it, so does the loader), and a tied checkpoint
under an untied config (a ConfigError naming the setting); generation_config.json's eos ids, an
explicit empty list of them (no EOS, as in transformers' generate), and a malformed one as a
ConfigError; config.json values no model can have (more experts per token than experts,
decoder_sparse_step 0, KV heads that do not divide the heads, no layers, a rope factor of the wrong type)
as ConfigErrors instead of errors from inside torch or transformers; a checkpoint
error that the worker processes find at TP 2 as the same ConfigError; and a weight stored in a valid
safetensors dtype the loader does not read (a ConfigError naming the tensor and its dtype); the rotary
inv_freq buffers older checkpoints carry, skipped by every family (Gemma 2 refused them); and sharded
checkpoints: a tensor two shards hold and a stray *.safetensors the index does not list, read as
transformers reads them, and an index that does not match its shards (a ConfigError naming the tensor
and the file); a single weight file read before an index beside it, as transformers reads it; negative
sizes, zero heads or an unknown dtype name in config.json, and a dangling weight file link, as
ConfigErrors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from conftest import GEMMA2, assert_same_tokens, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams, loader
from tp_runtime.config import build_model_config
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.models.llama import LlamaForCausalLM

MAX_TOKENS = 6


def engine_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=model_dir, device="cpu", dtype="float32", seed=0) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_matches_hf(model_dir: Path, attn_implementation: str | None = None) -> None:
    prompts = random_prompts((5, 19), json.loads((model_dir / "config.json").read_text())["vocab_size"])
    got = engine_greedy(model_dir, prompts)
    want = hf_greedy(model_dir, prompts, MAX_TOKENS, attn_implementation=attn_implementation)
    assert_same_tokens(got, want, prompts)


def with_tensors(src: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint `src` whose tensors `change` edits in place."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def edit_config(model_dir: Path, **changes: object) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))


# ----------------------------------------------------------------------------- tied embeddings


def test_tied_checkpoint_with_its_own_lm_head(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The loader ignored a tied model's lm_head.weight; transformers 5 unties a head that differs from
    the embeddings, so the engine silently gave other tokens than HF's."""
    tied = make_checkpoint(tie_word_embeddings=True)

    def same_head(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    check_matches_hf(with_tensors(tied, tmp_path / "same", same_head))

    def own_head(t: dict[str, torch.Tensor]) -> None:
        shape = t["model.embed_tokens.weight"].shape
        t["lm_head.weight"] = torch.randn(shape, generator=torch.Generator().manual_seed(3))

    own = with_tensors(tied, tmp_path / "own", own_head)
    hf = transformers.AutoModelForCausalLM.from_pretrained(own)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # transformers unties them
    with pytest.raises(ConfigError, match="set tie_word_embeddings to false"):
        LLM(model=own, device="cpu", dtype="float32")
    prompts = random_prompts((5, 19), 300)
    want = hf_greedy(own, prompts, MAX_TOKENS)
    edit_config(own, tie_word_embeddings=False)  # as the error says
    assert_same_tokens(engine_greedy(own, prompts), want, prompts)


def test_tied_checkpoint_with_only_the_lm_head(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """transformers fills a tied model's embeddings from lm_head.weight when the checkpoint has only that;
    the loader refused it as lacking model.embed_tokens.weight."""

    def head_only(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")

    check_matches_hf(with_tensors(make_checkpoint(tie_word_embeddings=True), tmp_path / "head", head_only))


# ----------------------------------------------------------------------------- checkpoint tensors


@pytest.mark.parametrize(
    ("architecture", "overrides", "attn"),
    [("LlamaForCausalLM", {}, None), ("Gemma2ForCausalLM", GEMMA2, "eager")],
    ids=["llama", "gemma2"],
)
def test_rotary_inv_freq_buffers_in_the_checkpoint_are_skipped(
    make_checkpoint: Callable[..., Path],
    tmp_path: Path,
    architecture: str,
    overrides: dict[str, object],
    attn: str | None,
) -> None:
    """Older checkpoints carry transformers' rotary inverse frequencies (a buffer it no longer saves and
    ignores when loading); the Llama family skipped them, Gemma 2 refused the checkpoint as holding an
    unexpected tensor. Both families share the rule now, and give HF's tokens."""

    def with_inv_freq(t: dict[str, torch.Tensor]) -> None:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
        t["model.rotary_emb.inv_freq"] = inv_freq
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()

    model_dir = with_tensors(make_checkpoint(architecture, **overrides), tmp_path / "m", with_inv_freq)
    check_matches_hf(model_dir, attn)


# ----------------------------------------------------------------------------- generation_config.json


def test_generation_config_eos_ids_and_malformed_file(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """generation_config.json's eos ids (a list) are the stop ids; a malformed file was a JSONDecodeError
    or AttributeError traceback from deep in the config reader, now a ConfigError naming the file."""
    model_dir = tmp_path / "model"
    shutil.copytree(make_checkpoint(), model_dir)
    gen = model_dir / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [7, 2], "bos_token_id": 1}))
    assert build_model_config(model_dir, device="cpu").eos_token_ids == (7, 2)
    for broken in ('{"eos_token_id": [7, 2', '["eos_token_id"]'):
        gen.write_text(broken)
        with pytest.raises(ConfigError, match=r"generation_config.json .*fix or remove the file"):
            build_model_config(model_dir, device="cpu")


def test_an_explicit_empty_eos_list_stops_at_no_eos(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """generation_config.json's eos_token_id: [] is no EOS in transformers' generate (nothing stops it);
    the engine took config.json's ids instead (or the tokenizer's) and stopped where HF runs on."""
    model_dir = tmp_path / "no-eos"
    shutil.copytree(make_checkpoint(seed=5), model_dir)
    prompts = random_prompts((7,), 300)
    eos = hf_greedy(model_dir, prompts, MAX_TOKENS)[0][1]  # a token greedy decoding reaches: config's EOS
    edit_config(model_dir, eos_token_id=eos)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [], "bos_token_id": 1}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = {"max_new_tokens": MAX_TOKENS, "do_sample": False, "pad_token_id": 0}
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    want = out[0, ids.shape[1] :].tolist()
    assert len(want) == MAX_TOKENS and eos in want  # HF runs past config.json's EOS
    with LLM(model=model_dir, device="cpu", dtype="float32", seed=0) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        [got] = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert (got.outputs[0].token_ids, got.outputs[0].finish_reason) == (want, "length")
    config = build_model_config(model_dir, device="cpu")
    assert (config.eos_token_ids, config.no_eos) == ((), True)
    # Without the file config.json's ids are read, as transformers does; an empty list there is no EOS too.
    (model_dir / "generation_config.json").unlink()
    assert build_model_config(model_dir, device="cpu").eos_token_ids == (eos,)
    edit_config(model_dir, eos_token_id=[])
    config = build_model_config(model_dir, device="cpu")
    assert (config.eos_token_ids, config.no_eos) == ((), True)


# ----------------------------------------------------------------------------- config values


def test_impossible_expert_routing_is_config_error(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """More experts per token than experts failed the first forward in torch.topk ("selected index k out
    of range"), and decoder_sparse_step 0 was a ZeroDivisionError; both are config.json mistakes."""
    expert_counts = {"MixtralForCausalLM": "num_local_experts", "Qwen3MoeForCausalLM": "num_experts"}
    for arch, experts in expert_counts.items():
        model_dir = tmp_path / arch
        built = make_checkpoint(arch, num_hidden_layers=1, moe_intermediate_size=32, **{experts: 2})
        shutil.copytree(built, model_dir)
        edit_config(model_dir, num_experts_per_tok=3)
        with pytest.raises(ConfigError, match=r"num_experts_per_tok=3 must be between 1 and the model's 2"):
            build_model_config(model_dir, device="cpu")
    edit_config(tmp_path / "Qwen3MoeForCausalLM", num_experts_per_tok=1, decoder_sparse_step=0)
    with pytest.raises(ConfigError, match="decoder_sparse_step must be >= 1"):
        build_model_config(tmp_path / "Qwen3MoeForCausalLM", device="cpu")


def test_stacked_experts_from_a_raw_state_dict_save_say_what_to_do(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers 5 holds a mixture of experts' weights stacked ([experts, ...] tensors) in memory and
    writes one tensor per expert with save_pretrained; a raw state_dict save keeps the stacked names, which
    the error now explains."""
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    built = make_checkpoint("Qwen3MoeForCausalLM", num_hidden_layers=1, **experts)
    model = transformers.AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    model_dir = tmp_path / "raw"
    shutil.copytree(built, model_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"stacked experts.*save_pretrained"):
        LLM(str(model_dir), dtype="float32", max_model_len=64)


def test_kv_heads_that_do_not_divide_the_heads_and_no_layers_are_config_errors(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """6 query heads over 4 KV heads (transformers builds the model and fails in its forward) started and
    then failed in torch's attention ("Number of heads in key and value must divide ..."); a config with
    no layers was an IndexError while the model was built."""
    model_dir = make_checkpoint(hidden_size=96, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="num_key_value_heads=4 must divide num_attention_heads=6"):
        build_model_config(model_dir, device="cpu")
    no_kv_heads = tmp_path / "no-kv-heads"
    shutil.copytree(make_checkpoint(), no_kv_heads)
    edit_config(no_kv_heads, num_key_value_heads=0)  # 0 is no "not given": not the query heads' count
    with pytest.raises(ConfigError, match="num_key_value_heads=0 must divide"):
        build_model_config(no_kv_heads, device="cpu")
    no_layers = tmp_path / "no-layers"
    shutil.copytree(make_checkpoint(), no_layers)
    edit_config(no_layers, num_hidden_layers=0)
    with pytest.raises(ConfigError, match="num_hidden_layers must be >= 1, got 0"):
        build_model_config(no_layers, device="cpu")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"intermediate_size": -1}, r"intermediate_size must be >= 1, got -1"),
        ({"vocab_size": -1}, r"vocab_size must be >= 1, got -1"),
        ({"head_dim": -8}, r"head_dim must be >= 1, got -8"),
        ({"num_attention_heads": 0}, r"could not read .*config.json .*ZeroDivisionError"),
        ({"dtype": "float33"}, r"could not read .*config.json .*AttributeError"),
    ],
    ids=["intermediate", "vocab", "head-dim", "no-heads", "dtype"],
)
def test_sizes_and_values_no_model_can_have_are_config_errors(
    make_checkpoint: Callable[..., Path], tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    """A negative width failed while the model was built ("Trying to create tensor with negative
    dimension", a rope arange error), zero heads as a ZeroDivisionError and an unknown dtype as an
    AttributeError from inside transformers' config classes; each is a config.json mistake."""
    model_dir = tmp_path / "bad"
    shutil.copytree(make_checkpoint(), model_dir)
    edit_config(model_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        build_model_config(model_dir, device="cpu")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("architecture", "changes", "message"),
    [
        ("LlamaForCausalLM", {"rms_norm_eps": NAN}, r"rms_norm_eps must be a finite number above 0, got nan"),
        ("LlamaForCausalLM", {"rms_norm_eps": -1.0}, r"rms_norm_eps must be a finite number above 0, got -1"),
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": NAN}},
         r"rope parameters of config.json give non-finite frequencies .*base nan"),
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
         r"non-finite frequencies"),
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": NAN, "rope_theta": 1e4}},
         r"the rope factor must be a finite number, got nan"),
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": INF, "rope_theta": 1e4}},
         r"rope factor must be a finite number"),
        ("LlamaForCausalLM", {"max_position_embeddings": 1}, r"max_model_len must be >= 2, got 1 "),
        ("LlamaForCausalLM", {"max_position_embeddings": -5}, r"max_model_len must be >= 2, got -5 "),
        ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar must be a finite number"),
        ("Gemma2ForCausalLM", {"attn_logit_softcapping": NAN}, r"attn_logit_softcapping must be a finite"),
        ("Gemma2ForCausalLM", {"final_logit_softcapping": NAN}, r"final_logit_softcapping must be a finite"),
        ("MistralForCausalLM", {"sliding_window": -3}, r"sliding_window must be at least 1"),
    ],
    ids=["eps-nan", "eps-negative", "theta-nan", "theta-zero", "linear-factor-nan", "yarn-factor-inf",
         "one-position", "negative-positions", "gemma2-scalar-zero", "gemma2-softcap-nan",
         "gemma2-final-softcap-nan", "mistral-window-negative"],
)
def test_float_values_no_model_can_have_are_config_errors(
    make_checkpoint: Callable[..., Path], tmp_path: Path, architecture: str, changes: dict[str, object],
    message: str,
) -> None:
    """transformers' configs check their integer fields but take any float: a NaN eps, rope base or
    soft-cap ran and gave NaN logits (greedy token 0 every step), a NaN rope factor was a ValueError, a
    zero query_pre_attn_scalar a ZeroDivisionError while the model was built, a negative
    max_position_embeddings a torch.arange error and one of 1 an engine that refused every request."""
    model_dir = tmp_path / "bad"
    shutil.copytree(make_checkpoint(architecture), model_dir)
    edit_config(model_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        build_model_config(model_dir, device="cpu")


def test_tied_checkpoint_under_an_untied_config(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A tied model's checkpoint (no lm_head.weight) with tie_word_embeddings false: transformers gives
    its LM head random weights; the loader refuses it, saying which setting to change."""
    model_dir = tmp_path / "untied"
    shutil.copytree(make_checkpoint(tie_word_embeddings=True), model_dir)
    edit_config(model_dir, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"lacks tensors for: lm_head\.weight; .* set tie_word_embeddings"):
        LLM(model=model_dir, device="cpu", dtype="float32")
    edit_config(model_dir, tie_word_embeddings=True)
    check_matches_hf(model_dir)


def test_a_checkpoint_error_found_by_the_workers_is_a_config_error(
    make_checkpoint: Callable[..., Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """At TP 2 the worker processes load the weights: what they find wrong reaches the user as the
    ConfigError the loader raised (it was a WorkerError carrying each rank's traceback), and the ranks end
    without printing tracebacks."""
    model_dir = tmp_path / "untied-tp2"
    shutil.copytree(make_checkpoint(tie_word_embeddings=True), model_dir)
    edit_config(model_dir, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"^checkpoint .* lacks tensors for: lm_head\.weight; ") as info:
        LLM(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2)
    assert "Traceback" not in str(info.value)
    assert "Traceback" not in capfd.readouterr().err


def test_rope_parameter_of_the_wrong_type_is_config_error(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A rope factor written as a string (transformers only warns about it) was a TypeError from inside
    transformers' rope functions."""
    model_dir = tmp_path / "rope"
    shutil.copytree(make_checkpoint(), model_dir)
    edit_config(model_dir, rope_parameters={"rope_type": "linear", "factor": "2.0", "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match=r"rope parameters .* not valid for rope type 'linear' \(TypeError"):
        build_model_config(model_dir, device="cpu")


# ----------------------------------------------------------------------------- safetensors files


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu])
def test_a_valid_dtype_the_loader_does_not_read_is_named(
    make_checkpoint: Callable[..., Path], tmp_path: Path, dtype: torch.dtype
) -> None:
    """A weight stored in a valid safetensors dtype the loader does not read (U16, U32, U64, F8_E8M0, ...)
    was refused as "not a valid safetensors file ... re-download", which does not help; the error names
    the tensor, its dtype and that it is not supported."""

    def retype(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = t["model.norm.weight"].to(dtype)

    model_dir = with_tensors(make_checkpoint(), tmp_path / "retyped", retype)
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    model = LlamaForCausalLM(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
    stored = {torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}.get(dtype, "F8_E8M0")
    with pytest.raises(ConfigError) as info:
        loader.load_weights(model, str(model_dir), torch.float32)
    message = str(info.value)
    assert f"tensor 'model.norm.weight' is stored as {stored}" in message, message
    assert "does not support" in message and "re-download" not in message, message


def sharded(src: Path, out: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """A copy of checkpoint `src` in two shards and an index (the first half of the sorted names in the
    first), plus `extra` tensors added to those files (by file name) without entering the index."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    files["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    weight_map = {name: file for file, part in files.items() for name in part}
    for file, part in files.items():
        held = {name: tensors[name] for name in part} | (extra or {}).pop(file, {})
        save_file(held, str(out / file), metadata={"format": "pt"})
    for file, held in (extra or {}).items():
        save_file(held, str(out / file), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_a_tensor_in_two_shards_and_a_stray_file_load_as_in_transformers(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers (5.x) reads every tensor of each file the index lists, in the index's sorted file
    order, so a tensor two shards hold is the later shard's even where the weight_map names the earlier
    one; a *.safetensors beside them that the index does not list is not read. The loader does the same
    (this pins it: following the weight_map would give other weights than transformers')."""
    src = make_checkpoint()
    shape = load_file(str(src / "model.safetensors"))["lm_head.weight"].shape  # in the first shard
    later, stray = torch.full(shape, 0.25), torch.full(shape, -0.5)
    model_dir = sharded(
        src,
        tmp_path / "dup",
        {
            "model-00002-of-00002.safetensors": {"lm_head.weight": later},
            "consolidated.safetensors": {"lm_head.weight": stray},
        },
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, later)
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    model = LlamaForCausalLM(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
    loader.load_weights(model, str(model_dir), torch.float32)
    assert torch.equal(model.lm_head.weight[: shape[0]], later)


def test_an_index_that_does_not_match_its_shards_names_tensor_and_file(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A weight_map that puts a tensor in a shard without it, or names a shard that is not there, was an
    error naming only the tensor ("lacks tensors for") or only the file; it names both now."""
    model_dir = sharded(make_checkpoint(), tmp_path / "sharded")
    second = model_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(str(second))
    del tensors["model.norm.weight"]
    save_file(tensors, str(second), metadata={"format": "pt"})
    want = r"lacks tensors for: model\.norm\.weight; .*puts 'model\.norm\.weight' in model-00002-of-00002"
    with pytest.raises(ConfigError, match=want):
        LLM(model=model_dir, device="cpu", dtype="float32")
    second.unlink()
    want = r"names weight files that are not in .*: model-00002-of-00002\.safetensors \(for 'model\.layers\."
    with pytest.raises(ConfigError, match=want):
        LLM(model=model_dir, device="cpu", dtype="float32")


def as_pytorch_bin(src: Path, out: Path, shards: int = 1) -> Path:
    """A copy of checkpoint `src` with its weights as transformers' PyTorch files (pytorch_model.bin, or
    `shards` pytorch_model-0000i-of-0000n.bin with their index) and no safetensors."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    if shards == 1:
        torch.save(tensors, out / "pytorch_model.bin")
        return out
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({name: tensors[name] for name in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("shards", [1, 2])
def test_pytorch_bin_checkpoints_load_as_in_transformers(
    make_checkpoint: Callable[..., Path], tmp_path: Path, shards: int
) -> None:
    """A checkpoint without safetensors, as older releases ship it: pytorch_model.bin, or shards and their
    index, which transformers falls back to. The tokens equal HF's on the same files, at TP 1 and (sharded)
    TP 2, each rank reading its slices."""
    model_dir = as_pytorch_bin(make_checkpoint(seed=7), tmp_path / "bin", shards)
    assert not list(model_dir.glob("*.safetensors"))
    # A stray adapter beside the weights is not the checkpoint's safetensors (transformers reads the .bin).
    save_file(
        {"base_model.model.lora_A.weight": torch.zeros(2, 2)}, str(model_dir / "adapter_model.safetensors")
    )
    prompts = random_prompts((5, 19), json.loads((model_dir / "config.json").read_text())["vocab_size"])
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_same_tokens(engine_greedy(model_dir, prompts), want, prompts)
    if shards > 1:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with LLM(model=model_dir, device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)


def test_a_tied_pytorch_bin_with_shared_storage(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """torch.save of a tied model's state dict keeps lm_head.weight and the embeddings as one storage;
    it loads as the tied model it is."""
    src = make_checkpoint(seed=3, tie_word_embeddings=True)
    model_dir = tmp_path / "tied"
    shutil.copytree(src, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    embed = tensors["model.embed_tokens.weight"]
    torch.save({**tensors, "lm_head.weight": embed}, model_dir / "pytorch_model.bin")
    check_matches_hf(model_dir)


class _RunsCode:
    """A pickle that would run a command when loaded by an unrestricted unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_bad_pytorch_bin_files_are_config_errors(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """No weights at all, a file that is not a checkpoint, a pickle that would run code (refused by
    torch.load's weights_only unpickler: nothing runs), and a state dict nested in another dict: each a
    ConfigError that says what to do, not a traceback from torch's unpickler."""
    src = make_checkpoint(seed=5)
    empty = tmp_path / "empty"
    shutil.copytree(src, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"neither \*\.safetensors nor pytorch_model\.bin"):
        LLM(model=empty, device="cpu", dtype="float32")
    tensors = load_file(str(src / "model.safetensors"))
    marker = tmp_path / "ran"
    cases = {
        "garbage": (b"not a checkpoint" * 64, r"is not a loadable PyTorch checkpoint"),
        "code": (
            None,
            r"holds more than tensors, which tp_runtime does not unpickle \(.*unsupported GLOBAL .*system",
        ),
        "nested": ({"state_dict": tensors}, r"does not hold a flat state dict"),
        "non-tensor": ({**tensors, "step": 3}, r"does not hold a flat state dict"),
    }
    for name, (content, message) in cases.items():
        model_dir = tmp_path / name
        shutil.copytree(empty, model_dir)
        path = model_dir / "pytorch_model.bin"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(_RunsCode(marker) if content is None else content, path)
        with pytest.raises(ConfigError, match=message):
            LLM(model=model_dir, device="cpu", dtype="float32")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_single_weight_file_wins_over_an_index_beside_it(
    make_checkpoint: Callable[..., Path], tmp_path: Path, kind: str
) -> None:
    """transformers reads model.safetensors before model.safetensors.index.json, and pytorch_model.bin
    before pytorch_model.bin.index.json; the loader read the index's shards, so a folder holding both
    (one left over from an earlier save) gave other weights than HF's, or failed on a stale index."""
    single, other = make_checkpoint(seed=1), make_checkpoint(seed=2)
    model_dir = tmp_path / kind
    if kind == "safetensors":
        sharded(other, model_dir)
        shutil.copy(single / "model.safetensors", model_dir / "model.safetensors")
    else:
        as_pytorch_bin(other, model_dir, shards=2)
        torch.save(load_file(str(single / "model.safetensors")), model_dir / "pytorch_model.bin")
    want = load_file(str(single / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight, want)
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    model = LlamaForCausalLM(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
    loader.load_weights(model, str(model_dir), torch.float32)
    assert torch.equal(model.lm_head.weight[: want.shape[0]], want)


def test_a_dangling_weight_file_link_is_a_config_error(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A model.safetensors link whose target is gone (the Hugging Face cache after an interrupted download
    links to blobs) was a FileNotFoundError traceback from the loader's open()."""
    model_dir = tmp_path / "dangling"
    shutil.copytree(make_checkpoint(), model_dir)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors").symlink_to(tmp_path / "gone" / "blob")
    with pytest.raises(ConfigError, match=r"could not open .*model\.safetensors .*download the checkpoint"):
        LLM(model=model_dir, device="cpu", dtype="float32")
