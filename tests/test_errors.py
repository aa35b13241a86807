"""User errors: each gives the documented exception, with a message that says what to change.

Engine-argument and checkpoint errors are ConfigError; prompt and sampling errors are InvalidRequestError.
Request-level errors share one TP=1 LLM (max_model_len=32); after every error it must still generate the
same greedy tokens as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import ConfigError, EngineClosedError, InvalidRequestError

VOCAB = 300  # conftest's BASE_CONFIG
MAX_MODEL_LEN = 32
PROBE = {"prompt_token_ids": [1, 17, 42, 99]}
GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


@pytest.fixture(scope="module")
def shared_llm(checkpoint: Path) -> Iterator[tuple[LLM, list[int]]]:
    llm = LLM(checkpoint, tensor_parallel_size=1, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    baseline = llm.generate(PROBE, GREEDY4, use_tqdm=False)[0].outputs[0].token_ids
    assert len(baseline) == 4
    yield llm, baseline
    llm.shutdown()


@pytest.fixture
def llm(shared_llm: tuple[LLM, list[int]]) -> Iterator[LLM]:
    """The shared LLM; after the test it must still serve requests exactly as before."""
    engine, baseline = shared_llm
    yield engine
    assert not engine.engine.has_unfinished_requests(), "a failed request was left in the scheduler"
    again = engine.generate(PROBE, GREEDY4, use_tqdm=False)[0].outputs[0].token_ids
    assert again == baseline, "the LLM no longer generates the same tokens after a user error"


def _copy_checkpoint(src: Path, dst: Path, **config_changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ----------------------------------------------------------------------------- engine arguments / checkpoint
def test_missing_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="not a directory") as info:
        LLM(missing, device="cpu")
    assert str(missing) in str(info.value) and "checkpoint folder" in str(info.value)


def test_dir_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LLM(tmp_path, device="cpu")


def test_unsupported_architecture_gpt2_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as info:
        LLM(tmp_path, device="cpu")
    assert "not supported" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_unsupported_architecture_renamed_llama(checkpoint: Path, tmp_path: Path) -> None:
    model = _copy_checkpoint(checkpoint, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*not supported.*supported: LlamaForCausalLM"):
        LLM(model, device="cpu")


def test_config_without_architectures(checkpoint: Path, tmp_path: Path) -> None:
    """No architectures listed: the class transformers would load for the model_type decides (a Llama
    loads, see test_model_families.py); one that is not supported here says so."""
    model = _copy_checkpoint(checkpoint, tmp_path / "m", architectures=None, model_type="gpt2")
    with pytest.raises(ConfigError, match=r"architecture 'GPT2LMHeadModel' .* is not supported"):
        LLM(model, device="cpu")


def test_config_json_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{this is not json")
    with pytest.raises(ConfigError, match="config"):
        LLM(tmp_path, device="cpu")


def test_config_with_unknown_model_type(tmp_path: Path) -> None:
    """A checkpoint of a model family transformers does not know (e.g. newer than the installed version)."""
    config = {"model_type": "brand_new_family", "architectures": ["BrandNewForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError):
        LLM(tmp_path, device="cpu")


def test_max_model_len_beyond_max_position_embeddings(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len=1024 exceeds.*max_position_embeddings=512") as info:
        LLM(checkpoint, device="cpu", max_model_len=1024)
    assert "lower max_model_len" in str(info.value)


@pytest.mark.parametrize("dtype", ["float64", "fp32", "", "torch.float32"])
def test_bad_dtype(checkpoint: Path, dtype: str) -> None:
    with pytest.raises(ConfigError, match="dtype must be one of") as info:
        LLM(checkpoint, device="cpu", dtype=dtype)
    assert "float32" in str(info.value) and repr(dtype) in str(info.value)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("fused_kernels", "cuda", "fused_kernels must be one of auto, torch, triton; got 'cuda'"),
        (
            "attention_backend",
            "flash",
            "attention_backend must be one of auto, torch, triton, triton_one_split; got 'flash'",
        ),
        ("cuda_graphs", "on", "cuda_graphs must be one of auto, off, padded; got 'on'"),
        ("all_reduce", "fast", "all_reduce must be one of auto, nccl, symm_mem; got 'fast'"),
        ("async_scheduling", "yes", "async_scheduling must be True or False"),
        ("all_reduce", "symm_mem", "all_reduce='symm_mem' needs device='cuda' (device is 'cpu')"),
    ],
)
def test_bad_engine_option(checkpoint: Path, option: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        LLM(checkpoint, device="cpu", **{option: value})


@pytest.mark.parametrize(("option", "value"), [("attention_backend", "triton"), ("fused_kernels", "triton")])
def test_triton_kernels_on_cpu_are_a_config_error(
    checkpoint: Path, option: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=f"{option}='triton' needs a CUDA device"):
        LLM(checkpoint, device="cpu", **{option: value})


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:0", ""])
def test_bad_device(checkpoint: Path, device: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("device must be one of auto, cpu, cuda; got ")):
        LLM(checkpoint, device=device)


def test_cuda_without_gpu(checkpoint: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match=r"no CUDA GPU.*device='cpu'"):
        LLM(checkpoint, device="cuda")


@pytest.mark.parametrize("tp", [0, -1])
def test_tensor_parallel_size_below_one(checkpoint: Path, tp: int) -> None:
    with pytest.raises(ConfigError, match=f"tensor_parallel_size must be at least 1, got {tp}$"):
        LLM(checkpoint, device="cpu", tensor_parallel_size=tp)


def test_tensor_parallel_size_not_an_int(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(checkpoint, device="cpu", tensor_parallel_size="2")  # type: ignore[arg-type]


_FLOAT_TP_SCRIPT = """
import gc, sys
from tp_runtime import LLM
from tp_runtime.errors import ConfigError

