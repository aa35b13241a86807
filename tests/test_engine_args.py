"""EngineArgs is the one place an engine option is declared: LLM's keyword arguments, the command line's
engine flags and the EngineConfig all come from its fields, and its validation names the option."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tp_runtime import LLM, SamplingParams, cli
from tp_runtime.config import (
    ALL_REDUCE_STRATEGIES,
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
)
from tp_runtime.engine.args import EngineArgs, choices, flag_name
from tp_runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def test_llm_takes_every_field_and_nothing_else() -> None:
    """LLM(model, **options) forwards its options to EngineArgs: every field is one, a stray keyword is a
    ConfigError that lists the options (before anything starts)."""
    kwargs = EngineArgs(model="tiny-llama", tensor_parallel_size=2, enforce_eager=True).to_llm_kwargs()
    assert set(kwargs) == set(FIELDS)
    assert list(inspect.signature(LLM.__init__).parameters) == ["self", "model", "options"]
    with pytest.raises(ConfigError, match=r"unknown engine option\(s\) tensor_paralel_size; the options "):
        LLM("tiny-llama", tensor_paralel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be at least 1, got 0"):
        LLM("tiny-llama", tensor_parallel_size=0)


def test_choices_agree_with_the_config_checks() -> None:
    assert choices("dtype") == DTYPES
    assert choices("attention_backend") == ATTENTION_BACKENDS
    assert choices("all_reduce") == ALL_REDUCE_STRATEGIES
    assert choices("quantization") == QUANTIZATIONS
    assert choices("kv_cache_dtype") == KV_CACHE_DTYPES
    hints = typing.get_type_hints(EngineArgs)
    for name in ("dtype", "device", "load_format", "executor", "all_reduce", "cuda_graphs",
                 "attention_backend", "fused_kernels", "kv_cache_dtype"):  # fmt: skip
        assert typing.get_origin(hints[name]) is typing.Literal, name


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="test")
    EngineArgs.add_cli_args(parser)
    return parser


def _engine_parsers() -> list[argparse.ArgumentParser]:
    """The `tp-runtime` commands that start an engine."""
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    return [sub.choices["generate"], bench.choices["latency"]]


@pytest.mark.parametrize("parser", [_parser(), *_engine_parsers()], ids=["EngineArgs", "generate", "latency"])
def test_every_field_has_a_flag_with_help_and_default(parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    by_dest = {a.dest: a for a in parser._actions}
    for name, field in FIELDS.items():
        action = by_dest.get(name)
        assert action is not None, f"no flag for EngineArgs.{name}"
        assert flag_name(name) in action.option_strings
        assert field.metadata["help"] and action.help, name
        shown = formatter._get_help_string(action) or ""
        assert "default" in shown, f"{name}: help {shown!r} does not give the default"
        if choices(name):
            assert tuple(action.choices or ()) == choices(name), name


def test_todays_flag_spellings() -> None:
    args = _parser().parse_args(
        ["--model", "m", "-tp", "2", "--step-timeout", "7.5", "--no-async-scheduling", "--dtype", "float32",
         "--cpu-kv-cache-gib", "0.5", "--enforce-eager", "--attention-backend", "torch"]
    )  # fmt: skip
    engine = EngineArgs.from_cli(args)
    assert engine == EngineArgs(
        model="m", tensor_parallel_size=2, step_timeout_s=7.5, async_scheduling=False, dtype="float32",
        cpu_kv_cache_gib=0.5, enforce_eager=True, attention_backend="torch",
    )  # fmt: skip


def test_cli_defaults_are_the_field_defaults() -> None:
    args = _parser().parse_args([])
    assert EngineArgs.from_cli(args, model="m") == EngineArgs(model="m")


def test_vllm_command_line_spelling() -> None:
    """vLLM's `parser = EngineArgs.add_cli_args(parser)` then `EngineArgs.from_cli_args(args)`: the parser
    comes back (the group did), and from_cli_args is from_cli."""
    parser = EngineArgs.add_cli_args(cli.ArgumentParser(prog="test"))
    args = parser.parse_args(["--model", "m", "--max-model-len", "64"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="m", max_model_len=64)


def test_from_cli_fills_in_a_deferred_default() -> None:
    """generate leaves --max-num-seqs at None until it knows how many sequences it runs."""
    parser = cli.ArgumentParser(prog="test")
    EngineArgs.add_cli_args(parser, defaults={"max_num_seqs": None})
    engine = EngineArgs.from_cli(parser.parse_args(["--model", "m"]))
    assert engine.max_num_seqs == FIELDS["max_num_seqs"].default


BAD_VALUES: list[tuple[str, Any, str]] = [
    ("tensor_parallel_size", 0, "at least 1"),
    ("tensor_parallel_size", "2", "must be an int"),
    ("tensor_parallel_size", True, "must be an int"),
    ("dtype", "float64", "one of auto, float32, bfloat16, float16"),
    ("device", "gpu", "one of auto, cpu, cuda"),
    ("seed", -1, "at least 0"),
    ("seed", 2**63, "at most 9223372036854775807"),  # the sampler's generators take a signed 64-bit seed
    ("max_model_len", 0, "at least 2"),
    ("max_model_len", 1, "at least 2"),
    ("max_num_seqs", 0, "at least 1"),
    ("model", None, "must be given"),
    # Counts past any machine failed in torch or msgpack with an overflow, differently at each TP size.
    ("max_num_seqs", 2**64, "at most 2147483647"),
    ("max_num_batched_tokens", -3, "at least 1"),
    ("max_num_batched_tokens", 2**31, "at most 2147483647"),
    ("load_format", "pt", "one of auto, dummy"),
    ("quantization", "int8", "one of fp8"),
    ("kv_cache_dtype", "fp8_e5m2", "one of auto, fp8, fp8_e4m3"),
    ("kv_cache_dtype", "int8", "one of auto, fp8, fp8_e4m3"),
    ("block_size", 24, "power of two"),
    ("block_size", 2**17, "at most 65536"),
    ("num_kv_blocks", 0, "at least 1"),
    ("num_kv_blocks", 2**40, "at most 2147483647"),
    ("gpu_memory_utilization", 1.5, "in (0, 1]"),
    ("gpu_memory_utilization", 0.0, "in (0, 1]"),
    ("cpu_kv_cache_gib", 0.0, "must be in (0, 1073741824], got 0"),
    ("cpu_kv_cache_gib", float("nan"), "nan"),
    ("cpu_kv_cache_gib", float("inf"), "must be in (0, 1073741824], got inf"),
    ("cpu_kv_cache_gib", 2.0**64, "must be in (0, 1073741824]"),
    ("step_timeout_s", -1.0, "must be in (0, 3.1536e+07]"),
    ("step_timeout_s", float("inf"), "must be in (0, 3.1536e+07], got inf"),
    ("step_timeout_s", "300", "must be a number"),
    ("startup_timeout_s", 1e15, "must be in (0, 3.1536e+07]"),
    ("executor", "threads", "one of auto, inprocess, multiprocess, torchrun"),
    ("all_reduce", "mpi", "one of auto, nccl, symm_mem"),
    ("async_scheduling", 1, "True or False"),
    ("enforce_eager", "yes", "True or False"),
    ("trust_remote_code", "yes", "True or False"),
    ("cuda_graphs", "on", "one of auto, off, padded"),
    ("attention_backend", "flash", "one of auto, torch, triton, triton_one_split"),
    ("fused_kernels", "cuda", "one of auto, torch, triton"),
    ("max_logprobs", -1, "at least 0"),
    ("max_logprobs", 2**64, "at most 2147483647"),
    ("model", "", "must not be empty"),
    ("model", 3, "str or a path"),
    ("generation_config", "/nonexistent-folder", "must be auto (the checkpoint's generation_config.json)"),
    ("generation_config", "", "must not be empty"),
    ("generation_config", 3, "str or a path"),
]


@pytest.mark.parametrize(
    ("name", "value", "fragment"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v, _ in BAD_VALUES]
)
def test_bad_value_raises_config_error_naming_the_option(name: str, value: Any, fragment: str) -> None:
    kwargs = {"model": "m", name: value}
    with pytest.raises(ConfigError) as info:
        EngineArgs(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{name} "), message
    assert fragment in message, message


def test_none_means_the_default_as_in_vllm() -> None:
    """vLLM's EngineArgs takes None for an option as its default (wrappers pass seed=None,
    enable_prefix_caching=None); it was a ConfigError, "must be given"."""
    nones = {n: None for n, f in FIELDS.items() if n != "model" and f.default is not dataclasses.MISSING}
    assert EngineArgs(model="m", **nones) == EngineArgs(model="m")
    assert EngineArgs(model="m", seed=None, enable_prefix_caching=None).seed == FIELDS["seed"].default


def test_every_field_has_a_bad_value_test() -> None:
    bounded = {n for n, f in FIELDS.items() if f.metadata["at_least"] is not None or choices(n)}
    assert bounded <= {name for name, _, _ in BAD_VALUES}


def test_cli_error_names_the_flag() -> None:
    args = _parser().parse_args(["--block-size", "3", "--step-timeout", "0"])
    with pytest.raises(ConfigError, match=r"^argument --block-size: must be a power of two"):
        EngineArgs.check_cli(args)
    args = _parser().parse_args(["--step-timeout", "0"])
    with pytest.raises(ConfigError, match=r"^argument --step-timeout: must be in \(0, 3.1536e\+07\], got 0"):
        EngineArgs.from_cli(args, model="m")


def test_a_torch_dtype_is_taken_as_its_name() -> None:
    """vLLM's dtype takes a torch.dtype too (LLM(model, dtype=torch.float16))."""
    import torch

    assert EngineArgs(model="m", dtype=torch.float16).dtype == "float16"  # type: ignore[arg-type]
    assert EngineArgs(model="m", dtype=torch.bfloat16).dtype == "bfloat16"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"dtype must be one of .*; got 'int8'"):
        EngineArgs(model="m", dtype=torch.int8)  # type: ignore[arg-type]


