"""`EngineArgs`: the one place an engine option is declared.

Each option is a field of the frozen dataclass `EngineArgs`: its type (a `Literal` for a choice), its
default, its help text and its bounds. From the fields come

- `LLM(...)`'s keyword arguments (`EngineArgs.to_llm_kwargs()`; a test checks that the two agree, name
  for name and default for default),
- the command line's engine flags (`EngineArgs.add_cli_args(parser)`: the flag, its type, choices and
  help), read back by `EngineArgs.from_cli(namespace)`,
- the `EngineConfig` the engine runs with (`EngineArgs.create_engine_config()`),

and one validation (`EngineArgs(...)` raises `ConfigError` naming the option, or on the command line the
flag, and the values it takes).

Import-light: nothing here imports torch at module level (the command line parses and checks its
arguments before it loads anything heavy).
"""

from __future__ import annotations

import argparse
import math
import os
import types
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from tp_runtime.config import MAX_TIMEOUT_S, generation_config_problem
from tp_runtime.errors import ConfigError
from tp_runtime.models_catalog import DEFAULT_MODEL, resolve_model_name, resolve_tokenizer_name

# Choices of the string options. config.py keeps its own tuples for the engine's checks; a test checks that
# they agree with these.
Dtype = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]  # half, float: vLLM's aliases
Device = Literal["auto", "cpu", "cuda"]
LoadFormat = Literal["auto", "dummy"]
ExecutorKind = Literal["auto", "inprocess", "multiprocess", "torchrun"]
AllReduce = Literal["auto", "nccl", "symm_mem"]
CudaGraphs = Literal["auto", "off", "padded"]
AttentionBackend = Literal["auto", "torch", "triton", "triton_one_split"]
FusedKernels = Literal["auto", "torch", "triton"]
Quantization = Literal["fp8"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
# The most any count option may be (sequences, tokens, blocks, logprobs): far past what a machine holds,
# but within what tensors' sizes and the ranks' messages take (past it they failed with torch's or
# msgpack's overflow errors, differently at each TP size).
MAX_COUNT = 2**31 - 1


def meta(
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    default_help: str | None = None,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    power_of_two: bool = False,
) -> dict[str, Any]:
    """The metadata of an EngineArgs field: `field(default=..., metadata=meta(help=...))`.

    help: what the option does (the command line adds its default).
    flag: the command-line flag, when it is not the field name spelled `--field-name`; aliases: more
      spellings of it (`-tp`).
    default_help: what the default means, for a default of None (or none), shown as `(default: ...)`.
    at_least, above, at_most, power_of_two: bounds of a number (None passes where the type allows it).
    """
    return {
        "help": help,
        "flag": flag,
        "aliases": aliases,
        "default_help": default_help,
        "at_least": at_least,
        "above": above,
        "at_most": at_most,
        "power_of_two": power_of_two,
    }


@dataclass(frozen=True)
class EngineArgs:
    """Every option of an engine, with its default; `LLM(**args.to_llm_kwargs())` starts one."""

    model: str | os.PathLike[str] = field(
        metadata=meta(
            help="checkpoint folder or built-in model name, listed below", default_help=DEFAULT_MODEL
        )
    )
    tokenizer: str | os.PathLike[str] | None = field(
        default=None,
        metadata=meta(
            help="tokenizer folder or Hugging Face Hub id, as vLLM's --tokenizer",
            default_help="the model's",
        ),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=meta(
            help="let transformers run the Python code a checkpoint or tokenizer folder ships for its config "
            "or tokenizer (auto_map), as vLLM's --trust-remote-code; the model itself always runs this "
            "runtime's own implementation"
        ),
    )
    tensor_parallel_size: int = field(
        default=1, metadata=meta(help="ranks the model is split across", aliases=("-tp",), at_least=1)
    )
    dtype: Dtype = field(
        default="auto",
        metadata=meta(
            help="weight and activation dtype (auto: float32 on the CPU; on CUDA the checkpoint's 16-bit "
            "type, else bfloat16; half: float16, float: float32)"
        ),
    )
    device: Device = field(default="auto", metadata=meta(help="auto: CUDA when there is a GPU"))
    seed: int = field(
        default=0,
        metadata=meta(help="seed of the dummy weights and of sampling", at_least=0, at_most=2**63 - 1),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=meta(
            # 2: a one-token prompt and the token it generates
            help="longest sequence, prompt and output", default_help="the model's own limit", at_least=2
        ),
    )
    max_num_seqs: int = field(
        default=256, metadata=meta(help="sequences run at once", at_least=1, at_most=MAX_COUNT)
    )
    max_num_batched_tokens: int = field(
        default=8192, metadata=meta(help="tokens one step may process", at_least=1, at_most=MAX_COUNT)
    )
    load_format: LoadFormat = field(
        default="auto",
        metadata=meta(
            help="auto: the checkpoint's safetensors (else pytorch_model.bin); dummy: pseudo-random weights, "
            "same at every TP size"
        ),
    )
    quantization: Quantization | None = field(
        default=None,
        metadata=meta(
            help="fp8: FP8 linear layers (e4m3 weights with per-channel scales, quantized at load from a "
            "16/32-bit checkpoint; an FP8 checkpoint keeps its own scales)",
            default_help="as the checkpoint says",
        ),
    )
    kv_cache_dtype: KVCacheDtype = field(
        default="auto",
        metadata=meta(
            help="KV-cache storage: auto, the model's dtype; fp8 (= fp8_e4m3): e4m3 with one scale per "
            "layer for keys and one for values, the checkpoint's where it has them (kv_cache_scheme), "
            "else 1.0; half the bytes of bf16"
        ),
    )
    block_size: int = field(
        default=16,
        metadata=meta(help="tokens per KV-cache block (a power of two)", power_of_two=True, at_most=2**16),
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=meta(
            help="KV-cache blocks per rank",
            default_help="sized from memory: gpu-memory-utilization on a GPU, cpu-kv-cache-gib on the CPU",
            at_least=1,
            at_most=MAX_COUNT,
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=meta(
            help="share of the GPU's memory for weights, activations and KV cache", above=0.0, at_most=1.0
        ),
    )
    cpu_kv_cache_gib: float | None = field(
        default=None,
        metadata=meta(
            help="KV cache size per rank on the CPU, GiB",
            default_help="what max-num-seqs sequences of max-model-len tokens need, at most 10%% of the "
            "available RAM shared by the ranks",
            above=0.0,
            at_most=2**30,
        ),
    )
    step_timeout_s: float = field(
        default=300.0,
        metadata=meta(
            help="seconds a step may take", flag="--step-timeout", above=0.0, at_most=MAX_TIMEOUT_S
        ),
    )
    startup_timeout_s: float = field(
        default=600.0,
        metadata=meta(
            help="seconds the ranks may take to start and load the model",
            flag="--startup-timeout",
            above=0.0,
            at_most=MAX_TIMEOUT_S,
        ),
    )
    executor: ExecutorKind = field(
        default="auto",
        metadata=meta(
            help="how the ranks run (auto: in this process at TP 1, spawned worker processes at TP > 1, "
            "torchrun's ranks under torchrun)"
        ),
    )
    all_reduce: AllReduce = field(
        default="auto",
        metadata=meta(
            help="all-reduce between GPUs (auto: symmetric memory for decode-sized messages, NCCL otherwise)"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=meta(
            help="reuse the KV cache of a prompt prefix an earlier request computed (exact: hashed full "
            "blocks); --no-enable-prefix-caching: compute every prompt whole"
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=meta(
            help="send step N+1 before step N's sampled ids are back; --no-async-scheduling: one step at "
            "a time"
        ),
    )
    enforce_eager: bool = field(
        default=False, metadata=meta(help="run decode steps eagerly, without CUDA graphs")
    )
    cuda_graphs: CudaGraphs = field(
        default="auto",
        metadata=meta(
            help="decode steps as CUDA graphs (auto: on CUDA; off: eager; padded: the graph path's padded "
            "inputs run eagerly, to check that path on the CPU)"
        ),
    )
    attention_backend: AttentionBackend = field(
        default="auto",
        metadata=meta(
            help="attention over the paged KV cache (auto: split-KV Triton kernels on CUDA, else PyTorch "
            "SDPA; triton_one_split: one program per sequence and KV head)"
        ),
    )
    fused_kernels: FusedKernels = field(
        default="auto",
        metadata=meta(
            help="residual+RMSNorm, rotary, SiLU-mul as Triton kernels (auto: on CUDA) or PyTorch ops"
        ),
    )
    max_logprobs: int = field(
        default=20,
        metadata=meta(
            help="the most logprobs a request may ask for, per token", at_least=0, at_most=MAX_COUNT
        ),
    )
    generation_config: str | os.PathLike[str] = field(
        default="auto",
        metadata=meta(
            help="where requests' default sampling parameters come from, as vLLM's: auto, the model's "
            "generation_config.json (its repetition_penalty, temperature, top_k, top_p, min_p and "
            "max_new_tokens, for LLM.generate/chat without SamplingParams and for each server request "
            "that leaves them out); vllm: none (SamplingParams' own defaults); or a folder whose "
            "generation_config.json gives them (and the EOS ids)"
        ),
    )

    def __post_init__(self) -> None:
        dtype = self.dtype
        if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":  # torch.float16, as vLLM
            object.__setattr__(self, "dtype", str(dtype).removeprefix("torch."))
        # None for an option that takes no None means its default, as in vLLM's EngineArgs (wrappers pass
        # seed=None, enable_prefix_caching=None); the model alone must be given.
        for f in fields(self):
            unset = f.name != "model" and getattr(self, f.name) is None and f.default is not MISSING
            if unset and not _base_type(f.name)[1]:
                object.__setattr__(self, f.name, f.default)
        _validate({f.name: getattr(self, f.name) for f in fields(self)}, cli=False)

    # ------------------------------------------------------------------------------------- conversions

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def to_llm_kwargs(self) -> dict[str, Any]:
        """`LLM(**args.to_llm_kwargs())`: every option, by its LLM keyword."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def create_engine_config(self) -> Any:
        """The validated EngineConfig these options run with: resolves the model name to a checkpoint folder
        (writing a built-in model into the cache) and the device (this imports torch), and reads the
        model's config."""
        from tp_runtime.config import (
            CacheConfig,
            EngineConfig,
            ParallelConfig,
            SchedulerConfig,
            build_model_config,
            resolve_device,
        )
        model = resolve_model_name(self.model, self.load_format)
        device = resolve_device(self.device)
        model_config = build_model_config(
            model, dtype=self.dtype, device=device, max_model_len=self.max_model_len,
            load_format=self.load_format, quantization=self.quantization,
            generation_config=self.generation_config, trust_remote_code=self.trust_remote_code,
        )  # fmt: skip
        return EngineConfig(
            model=model_config,
            tokenizer=None if self.tokenizer is None else resolve_tokenizer_name(self.tokenizer),
            trust_remote_code=self.trust_remote_code,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, executor=self.executor,
                step_timeout_s=self.step_timeout_s, startup_timeout_s=self.startup_timeout_s,
                driver_host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                all_reduce=self.all_reduce,
            ),
            cache=CacheConfig(
                block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization, cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens
            ),
            device=device,
            seed=self.seed,
            async_scheduling=self.async_scheduling,
            cuda_graphs="off" if self.enforce_eager else self.cuda_graphs,
            attention_backend=self.attention_backend,
            fused_kernels=self.fused_kernels,
            max_logprobs=self.max_logprobs,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ command line

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        *,
        defaults: Mapping[str, Any] | None = None,
        helps: Mapping[str, str] | None = None,
    ) -> argparse.ArgumentParser:
        """Add a flag for every option to `parser`, in an "engine options" group; returns the parser (as
        vLLM's does: `parser = EngineArgs.add_cli_args(parser)`).

        Each flag's dest is the field name; its type, choices and help come from the field. `defaults`
        and `helps` replace a flag's default or help text for one command (a default of None there means
        the command fills the value in later, see `from_cli`)."""
        defaults = defaults or {}
        helps = helps or {}
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            spec = flag_spec(f.name)
            kwargs = dict(spec.kwargs)
            if f.name in defaults:
                kwargs["default"] = defaults[f.name]
            if f.name in helps:
                kwargs["help"] = helps[f.name]
            group.add_argument(*spec.option_strings, **kwargs)
        return parser

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The options a parsed command line gives (`add_cli_args`'s flags), with `overrides` on top.

        A flag left at None where its field takes no None (a value the command fills in later, or
        `--model` without a value) takes the field's default; the default model is resolved here.
        Raises ConfigError naming the flag."""
        values = cli_values(namespace)
        values.update(overrides)
        _validate(values, cli=True)
        if values.get("model") is None:
            values["model"] = resolve_model_name(None, values.get("load_format", "auto"))
        return cls(**values)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """vLLM's name of `from_cli`."""
        return cls.from_cli(namespace)

    @classmethod
    def check_cli(cls, namespace: argparse.Namespace) -> None:
        """Validate the engine flags of a parsed command line without resolving the model; raises
        ConfigError naming the flag."""
        _validate(cli_values(namespace), cli=True)


# ----------------------------------------------------------------------------------------- the fields


@dataclass(frozen=True)
class FlagSpec:
    """How one EngineArgs field appears on the command line: `add_argument(*option_strings, **kwargs)`."""

    name: str
    option_strings: tuple[str, ...]
    kwargs: Mapping[str, Any]


def flag_name(name: str) -> str:
    """The command-line flag of option `name` (`--tensor-parallel-size`, `--step-timeout`)."""
    return _field(name).metadata["flag"] or "--" + name.replace("_", "-")


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(EngineArgs)


def _field(name: str) -> Field[Any]:
    for f in fields(EngineArgs):
        if f.name == name:
            return f
    raise KeyError(name)


def _base_type(name: str) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed)."""
    hint = _hints()[name]
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        if len(args) == 1:
            return args[0], optional
        return str, optional  # str | os.PathLike[str]: the command line gives a str
    return hint, False


def choices(name: str) -> tuple[str, ...] | None:
    """The values a Literal option takes, None for other options."""
    base, _ = _base_type(name)
    return tuple(get_args(base)) if get_origin(base) is Literal else None


def flag_spec(name: str) -> FlagSpec:
    f = _field(name)
    meta = f.metadata
    base, _ = _base_type(name)
    default = None if f.default is MISSING else f.default
    help_text = meta["help"]
    if default is None and meta["default_help"]:
        help_text += f" (default: {meta['default_help']})"
    kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help_text}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif choices(name) is not None:
        kwargs["choices"] = choices(name)
    elif base in (int, float):
        kwargs["type"] = base
        kwargs["metavar"] = flag_name(name).lstrip("-").replace("-", "_").upper()
    return FlagSpec(name, (flag_name(name), *meta["aliases"]), kwargs)


def cli_values(namespace: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields a parsed command line holds; a None where the field takes no None is left
    out (the field's default applies)."""
    values = {}
    for f in fields(EngineArgs):
        if not hasattr(namespace, f.name):
            continue
        value = getattr(namespace, f.name)
        if value is None and not _base_type(f.name)[1]:
            continue
        values[f.name] = value
    return values


def _validate(values: Mapping[str, Any], *, cli: bool) -> None:
    """Check each option in `values` against its field's type, choices and bounds; raise ConfigError
    naming the first bad one (its flag when `cli`) and what it takes."""
    known = {f.name for f in fields(EngineArgs)}
    for name, value in values.items():
        if name not in known:  # EngineArgs(...) itself refuses it, with a TypeError
            continue
        problem = _problem(name, value)
        if problem:
            where = f"argument {flag_name(name)}:" if cli else name
            raise ConfigError(f"{where} {problem}")


def _problem(name: str, value: Any) -> str | None:
    meta = _field(name).metadata
    base, optional = _base_type(name)
    if value is None:
        return None if optional else "must be given, got None"
    options = choices(name)
    if options is not None:
        if value not in options:
            return f"must be one of {', '.join(options)}; got {value!r}"
        return None
    if base is bool:
        return None if isinstance(value, bool) else f"must be True or False, got {value!r}"
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be an int, got {value!r} ({type(value).__name__})"
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {value!r} ({type(value).__name__})"
        if math.isnan(value):
            return "must be a number, got nan"
        if math.isinf(value) and meta["at_most"] is None:  # (a bounded one says its bounds below)
            return f"must be a finite number, got {value}"
    if base is str and not isinstance(value, (str, os.PathLike)):
        return f"must be a str or a path, got {value!r} ({type(value).__name__})"
    if base is str and not os.fspath(value):
        return "must not be empty"
    if base in (int, float):
        return _bounds(value, meta)
    if name == "generation_config":
        return generation_config_problem(value)
    return None


def _bounds(value: float, meta: Mapping[str, Any]) -> str | None:
    def shown(x: float) -> str:  # ints in full (an int bound of 2**31 - 1 is not "2.14748e+09")
        return str(x) if isinstance(x, int) else f"{x:g}"

    low, above, high = meta["at_least"], meta["above"], meta["at_most"]
    if above is not None and high is not None and not above < value <= high:
        return f"must be in ({shown(above)}, {shown(high)}], got {shown(value)}"
    if low is not None and not value >= low:
        return f"must be at least {shown(low)}, got {shown(value)}"
    if above is not None and not value > above:
        return f"must be more than {shown(above)}, got {shown(value)}"
    if high is not None and not value <= high:
        return f"must be at most {shown(high)}, got {shown(value)}"
    if meta["power_of_two"] and (value < 1 or int(value) & (int(value) - 1)):
        return f"must be a power of two (1, 2, 4, 8, 16, ...), got {shown(value)}"
    return None


# --------------------------------------------------------------------------- the commands' engine flags

# `generate` sizes its batch to its prompts, up to this many sequences.
GENERATE_MAX_NUM_SEQS = 256


# `serve`'s token budget per step (the offline API keeps EngineArgs' 8192, for throughput). Prompt chunks
# share steps with decoding sequences, and a step with prefill takes about as long as its tokens' compute,
# so the budget bounds every stream's inter-token latency. Measured at 24 req/s (BENCHMARKS.md, "Real
# traffic"; Llama-3-8B, one H200): 1024 against 2048 took a server's mean TTFT from 474 to 45 ms on its
# first pass and from 146 to 40 ms on its second, and P99 ITL from 68 to 25 ms, at the same throughput.
SERVE_MAX_NUM_BATCHED_TOKENS = 1024


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    max_num_seqs: int | None = 256,
    max_num_batched_tokens: int | None = None,
) -> None:
    """The engine's flags, generated from EngineArgs (names, types, choices, help, defaults).
    `max_num_seqs=None`: the command sizes the batch to its work (`generate`). `max_num_batched_tokens`:
    the command's own default for it (None: EngineArgs')."""
    defaults: dict[str, Any] = {}
    helps: dict[str, str] = {}
    if max_num_batched_tokens is not None:
        defaults["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is None:
        defaults["max_num_seqs"] = None
        helps["max_num_seqs"] = (
            f"sequences run at once (default: as many as asked for, at most {GENERATE_MAX_NUM_SEQS})"
        )
    else:
        defaults["max_num_seqs"] = max_num_seqs
    EngineArgs.add_cli_args(parser, defaults=defaults, helps=helps)


def resolve_model_arg(args: argparse.Namespace) -> str:
    """The checkpoint folder for `args.model`, resolved once per process (cached on `args`)."""
    folder = getattr(args, "model_dir", None)
    if folder is None:
        folder = resolve_model_name(args.model, args.load_format)
        args.model_dir = folder
    return str(folder)


def engine_args(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """The engine options a parsed command line gives (the model resolved once per process)."""
    return EngineArgs.from_cli(args, model=resolve_model_arg(args), **overrides)


def build_llm(args: argparse.Namespace, **overrides: Any) -> Any:
    """An LLM started with the command line's engine options (`overrides`: EngineArgs fields on top)."""
    from tp_runtime import LLM

    return LLM(**engine_args(args, **overrides).to_llm_kwargs())