def attempt():
    try:
        LLM(sys.argv[1], device="cpu", tensor_parallel_size=2.0)
    except Exception as exc:
        err = exc  # keeps a reference cycle through the traceback, as pytest and IPython do
        print("RAISED", type(err).__name__, isinstance(err, ConfigError), err, flush=True)
    else:
        print("RAISED nothing", flush=True)

attempt()
import faulthandler
faulthandler.dump_traceback_later(10, exit=True)  # a hang in gc.collect() ends the process after 10 s
gc.collect()
faulthandler.cancel_dump_traceback_later()
print("EXITED", flush=True)
"""


def test_tensor_parallel_size_float(checkpoint: Path) -> None:
    """tensor_parallel_size=2.0 must be a ConfigError, and must not leave anything behind that hangs the
    process later. Run in a subprocess: a hang at garbage collection would otherwise hang pytest itself."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _FLOAT_TP_SCRIPT, str(checkpoint)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        out = proc.stdout + proc.stderr[-3000:]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\n(timed out: the process hung after the error)"
    assert "RAISED ConfigError True" in out, out
    assert "EXITED" in out, out


@pytest.mark.parametrize("tp", [3, 8])
def test_tensor_parallel_size_not_dividing_heads(checkpoint: Path, tp: int) -> None:
    # 4 attention heads, 2 KV heads, intermediate 128: 3 divides nothing; 8 > 4 heads.
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={tp}.*4 attention heads") as info:
        LLM(checkpoint, device="cpu", tensor_parallel_size=tp)
    assert "this model runs at tensor_parallel_size 1, 2, 4" in str(info.value)


# ----------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": "0.5"}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": -1}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": 2}, "stop_token_ids"),  # a bare int instead of a list
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [5]}, "stop"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else None,
)
def test_invalid_sampling_params(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith("invalid SamplingParams"), message
    assert field in message, f"the message should name {field!r}: {message}"


def test_valid_sampling_params_edges() -> None:
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1, n=1, logprobs=0)
    SamplingParams(top_k=0, seed=0, stop_token_ids=[], stop=["a", "b"])


@pytest.mark.parametrize("seed", [2**63, 2**64 + 1, -(2**63) - 1])
def test_seed_out_of_range(llm: LLM, seed: int) -> None:
    """Any int is accepted by SamplingParams; one that does not fit the engine's int64 seed storage must be
    rejected as an InvalidRequestError (it must never reach the workers, where it fails mid-step)."""
    try:
        params = SamplingParams(seed=seed, max_tokens=2)
    except InvalidRequestError as exc:
        assert "seed" in str(exc)
        return
    with pytest.raises(InvalidRequestError, match="seed"):
        llm.generate(PROBE, params, use_tqdm=False)


def test_logprobs_beyond_vocab_size(llm: LLM) -> None:
    """logprobs=k asks for the top-k alternatives; k > vocab size cannot be served."""
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.generate(PROBE, SamplingParams(logprobs=VOCAB + 1, max_tokens=2), use_tqdm=False)