def test_a_batch_too_large_for_memory_names_its_options() -> None:
    """max_num_seqs up to its bound passed the checks, then the running batch's host arrays (rows x
    max_model_len) raised numpy's MemoryError from inside the worker."""
    with pytest.raises(ConfigError, match=r"max_num_seqs=2147483647 rows of max_model_len=64 .* lower"):
        LLM("tiny-llama", device="cpu", max_num_seqs=2**31 - 1, max_model_len=64)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineArgs(model="m").seed = 1  # type: ignore[misc]


def test_engine_config_is_the_one_llm_builds() -> None:
    args = EngineArgs(model="tiny-llama", device="cpu", dtype="float32", seed=3, max_num_seqs=4,
                      max_model_len=256, block_size=8, step_timeout_s=60.0, max_logprobs=5)  # fmt: skip
    with LLM.from_engine_args(args) as llm:
        assert args.create_engine_config() == llm.config


def test_import_is_light() -> None:
    code = "import sys, tp_runtime.engine.args; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_llm_on_a_torchrun_worker_rank_names_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun only rank 0 creates the LLM; any other rank is told what to call instead (and no
    constructor ends the process)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"rank 1 of a torchrun job.*run_torchrun_worker"):
        LLM("tiny-llama", tensor_parallel_size=2, device="cpu")


