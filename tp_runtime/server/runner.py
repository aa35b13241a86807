"""`tp-runtime serve`'s process: bind, load the model, serve the app (`api_server`) on uvicorn, one worker:
the engine, its thread and its worker processes live in this process.

SIGTERM and SIGINT (Ctrl-C) are handled alike, from before the model loads to the end:

- While the model loads, a signal stops the load: the workers started so far are shut down, and the
  server exits with status 0.
- While it serves, a signal drains: uvicorn closes the listening socket (new connections are refused),
  requests on open connections get 503, and so does /health. The engine lets the requests in flight run
  for up to --shutdown-grace seconds, then ends those still running with finish_reason "abort": a stream
  sends its last chunk and [DONE], a plain request gets its response. uvicorn waits for the connections to
  close, up to DRAIN_MARGIN_S seconds past the grace period (for those last responses to go out), and cuts
  any still open then. The engine thread stops the workers, and the server exits with status 0.
- A second signal while draining aborts the requests still running at once (a second Ctrl-C also stops
  uvicorn's wait for their connections). Signals during the final shutdown are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from tp_runtime.engine.async_engine import AsyncLLMEngine
from tp_runtime.errors import ConfigError
from tp_runtime.interrupts import DeferredSignals, in_import
from tp_runtime.server.api_server import build_app
from tp_runtime.server.connections import guarded_protocol

# Past the grace period, how long uvicorn waits for the aborted requests' last responses to go out.
DRAIN_MARGIN_S = 5.0


def host_names_taken(listening: str, allowed: list[str] | None) -> list[str] | None:
    """The domain names a server listening on address `listening` answers to besides IP addresses and
    dotless names such as localhost (build_app's `allowed_hosts`; None: any): on loopback only `allowed`'s
    (--allowed-hosts), so that no page can reach it by DNS rebinding; elsewhere any, unless
    --allowed-hosts names them."""
    if allowed is not None:
        return None if "*" in allowed else allowed
    return [] if ipaddress.ip_address(listening).is_loopback else None


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen before the model loads, so a taken port fails at once; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, which also drains the app when a shutdown signal arrives (uvicorn itself stops
    accepting connections and waits for those open, up to timeout_graceful_shutdown): the first signal
    gives the requests in flight `grace_s` seconds, a second one none."""

    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[float], None], grace_s: float) -> None:
        super().__init__(config)
        self._begin_drain = begin_drain
        self._grace_s = grace_s
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            self._loop = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A second Ctrl-C made uvicorn force its exit, cancelling the requests' tasks mid-response (500s and
        # tracebacks); as a second SIGTERM does, it aborts them at once instead (the drain with no grace).
        super().handle_exit(signal.SIGTERM if sig == signal.SIGINT and self.should_exit else sig, frame)
        self._signals += 1
        grace_s = self._grace_s if self._signals == 1 else 0.0
        # On the event loop, not in the signal handler: the drain takes a lock the interrupted code may hold.
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop just closed
                loop.call_soon_threadsafe(self._begin_drain, grace_s)


class _ShutdownRequested(BaseException):
    """A shutdown signal arrived while the model was loading (a BaseException, as KeyboardInterrupt, so
    that no `except Exception` on the way stops it)."""


class _Signals:
    """The main thread's SIGTERM and SIGINT handler for the server's whole life: while the model loads,
    the first signal raises _ShutdownRequested; while uvicorn serves, a signal drains (uvicorn installs its
    own handlers meanwhile; this one covers the moments around them); once `stopping`, signals are
    ignored."""

    def __init__(self) -> None:
        self.server: _DrainingServer | None = None
        self.stopping = False
        self.requested = False  # a signal came while the model loaded
        self._raised = False
        self._deferred = DeferredSignals()  # one that came inside an import, sent again after it

    def _handle(self, signum: int, frame: Any) -> None:
        self._deferred.arrived(signum)
        if self.stopping:
            return
        if self.server is not None:
            self.server.handle_exit(signum, frame)
            return
        self.requested = True
        if in_import(frame):  # (the model's load imports zmq, the tokenizer's modules, Triton)
            self._deferred.defer(signum)
            return
        if not self._raised:
            self._raised = True
            raise _ShutdownRequested

    def check(self) -> None:
        """Raise _ShutdownRequested if a signal came meanwhile: one that lands in a finalizer (__del__)
        is swallowed there, and the load went on to serve."""
        if self.requested:
            raise _ShutdownRequested

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        default_hook = sys.unraisablehook

        def hook(unraisable: Any) -> None:  # a swallowed _ShutdownRequested: check() raises it again
            if not isinstance(unraisable.exc_value, _ShutdownRequested):
                default_hook(unraisable)

        sys.unraisablehook = hook
        try:
            yield
        finally:
            self.stopping = True
            self._deferred.stop()
            sys.unraisablehook = default_hook
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# File descriptors the server needs besides its connections: the engine's sockets and pipes, its workers'
# pipes, the model's files, the logs.
_FDS_BESIDES_CONNECTIONS = 256


