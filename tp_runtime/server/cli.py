"""`tp-runtime serve`: its flags (the engine options of `generate`, plus the server's) and entry point.

`tp_runtime.cli` adds the command with `add_serve_arguments` and runs it with `serve_main` (checked
first by `check_serve`); `python -m tp_runtime.server.cli ...` runs the same command on its own (with
the same one-line errors, and under torchrun the same split: rank 0 serves, the others are workers).
Nothing heavy is imported before the arguments are checked.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tp_runtime.server.tool_calls import TOOL_CALL_PARSERS

API_KEY_ENV = "TP_RUNTIME_API_KEY"
DESCRIPTION = (
    "Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, "
    "/health (or /ping) and /metrics. `serve MODEL` is `serve --model MODEL`, as in vLLM. SIGTERM or "
    "Ctrl-C drains: in-flight requests run for up to --shutdown-grace seconds, those still running then "
    'end with finish_reason "abort", the workers shut down and the server exits with status 0.'
)
DEFAULT_TIMEOUT_HEADERS_S = 5.0
DEFAULT_MAX_CONNECTIONS = 1024


class _ModelTag(argparse.Action):
    """The optional positional MODEL (`vllm serve MODEL`): stored in `model`, as --model is. Given after
    a different --model it is an error here; given before one, check_serve finds the conflict."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        if values is None:  # absent: argparse passes the default
            return
        model = getattr(namespace, "model", None)
        if model is not None and str(model) != values:
            raise argparse.ArgumentError(self, _conflict(values, model))
        namespace.model = values


