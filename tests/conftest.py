"""Shared fixtures: tiny random Hugging Face checkpoints built locally, and HF reference outputs."""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tp_runtime.presets import build_preset_tokenizer

_SESSION_TMP: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Temporary files of this test session, the tests' own and those of every process they start
    (torchrun's log folders, IPC socket folders), go into one folder removed at the end of the session.
    pytest's own tmp_path folders stay where they always are."""
    global _SESSION_TMP
    root = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)  # pytest's tmp_path root: unchanged
    _SESSION_TMP = tempfile.mkdtemp(prefix="tp-runtime-tests-", dir=root)
    os.environ["TMPDIR"] = _SESSION_TMP  # processes the tests start
    tempfile.tempdir = _SESSION_TMP  # this process
    # The Ctrl-C tests need Ctrl-C to raise KeyboardInterrupt, as in a terminal; a shell without job
    # control starts its background commands with SIGINT ignored (`bash scripts/test.sh &`).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_TMP is not None:
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)


ARCH_CONFIGS: dict[str, type[transformers.PretrainedConfig]] = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "MixtralForCausalLM": transformers.MixtralConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "SmolLM3ForCausalLM": transformers.SmolLM3Config,
    "GemmaForCausalLM": transformers.GemmaConfig,
    "GraniteForCausalLM": transformers.GraniteConfig,
    "Gemma2ForCausalLM": transformers.Gemma2Config,
    "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    "Phi3ForCausalLM": transformers.Phi3Config,
    "Olmo2ForCausalLM": transformers.Olmo2Config,
    "Olmo3ForCausalLM": transformers.Olmo3Config,
}

BASE_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


# A Gemma 2 test model where each of its features matters: windowed and global layers (window shorter than
# the prompts), both soft-caps, a query_pre_attn_scalar that is not head_dim, tied embeddings.
GEMMA2 = {
    "num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
    "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0, "tie_word_embeddings": True,
}  # fmt: skip
# A Gemma 3 test model: per-head q/k norms, layers 0 and 1 windowed (6 tokens) with the local rope (theta
# 10^4), layer 2 global with a linearly scaled rope of theta 10^6; no soft-caps; tied embeddings.
GEMMA3 = {
    "num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "tie_word_embeddings": True,
}  # fmt: skip


# The vision tower of a Gemma3ForConditionalGeneration test model: a tiny SigLIP (the runtime does not load
# it), 4x4 patches pooled to mm_tokens_per_image=4 image tokens.
TINY_SIGLIP = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "image_size": 32, "patch_size": 8,
}  # fmt: skip


def hf_config(architecture: str, **kwargs: Any) -> transformers.PretrainedConfig:
    """The transformers config of a test model; a multimodal architecture's `kwargs` are its text_config."""
    if architecture == "Gemma3ForConditionalGeneration":
        vocab = kwargs["vocab_size"]
        return transformers.Gemma3Config(
            architectures=[architecture], text_config=kwargs, vision_config=TINY_SIGLIP,
            # transformers ties the LM head as the outer config says
            tie_word_embeddings=kwargs.get("tie_word_embeddings", True), mm_tokens_per_image=4,
            # the image tokens within the vocabulary, as the releases' are
            boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1,
        )  # fmt: skip
    return ARCH_CONFIGS[architecture](architectures=[architecture], **kwargs)


