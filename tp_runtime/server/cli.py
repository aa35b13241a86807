"""`tp-runtime serve`: its flags (the engine options of `generate`, plus the server's) and entry point.

`tp_runtime.cli` adds the command with `add_serve_arguments` and runs it with `serve_main` (checked
first by `check_serve`); `python -m tp_runtime.server.cli ...` runs the same command on its own (with
the same one-line errors, and under torchrun the same split: rank 0 serves, the others are workers).
Nothing heavy is imported before the arguments are checked.
"""

from __future__ import annotations

import argparse
import os
import sys

API_KEY_ENV = "TP_RUNTIME_API_KEY"
DESCRIPTION = (
    "Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, "
    "/health and /metrics. SIGTERM or Ctrl-C drains: in-flight requests run for up to --shutdown-grace "
    'seconds, those still running then end with finish_reason "abort", the workers shut down and the '
    "server exits with status 0."
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (as `generate` has them, from EngineArgs) and the server's."""
    from tp_runtime.engine.args import add_engine_arguments

    add_engine_arguments(parser)
    group = parser.add_argument_group("server options")
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; the default accepts only this machine (0.0.0.0: every interface, "
        "then set --api-key)",
    )
    group.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    group.add_argument(
        "--api-key",
        default=None,  # not the variable's value: --help would show it
        help="require `Authorization: Bearer KEY` on the /v1 endpoints; a key in a flag shows in `ps`, so "
        f"prefer ${API_KEY_ENV} (default: ${API_KEY_ENV}, else no key)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and responses carry (default: the --model value)",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds SIGTERM or Ctrl-C lets in-flight requests run before it ends them (finish_reason "
        '"abort") and stops the workers',
    )
    group.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    group.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log one line per HTTP request",
    )


def check_serve(args: argparse.Namespace) -> None:
    """The server flags' checks; raises ConfigError naming the flag."""
    from tp_runtime.errors import ConfigError

    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"argument --port: must be in [0, 65535], got {args.port}")
    if not args.shutdown_grace >= 0:  # NaN fails too
        raise ConfigError(f"argument --shutdown-grace: must be at least 0, got {args.shutdown_grace:g}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("argument --api-key: must not be empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("argument --served-model-name: must not be empty")


def serve_main(args: argparse.Namespace) -> None:
    from tp_runtime.server.runner import run_server

    run_server(args)


def main(argv: list[str] | None = None) -> None:
    """`python -m tp_runtime.server.cli`: `tp-runtime serve` with the same checks and one-line errors."""
    from tp_runtime import cli
    from tp_runtime.errors import ConfigError, InvalidRequestError, TPRuntimeError

    parser = cli.ArgumentParser(
        prog="python -m tp_runtime.server.cli", description=DESCRIPTION, epilog=cli.MODELS_EPILOG
    )
    add_serve_arguments(parser)
    parser.set_defaults(command="serve", func=serve_main, check=check_serve, per_rank=True)
    try:
        args = parser.parse_args(argv)
        cli.check_args(args, under_torchrun=cli.torchrun_rank() is not None)
        if cli.torchrun_rank():  # a rank > 0: a worker of rank 0's engine, as under `tp-runtime serve`
            cli.serve_torchrun_rank(args)
        else:
            serve_main(args)
    except KeyboardInterrupt:
        print(f"{cli.PROG}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(cli.EXIT_INTERRUPTED) from None
    except (ConfigError, InvalidRequestError) as exc:
        cli.fail(str(exc))
    except TPRuntimeError as exc:
        print(f"{cli.PROG}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(cli.EXIT_USAGE) from None


if __name__ == "__main__":
    main()