def test_run_torchrun_worker_outside_torchrun_is_refused() -> None:
    from tp_runtime import run_torchrun_worker

    with pytest.raises(ConfigError, match="for ranks > 0 of a torchrun job"):
        run_torchrun_worker("tiny-llama", device="cpu")


SHOUT_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class ShoutTokenizer(PreTrainedTokenizerFast):
    """The folder's own tokenizer class: decodes upper-cased."""

    def decode(self, *args, **kwargs):
        return super().decode(*args, **kwargs).upper()
'''


def test_trust_remote_code_runs_the_tokenizer_class_a_folder_ships(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """As vLLM's trust_remote_code: without it a folder whose tokenizer is its own code is refused with what
    to change; with it that class loads, and the model's tokens are those of the folder without it."""
    plain = make_checkpoint()
    folder = tmp_path / "shout"
    shutil.copytree(plain, folder)
    (folder / "tokenization_shout.py").write_text(SHOUT_TOKENIZER)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    own_class = {"AutoTokenizer": [None, "tokenization_shout.ShoutTokenizer"]}
    settings.update(tokenizer_class="ShoutTokenizer", auto_map=own_class)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match="trust_remote_code=True"):
        LLM(str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = {"prompt_token_ids": [5, 9, 13, 2, 7]}
    with LLM(str(plain)) as llm:
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with LLM(str(folder), trust_remote_code=True) as llm:
        assert type(llm.get_tokenizer()).__name__ == "ShoutTokenizer"
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    shout = llm.get_tokenizer().decode(got.token_ids)
    assert shout == shout.upper() != shout.lower()


CUSTOM_CONFIG = '''
from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    """The folder's own config class: Llama's, under a model_type transformers does not know."""

    model_type = "custom_llama"