def build_checkpoint(
    root: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any
) -> Path:
    """Save a random-weight float32 checkpoint (config, safetensors, tokenizer) under root; cached by args."""
    kwargs = {**BASE_CONFIG, **overrides}
    spec = json.dumps([architecture, seed, kwargs], sort_keys=True, default=str)
    key = hashlib.sha1(spec.encode()).hexdigest()
    out = root / f"{architecture}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    config = hf_config(architecture, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default init is tiny (std 0.02); larger weights make logits peaked, so greedy ties are improbable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.05)
    # Written whole into a scratch folder, then renamed: a build that fails half-way (a tokenizer that
    # refuses the vocabulary size) leaves no folder that a later call would take as ready.
    scratch = root / f".{out.name}-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch, safe_serialization=True)
    build_preset_tokenizer(kwargs["vocab_size"]).save_pretrained(scratch)
    try:
        scratch.rename(out)
    except OSError:  # another process built it meanwhile
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def with_chat_template(source: Path, out: Path, template: str) -> Path:
    """A copy of checkpoint folder `source` at `out` whose tokenizer has `template` as its chat template."""
    shutil.copytree(source, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.chat_template = template
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_checkpoint(checkpoint_root: Path) -> Callable[..., Path]:
    def make(architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any) -> Path:
        return build_checkpoint(checkpoint_root, architecture, seed, **overrides)

    return make


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    suppress_eos: bool = False,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (one at a time, no padding), in `dtype`.

    It never stops early: with suppress_eos EOS is masked out (pair with SamplingParams(min_tokens=N)),
    otherwise EOS may be generated and generation goes on (pair with SamplingParams(ignore_eos=True)).
    `attn_implementation`: e.g. "eager" for Gemma 2's soft-capped attention (SDPA drops the soft-cap).
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
    if not suppress_eos:
        model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if suppress_eos else None,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_logprobs(model_dir: Path, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits at each generated position: [len(continuation), vocab]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(continuation) - 1]
    return logits.float().log_softmax(-1)


def record_steps(llm: Any) -> list[Any]:
    """Every step's StepInputs of an in-process engine, appended as its input builder makes them."""
    builder = llm.engine.executor.worker.runner.inputs
    prepare, steps = builder.prepare, []

    def recording(so: Any) -> Any:
        inputs = prepare(so)
        steps.append(inputs)
        return inputs

    builder.prepare = recording
    return steps


def graph_chunks(inputs: Any) -> list[tuple[int, bool]]:
    """(first position, whether it samples) of each prefill chunk of more than one token that a step ran as
    decode-graph rows; [] for an eager step."""
    from tp_runtime.worker.inputs import GraphDecodeBatch

    if not isinstance(inputs.model, GraphDecodeBatch):
        return []
    rows, positions = inputs.model.batch_rows, inputs.model.positions
    return [
        (int(positions[rows == row].min()), row in inputs.sample_rows)
        for row in sorted(set(rows.tolist()))
        if (rows == row).sum() > 1
    ]


def random_prompts(lengths: tuple[int, ...], vocab: int, seed: int = 1234) -> list[list[int]]:
    """Random prompt ids from a fixed generator, avoiding the special ids 0-2 (pad, bos, eos)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_same_tokens(got: list[list[int]], want: list[list[int]], prompts: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i} (length {len(prompts[i])}): tp_runtime {g} != HF {w}"


@contextlib.contextmanager
def cli_servers(
    folder: Path, servers: dict[str, list[str]], start_deadline_s: float = 180.0
) -> Iterator[dict[str, str]]:
    """`python -m tp_runtime.server.cli` once per entry of `servers` (name -> its arguments after the
    module), started together, each logging to `folder/<name>.log`: yields each one's URL once all are
    ready. At the end each is stopped with SIGTERM and must exit 0 with no traceback in its log."""
    repo = Path(__file__).resolve().parents[1]
    logs = {name: folder / f"{name}.log" for name in servers}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in servers.items():
            with open(logs[name], "wb") as sink:  # a file, not a pipe: a pipe nobody reads would block
                cmd = [sys.executable, "-m", "tp_runtime.server.cli", *args]
                procs[name] = subprocess.Popen(cmd, cwd=repo, stdout=sink, stderr=subprocess.STDOUT)
        urls: dict[str, str] = {}
        deadline = time.monotonic() + start_deadline_s
        while len(urls) < len(procs):
            for name, proc in procs.items():
                match = re.search(r"ready on (http://\S+)", logs[name].read_text(errors="replace"))
                if match:
                    urls[name] = match.group(1)
                elif proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not start:\n{logs[name].read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        yield urls
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            output = logs[name].read_text(errors="replace")
            assert code == 0, output[-4000:]
            assert "Traceback" not in output, output[-4000:]


@contextlib.contextmanager
def fail_on_hang(timeout_s: int, what: str = "test") -> Iterator[None]:
    """Fail the test if it runs past timeout_s (SIGALRM); faulthandler ends the run if Python cannot."""

    def on_alarm(signum: int, frame: Any) -> None:
        pytest.fail(f"{what} still running after {timeout_s} s (hang)", pytrace=True)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    faulthandler.dump_traceback_later(timeout_s + 60, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def count_checkpoint_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets the element count of every tensor (or slice) the loader reads from a checkpoint."""
    from tp_runtime import loader

    read: list[int] = []
    original_read = loader.SafetensorsFile.read

    def counting_read(self: loader.SafetensorsFile, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = original_read(self, *args, **kwargs)
        read.append(out.numel())
        return out

    monkeypatch.setattr(loader.SafetensorsFile, "read", counting_read)
    return read


def run_interpreted(script: str, *args: str, stderr_tail: int = 3000, whole_output: bool = False) -> str:
    """Run `script` (python -c, with `args`) under Triton's CPU interpreter, which must be chosen before
    Triton is imported, hence a subprocess; its last line of output (`whole_output`: all of it, stripped).
    A failure shows its stderr. The script imports tests/triton_interpreter.py first (the interpreter
    without its repeated patching)."""
    tests_dir = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests_dir.parent), str(tests_dir)]),
        "TRITON_INTERPRET": "1",
    }
    proc = subprocess.run([sys.executable, "-c", "import triton_interpreter\n" + script, *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-stderr_tail:]
    return proc.stdout.strip() if whole_output else proc.stdout.strip().splitlines()[-1]
