"""Built-in model names resolve to checkpoint folders wherever a folder works; the TP sizes they run at."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tp_runtime.errors import ConfigError
from tp_runtime.models_catalog import BUILTIN_MODELS, known_names, resolve_model_name, supported_tp_sizes

REPO = Path(__file__).resolve().parents[1]


def test_a_folder_is_used_as_it_is(tmp_path: Path) -> None:
    assert resolve_model_name(tmp_path) == str(tmp_path)
    # A folder wins over a built-in name spelled the same.
    (tmp_path / "tiny-llama").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_model_name("tiny-llama") == "tiny-llama"
    finally:
        os.chdir(cwd)


def test_a_folder_under_home_is_found_from_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM(model="~/ckpt"): no shell expands the "~" (it was "is not a directory")."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert resolve_model_name("~/ckpt") == str(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("model", "says"),
    [("path/to/hf-checkpoint", "is not a directory"), ("llama-9", "nor a built-in model name")],
)
def test_unknown_name_is_a_config_error_listing_the_names(model: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        resolve_model_name(model)
    assert repr(model) in str(info.value)
    for name in known_names():
        assert name in str(info.value)


def test_a_missing_gguf_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "model.Q4_K_M.gguf"
    with pytest.raises(ConfigError, match=f"GGUF file {missing} does not exist"):
        resolve_model_name(missing)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")),
    reason="needs gguf and accelerate (scripts/setup.sh installs them)",
)
def test_a_cut_or_corrupt_gguf_header_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF file cut short in its metadata, or with a string length past any file, failed inside
    transformers' GGUF reader with a bare struct.error or OverflowError traceback."""
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)  # version 3, no tensors, one metadata key
    bodies = {"cut": struct.pack("<Q", 100) + b"general", "huge": struct.pack("<Q", 1 << 63)}
    for name, body in bodies.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(header + body)
        with pytest.raises(ConfigError, match=rf"{name}\.gguf could not be read as a GGUF model"):
            resolve_model_name(path)


def test_shape_without_weights_needs_dummy() -> None:
    with pytest.raises(ConfigError, match="load_format='dummy'"):
        resolve_model_name("llama-3-8b")
    folder = Path(resolve_model_name("llama-3-8b", "dummy"))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 32
    assert not list(folder.glob("*.safetensors"))


def test_random_weight_models_have_weights_and_a_tokenizer() -> None:
    for name in ("tiny-llama", "tiny-llama-tp"):
        folder = Path(resolve_model_name(name))
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_tp_sizes() -> None:
    assert supported_tp_sizes("tiny-llama-tp") == [1, 2, 4, 8]
    assert supported_tp_sizes("tiny-llama") == [1, 2, 4]
    assert supported_tp_sizes("smollm2-135m-instruct") == [1, 3]
    assert supported_tp_sizes("llama-3-8b") == [1, 2, 4, 8]
    assert {m.name for m in BUILTIN_MODELS} == set(known_names())


def test_llm_takes_a_built_in_name() -> None:
    from tp_runtime import LLM, SamplingParams

    with LLM(model="tiny-llama", device="cpu") as llm:
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_llm_unknown_name_is_a_config_error() -> None:
    from tp_runtime import LLM

    with pytest.raises(ConfigError, match="built-in model name"):
        LLM(model="no-such-model", device="cpu")


def _generate_ids(tp: int, tmp_path: Path) -> list[list[int]]:
    out = tmp_path / f"tp{tp}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tp_runtime.cli", "generate", "--model", "tiny-llama-tp", "-tp", str(tp),
         "--device", "cpu", "--max-tokens", "8", "--ignore-eos", "--output-json", str(out),
         "Hello, my name is", "The capital of France is"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["token_ids"] for r in json.loads(out.read_text())]


@pytest.mark.slow
def test_tiny_llama_tp_runs_at_tp_1_2_4_with_the_same_tokens(tmp_path: Path) -> None:
    reference = _generate_ids(1, tmp_path)
    assert _generate_ids(2, tmp_path) == reference
    assert _generate_ids(4, tmp_path) == reference


def test_a_hub_repository_without_safetensors_brings_its_pytorch_bin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id fetches configs, safetensors and tokenizer files; only where that snapshot has no
    safetensors weights (an older release) are transformers' fallback pytorch_model*.bin files fetched."""
    import huggingface_hub

    calls: list[list[str]] = []
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()

    def fake_download(repo_id: str, allow_patterns: list[str], ignore_patterns: list[str]) -> str:
        calls.append(list(allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_name("some-org/old-model") == str(snapshot)
    assert len(calls) == 2 and "pytorch_model*.bin" not in calls[0] and "pytorch_model*.bin" in calls[1]
    calls.clear()
    (snapshot / "model.safetensors").write_bytes(b"")
    assert resolve_model_name("some-org/new-model") == str(snapshot)
    assert len(calls) == 1 and "pytorch_model*.bin" not in calls[0]


def test_concurrent_callers_build_a_cached_folder_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's ranks resolving one GGUF file (or built-in model) at once: one builds, the others wait
    for its folder instead of each converting the model again."""
    import threading
    import time

    from tp_runtime.presets import cached_dir

    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    builds: list[int] = []

    def build(out: Path) -> None:
        builds.append(1)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(cached_dir("shared", build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and found == [tmp_path / "shared"] * 4
    assert (tmp_path / "shared" / "config.json").is_file()