def test_logprobs_up_to_vocab_size_work(llm: LLM) -> None:
    out = llm.generate(PROBE, SamplingParams(logprobs=20, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 2


# ----------------------------------------------------------------------------- prompts
def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="40 tokens but max_model_len is 32") as info:
        llm.generate({"prompt_token_ids": [5] * 40}, GREEDY4, use_tqdm=False)
    assert "shorten the prompt or raise max_model_len" in str(info.value)


def test_prompt_text_longer_than_max_model_len(llm: LLM) -> None:
    text = "hello world " * 20
    assert len(llm.tokenizer(text)["input_ids"]) > MAX_MODEL_LEN
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        llm.generate(text, GREEDY4, use_tqdm=False)


def test_prompt_length_boundary(llm: LLM) -> None:
    # A prompt must leave room for one generated token: 31 tokens fit, 32 do not.
    out = llm.generate({"prompt_token_ids": [5] * 31}, SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="32 tokens"):
        llm.generate({"prompt_token_ids": [5] * 32}, GREEDY4, use_tqdm=False)


def test_bad_prompt_in_a_batch_rejects_the_whole_batch_up_front(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([PROBE, {"prompt_token_ids": [1, VOCAB]}], GREEDY4, use_tqdm=False)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty") as info:
        llm.generate({"prompt_token_ids": []}, GREEDY4, use_tqdm=False)
    assert "at least one" in str(info.value)


def test_an_empty_text_is_the_tokenizers_bos(llm: LLM) -> None:
    """As in vLLM, "" is the prompt its encoding gives (a BOS here), not an error; an output with request
    ids unique over the LLM's life (vLLM's), and finished() as vLLM's CompletionOutput has it."""
    bos = llm.get_tokenizer()("")["input_ids"]
    assert bos, "this test needs a tokenizer that puts a BOS in front"
    first, again = (llm.generate(["", PROBE], GREEDY4, use_tqdm=False) for _ in range(2))
    assert first[0].prompt_token_ids == bos and len(first[0].outputs[0].token_ids) == 4
    assert first[0].outputs[0].finished() and again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    ids = [out.request_id for out in first + again]
    assert len(set(ids)) == 4, ids


@pytest.mark.parametrize("bad", [1.5, "a", True, None, [3]], ids=repr)
def test_non_integer_token_ids(llm: LLM, bad: Any) -> None:
    with pytest.raises(InvalidRequestError, match="must be ints") as info:
        llm.generate({"prompt_token_ids": [1, 2, bad]}, GREEDY4, use_tqdm=False)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_out_of_vocab_token_ids(llm: LLM, bad: int) -> None:
    with pytest.raises(
        InvalidRequestError, match=rf"token id {bad} is outside the vocabulary \[0, {VOCAB}\)"
    ):
        llm.generate({"prompt_token_ids": [1, bad]}, GREEDY4, use_tqdm=False)


@pytest.mark.parametrize(
    "prompt,message",
    [
        *((p, "a prompt must be a str or a dict with 'prompt_token_ids'") for p in (5, 1.5, None, b"bytes")),
        ({"text": "hi"}, r"a prompt dict takes only 'prompt', 'prompt_token_ids' and 'cache_salt' here, got"),
        ({"prompt": None}, "a prompt must be a str or a dict with 'prompt_token_ids'"),
        *(
            ({"prompt": p, "prompt_token_ids": [1]}, f"token-id prompt's 'prompt' .* got {type(p).__name__}")
            for p in (5, [1, 2], b"hi")
        ),
    ],
    ids=repr,
)
def test_prompt_of_wrong_type_in_a_list(llm: LLM, prompt: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], GREEDY4, use_tqdm=False)


@pytest.mark.parametrize("prompt", [5, 1.5, None], ids=repr)
def test_prompt_of_wrong_type_bare(llm: LLM, prompt: Any) -> None:
    """generate(5): the same error as generate([5]), not a TypeError from list(5)."""
    with pytest.raises(InvalidRequestError, match="a prompt must be a str or a dict"):
        llm.generate(prompt, GREEDY4, use_tqdm=False)


@pytest.mark.parametrize("ids", [np.array([1, 2, 3]), "1 2 3", range(1, 4)], ids=["ndarray", "str", "range"])
def test_prompt_token_ids_not_a_list(llm: LLM, ids: Any) -> None:
    """Non-empty ids of the wrong container type: either served, or rejected with a message that does not
    claim the prompt is empty."""
    try:
        out = llm.generate({"prompt_token_ids": ids}, GREEDY4, use_tqdm=False)
    except InvalidRequestError as exc:
        assert "empty" not in str(exc), f"misleading message for {type(ids).__name__} ids: {exc}"
        return
    assert len(out[0].outputs[0].token_ids) == 4


def test_sampling_params_count_mismatch(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="got 3 SamplingParams for 2 prompts"):
        llm.generate([PROBE, PROBE], [GREEDY4] * 3, use_tqdm=False)


def test_sampling_params_of_wrong_type(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate(PROBE, {"temperature": 0.0}, use_tqdm=False)  # type: ignore[arg-type]


def test_calls_after_shutdown_raise_engine_closed_error(checkpoint: Path) -> None:
    """A shut-down LLM (also one left by its `with` block) raises EngineClosedError, as one whose engine
    died does: callers catch one exception for a closed engine."""
    with LLM(checkpoint, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN) as llm:
        pass
    with pytest.raises(EngineClosedError, match="shut down"):
        llm.generate(PROBE, GREEDY4, use_tqdm=False)
    with pytest.raises(EngineClosedError, match="shut down"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY4, use_tqdm=False, chat_template="{{ 'a' }}")