'''


def test_trust_remote_code_on_the_command_line_reads_a_config_class_the_folder_ships(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The command line's model check (before anything starts, on every torchrun rank) reads config.json
    as the engine will: with --trust-remote-code, a config class the folder ships loads; without it the
    error says to pass it."""
    folder = tmp_path / "custom-config"
    shutil.copytree(make_checkpoint(), folder)
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    config = json.loads((folder / "config.json").read_text())
    own_class = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    config.update(model_type="custom_llama", auto_map=own_class)
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--model", str(folder), "--device", "cpu"]
    with pytest.raises(ConfigError, match=r"pass trust_remote_code=True \(--trust-remote-code\)"):
        cli.check_args(cli.build_parser().parse_args(argv), under_torchrun=False)
    args = cli.build_parser().parse_args([*argv, "--trust-remote-code"])
    cli.check_args(args, under_torchrun=False)
    assert args.model_config.architecture == "LlamaForCausalLM"


def test_trust_remote_code_with_a_hub_id_fetches_the_code_the_repository_ships(
    make_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id's snapshot holds the Python files of the repository's top level too: with
    trust_remote_code, the tokenizer class the repository ships loads (as from a local folder)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    repo = tmp_path / "repo"
    shutil.copytree(make_checkpoint(), repo)
    (repo / "tokenization_shout.py").write_text(SHOUT_TOKENIZER)
    settings = json.loads((repo / "tokenizer_config.json").read_text())
    own_class = {"AutoTokenizer": [None, "tokenization_shout.ShoutTokenizer"]}
    settings.update(tokenizer_class="ShoutTokenizer", auto_map=own_class)
    (repo / "tokenizer_config.json").write_text(json.dumps(settings))
    snapshot = tmp_path / "snapshot"

    def fake_download(repo_id: str, allow_patterns: list[str], ignore_patterns: list[str]) -> str:
        """The Hub's snapshot_download of `repo`: the files the patterns select."""
        names = [p.name for p in repo.iterdir()]
        chosen = filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        for name in chosen:
            snapshot.mkdir(exist_ok=True)
            shutil.copy(repo / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    with LLM("some-org/shout-model", trust_remote_code=True, device="cpu") as llm:
        assert type(llm.get_tokenizer()).__name__ == "ShoutTokenizer"


def test_a_config_class_whose_package_is_missing_is_a_config_error(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """With trust_remote_code, a config class that imports a package this environment lacks is a
    ConfigError naming the package (it was transformers' ImportError traceback; the tokenizer's was one)."""
    folder = tmp_path / "needs-package"
    shutil.copytree(make_checkpoint(), folder)
    (folder / "configuration_custom.py").write_text("import no_such_package_xyz\n" + CUSTOM_CONFIG)
    config = json.loads((folder / "config.json").read_text())
    own_class = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    config.update(model_type="custom_llama", auto_map=own_class)
    (folder / "config.json").write_text(json.dumps(config))
    refused = r"could not read .*config\.json .*ImportError: .*no_such_package_xyz"
    with pytest.raises(ConfigError, match=refused):
        LLM(str(folder), trust_remote_code=True, device="cpu")