def _room_for_connections(max_connections: int) -> None:
    """Raise this process's soft limit on open files (up to the hard one) so that --max-connections
    connections fit, as vLLM does; the cap only bounds descriptors if they fit. Says so when they cannot."""
    import resource

    wanted = max_connections + _FDS_BESIDES_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < wanted:
        print(
            f"tp-runtime serve: warning: the open-file limit {soft} (ulimit -n) is below --max-connections "
            f"{max_connections} + {_FDS_BESIDES_CONNECTIONS}; connections past it fail to be accepted",
            file=sys.stderr,
            flush=True,
        )


def run_server(args: argparse.Namespace) -> None:
    """Start the engine from the command line's engine options, serve until SIGTERM / Ctrl-C, drain, and
    shut the workers down (see the module's doc); returns normally after a shutdown by signal. Under
    torchrun this is rank 0's part; the other ranks serve as its workers
    (`tp_runtime.cli.serve_torchrun_rank`)."""
    _room_for_connections(args.max_connections)
    sock = _listen(args.host, args.port)
    signals = _Signals()
    try:
        # _ShutdownRequested: a signal during the load; what had started is shut down already.
        with signals.installed(), contextlib.suppress(_ShutdownRequested):
            _serve(args, sock, signals)
        print("tp-runtime serve: shut down", flush=True)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, signals: _Signals) -> None:
    from tp_runtime.config import load_tokenizer
    from tp_runtime.engine.args import build_llm
    from tp_runtime.server.cli import API_KEY_ENV

    api_key = args.api_key  # check_serve resolved it: the flag, else the variable, else None
    llm = build_llm(args)
    engine = AsyncLLMEngine(llm.engine, shutdown_engine=llm.shutdown)
    try:
        signals.check()
        config = llm.engine.config
        tokenizer = load_tokenizer(config.tokenizer_source, config.trust_remote_code)
        if args.chat_template is not None:  # check_serve read and parsed it
            tokenizer.chat_template = args.chat_template
        model_name = args.served_model_name or _model_name(args.model)
        defaults = config.model.generation_defaults
        if defaults.overrides():  # once, at start, as vLLM says it
            print(
                f"tp-runtime serve: default sampling parameters from the model's generation config "
                f"({defaults.source}), as its creator recommends: {defaults.describe()}; a request's own "
                "values win (its max_tokens at most this max_tokens); --generation-config vllm leaves them "
                "out",
                flush=True,
            )  # fmt: skip
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        if api_key is None and not ipaddress.ip_address(host).is_loopback:
            print(
                f"tp-runtime serve: warning: listening on {host}, reachable from other machines, without "
                f"an API key; set --api-key (or ${API_KEY_ENV}) unless the network is yours alone",
                file=sys.stderr, flush=True,
            )  # fmt: skip

        def ready() -> None:
            age = process_age_s()
            started = "" if age is None else f"; started in {age:.1f} s"
            tp, max_len = config.parallel.tensor_parallel_size, config.model.max_model_len
            print(f"tp-runtime serve: ready on http://{shown}:{port} (model {model_name}, TP {tp}, "
                  f"max_model_len {max_len}{started})", flush=True)  # fmt: skip

        app, begin_drain = build_app(
            engine, tokenizer, model_name=model_name, api_key=api_key, on_ready=ready,
            allowed_origins=args.allowed_origins, tool_call_parser=args.tool_call_parser,
            allowed_hosts=host_names_taken(host, args.allowed_hosts),
            trust_request_chat_template=args.trust_request_chat_template,
        )  # fmt: skip
        # h11, with the header timeout and the connection cap uvicorn lacks (server.connections); the
        # event loop is uvloop where it is installed (uvicorn's "auto"), which every Linux install has.
        protocol = guarded_protocol(args.timeout_headers, args.max_connections)
        uv_config = uvicorn.Config(
            app, host=host, port=port, log_level=args.log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_grace + DRAIN_MARGIN_S, ws="none", lifespan="on",
            http=protocol,
        )  # fmt: skip
        server = _DrainingServer(uv_config, begin_drain, args.shutdown_grace)
        engine.start()
        signals.server = server  # from here on a signal drains
        signals.check()  # one swallowed before: not served
        server.run(sockets=[sock])
    finally:
        signals.stopping = True
        # After a drain the engine is shut down already; otherwise (uvicorn failed, a signal before it
        # served) this aborts whatever is left and stops the workers.
        engine.shutdown(grace_s=0.0)


def process_age_s() -> float | None:
    """Seconds since this process began (imports included), from Linux's /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 onwards
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, clock ticks
    except (OSError, ValueError, IndexError):
        return None


def _model_name(model: str | None) -> str:
    """What --model names: the value given, else the default model (its fallback without its package)."""
    if model is not None:
        return str(model)
    from tp_runtime.models_catalog import DEFAULT_MODEL, FALLBACK_MODEL, smollm2_available

    return DEFAULT_MODEL if smollm2_available() else FALLBACK_MODEL