def _conflict(tag: Any, model: Any) -> str:
    return f"the model is given twice, as MODEL {tag!r} and as --model {str(model)!r}; give one of them"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (as `generate` has them, from EngineArgs) and the server's."""
    from tp_runtime.engine.args import SERVE_MAX_NUM_BATCHED_TOKENS, add_engine_arguments

    add_engine_arguments(parser, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", action=_ModelTag,
        help="the model to serve, as --model takes it: `serve MODEL` is `serve --model MODEL`, as in vLLM "
        "(default: --model's, else the default model named below)",
    )  # fmt: skip
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
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='how tool calls are read from the model\'s text for tool_choice "auto": hermes (<tool_call> '
        "JSON, Qwen's templates), llama3_json (Llama 3's JSON calls) (default: none; tool_choice \"auto\" "
        "with tools is then refused)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="the Jinja chat template for /v1/chat/completions, a file or the template itself, as vLLM "
        "takes it (default: the tokenizer's; a model without one serves only /v1/completions)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="take a chat request's own chat_template (a Jinja template the server renders, in a sandbox "
        "but with no bound on its work), as vLLM's flag of this name (default: such a request is a 400)",
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
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="the web origins that may call the API from a browser (CORS), as a JSON list as vLLM takes "
        'it (\'["http://localhost:3000"]\') or comma-separated (http://a.example,https://b.example); "*": '
        "any origin (default: none, no CORS headers at all)",
    )
    group.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="the domain names requests may give in their Host header besides IP addresses and dotless "
        "names such as localhost, comma-separated or as a JSON list (e.g. the name a reverse proxy passes "
        'on); "*": any (default: on a loopback --host none, a 400 for any other, which keeps web pages from '
        "reaching the server by DNS rebinding; on any other --host, any)",
    )
    group.add_argument(
        "--timeout-headers",
        type=float,
        default=DEFAULT_TIMEOUT_HEADERS_S,
        metavar="SECONDS",
        help="a request's headers must arrive within this many seconds of the connection opening (or of "
        "the previous response, on a kept-alive connection), and a request's body may pause no longer; a "
        "connection slower than that is closed",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most; a connection beyond them gets 503 and is closed (each connection "
        "takes a file descriptor: see `ulimit -n`)",
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
    """The server flags' checks, and whether the port is free; raises ConfigError naming the flag."""
    from tp_runtime.config import torchrun_rank
    from tp_runtime.errors import ConfigError

    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"argument --port: must be in [0, 65535], got {args.port}")
    if not args.shutdown_grace >= 0:  # NaN fails too
        raise ConfigError(f"argument --shutdown-grace: must be at least 0, got {args.shutdown_grace:g}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("argument --api-key: must not be empty")
    key = args.api_key
    unsendable = key is not None and any((c < " " and c != "\t") or c == "\x7f" for c in key)
    if key is not None and (key != key.strip(" \t") or unsendable):
        # No client can send it: a header value loses its outer spaces and holds no control characters.
        raise ConfigError(
            f"argument --api-key: starts or ends with a space or holds a control character (a newline from a "
            f"file or ${API_KEY_ENV}?); no client could send it"
        )
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("argument --served-model-name: must not be empty")
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and str(args.model) != tag:
        raise ConfigError(f"argument MODEL: {_conflict(tag, args.model)}")
    if isinstance(args.allowed_origins, str):
        args.allowed_origins = parse_origins(args.allowed_origins)
    if isinstance(args.allowed_hosts, str):
        args.allowed_hosts = parse_hosts(args.allowed_hosts)
    if not (math.isfinite(args.timeout_headers) and args.timeout_headers > 0):
        raise ConfigError(
            f"argument --timeout-headers: must be more than 0 seconds, got {args.timeout_headers:g}"
        )
    if args.max_connections < 1:
        raise ConfigError(f"argument --max-connections: must be at least 1, got {args.max_connections}")
    rank = torchrun_rank()
    if not rank:  # rank 0 listens; the other ranks (maybe on other hosts) do not
        check_port_free(args.host, args.port)


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it reads as a template; it must parse as
    Jinja (a broken template is a start-up error, not a 500 on the first chat request)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from tp_runtime.errors import ConfigError

    flag = "argument --chat-template"
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a template longer than a file name may be
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag}: cannot read {path}: {exc}") from None
    elif "{{" in value or "{%" in value:
        # Given inline, its escapes (\n, \t, \uXXXX) are read as vLLM reads them: a shell passes "\n" as
        # two characters. (Characters past Latin-1 go through as \uXXXX escapes, so they stay as given.)
        try:
            text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{flag}: a bad escape in the inline template: {exc.reason}") from None
    else:
        raise ConfigError(f"{flag}: no file {value!r}, and not a template (no {{{{ or {{% in it)")
    if not text.strip():
        raise ConfigError(f"{flag}: the template is empty")
    try:
        _compile_jinja_template(text)  # the environment transformers renders it in (loop controls, ...)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{flag}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def parse_origins(value: str) -> list[str]:
    """--allowed-origins: a JSON list of strings, or origins separated by commas; each `*` or
    scheme://host[:port], exactly as a browser sends it in its Origin header (no path, no trailing /)."""
    from tp_runtime.errors import ConfigError

    flag = "argument --allowed-origins"
    origins = _list_value(flag, value, "origin")
    for origin in origins:
        if origin != "*" and not _is_origin(origin):
            raise ConfigError(
                f"{flag}: {origin!r} is not an origin; give scheme://host[:port] as a browser sends it "
                "(e.g. http://localhost:3000: no path, no trailing /), or *"
            )
    return origins


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def parse_hosts(value: str) -> list[str]:
    """--allowed-hosts: a JSON list of strings, or names separated by commas; each `*` or a host name
    (letters, digits, '-', '.', no port)."""
    from tp_runtime.errors import ConfigError

    flag = "argument --allowed-hosts"
    names = _list_value(flag, value, "host")
    for name in names:
        if name != "*" and not _HOST_NAME.fullmatch(name):
            raise ConfigError(
                f"{flag}: {name!r} is not a host name; give names such as api.example.com (no scheme, no "
                "port), or *"
            )
    return names


def _list_value(flag: str, value: str, item: str) -> list[str]:
    """A flag's list of `item`s: JSON (of strings) or comma-separated; stripped, empty ones left out, at
    least one."""
    from tp_runtime.errors import ConfigError

    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{flag}: not a valid JSON list ({exc.msg}): {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ConfigError(f"{flag}: a JSON list must hold strings only, got {value!r}")
    else:
        items = value.split(",")
    items = [o.strip() for o in items if o.strip()]
    if not items:
        raise ConfigError(f"{flag}: names no {item}; leave the flag out for the default")
    return items


def _is_origin(text: str) -> bool:
    try:
        parts = urlsplit(text)
        _ = parts.port  # a port that is no number raises ValueError
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.username
        and not parts.password and not (parts.path or parts.query or parts.fragment)
        and not text.endswith(("?", "#"))
    )  # fmt: skip


def check_port_free(host: str, port: int) -> None:
    """Whether --host/--port can be listened on, tried at once (binding as the server will: SO_REUSEADDR,
    then closed), rather than after the model loads. Port 0 (any free port) is not tried."""
    from tp_runtime.errors import ConfigError

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"argument --port: port {port} on {host} is already in use; stop what listens there or "
                    "choose another --port (0: any free port)"
                ) from None
            flag = "--port" if exc.errno == errno.EACCES else "--host"
            raise ConfigError(
                f"argument {flag}: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None


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
    parser.set_defaults(
        command="serve", func=serve_main, check=check_serve, check_before_model=True, per_rank=True
    )
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
