"""Issue 24, server hardening, end to end: real servers (`python -m tp_runtime.server.cli tiny-llama-tp`,
the model given positionally) on free loopback ports, reached through real sockets.

Three servers start at once, for the module: one with the defaults but a 1 s --timeout-headers (content
types, no CORS, the header timeout), one with --allowed-origins, one with --max-connections 3 (and a long
--timeout-headers, so that the idle connection it holds stays open). Every wait is for an event (a ready
line, a response, a close) under a deadline. Then the EngineClosedError after a Ctrl-C, and the command
line: the positional model and the port check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tp_runtime import LLM, SamplingParams
from tp_runtime import cli as tp_cli
from tp_runtime.errors import ConfigError, EngineClosedError
from tp_runtime.messages import ExecuteModel
from tp_runtime.server import cli as serve_cli

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama-tp"
START_DEADLINE_S = 180.0
HEADER_TIMEOUT_S = 1.0
CLOSE_SLACK_S = 5.0  # how late past the header timeout a close may be observed on a loaded machine
ALLOWED = "http://a.example"
OTHER_ALLOWED = "https://b.example:8443"
COMPLETION = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 2, "temperature": 0}
PROXIED_HOST = "api.proxy.example"  # a name the "cors" server is told to answer to (--allowed-hosts)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _launch(tmp: Path, name: str, *extra: str) -> Server:
    log = tmp / f"{name}.log"
    cmd = [
        sys.executable, "-m", "tp_runtime.server.cli", MODEL, "--device", "cpu", "--port", "0",
        "--max-model-len", "1000", "--log-level", "warning", "--no-access-log", *extra,
    ]  # fmt: skip
    with open(log, "wb") as sink:  # a file, not a pipe: a pipe nobody reads would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    return Server(proc, log)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while not (match := re.search(r"ready on (http://\S+)", server.output())):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the server did not start:\n{server.output()[-4000:]}")
        time.sleep(0.05)
    server.url = match.group(1)


def _stop(servers: list[Server]) -> list[int]:
    """SIGTERM to every server at once (each drains), then their exit statuses."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    codes = []
    for server in servers:
        try:
            codes.append(server.proc.wait(timeout=60))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
            raise
    return codes


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """The three servers, started together (each loads while the others do)."""
    tmp = tmp_path_factory.mktemp("hardening")
    started = {
        "default": _launch(tmp, "default", "--timeout-headers", str(HEADER_TIMEOUT_S)),
        "cors": _launch(tmp, "cors", "--allowed-origins", f"{ALLOWED}, {OTHER_ALLOWED}", "--allowed-hosts",
                        PROXIED_HOST),
        "capped": _launch(tmp, "capped", "--max-connections", "3", "--timeout-headers", "60"),
    }
    try:
        for server in started.values():
            _wait_ready(server)
        yield started
    finally:
        codes = _stop(list(started.values()))
    for code, server in zip(codes, started.values(), strict=True):
        assert code == 0, server.output()[-4000:]
        assert "Traceback" not in server.output(), server.output()[-4000:]


@pytest.fixture(scope="module")
def default(servers: dict[str, Server]) -> Server:
    return servers["default"]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def _read_response(sock: socket.socket) -> bytes:
    """One response to a request with no body in reply (status line and headers, Content-Length: 0)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the response ended: {data!r}"
        data += chunk
    return data


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# ------------------------------------------------------------------------------------- content types
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "image/png", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_not_declared_json_gets_415(default: Server, content_type: str) -> None:
    body = json.dumps(COMPLETION).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/no-such-route"):
        response = httpx.post(f"{default.url}{path}", content=body, headers={"Content-Type": content_type})
        error = _error(response, 415)
        assert error["type"] == "invalid_request_error" and error["code"] == 415, error
        assert "application/json" in error["message"] and content_type in error["message"], error


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_bodies_are_taken(default: Server, content_type: str) -> None:
    """JSON with parameters and in any case."""
    headers = {"Content-Type": content_type}
    response = httpx.post(f"{default.url}/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_without_a_content_type_gets_415(default: Server) -> None:
    """What a page's `fetch` of a Blob sends cross-origin without a preflight: no Content-Type."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        request = httpx.Request("POST", f"{default.url}{path}", content=json.dumps(COMPLETION).encode())
        assert "content-type" not in request.headers
        error = _error(httpx.Client().send(request), 415)
        assert error["message"].startswith("no Content-Type: send the request body as JSON"), error


def test_the_content_type_is_refused_before_the_body_is_read(default: Server) -> None:
    """A text/plain request that announces a megabyte and sends none of it is answered at once."""
    with socket.create_connection(default.address, timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        head = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 415 "), head


# ------------------------------------------------------------------------------------------------ CORS
def _preflight(server: Server, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }  # fmt: skip
    return httpx.options(f"{server.url}/v1/completions", headers=headers)


def test_no_cors_headers_by_default(default: Server) -> None:
    response = httpx.get(f"{default.url}/v1/models", headers={"Origin": ALLOWED})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    response = _preflight(default, ALLOWED)
    assert "access-control-allow-origin" not in response.headers, response.headers
    assert response.status_code == 405, response.text
    assert response.headers.get("allow") == "POST", response.headers  # RFC 9110: a 405 names what is allowed
    response = httpx.get(f"{default.url}/v1/completions")
    assert response.status_code == 405 and response.headers.get("allow") == "POST", response.headers
    assert _error(response, 405)["type"] == "invalid_request_error"


def test_allowed_origins_get_cors_headers_and_others_none(servers: dict[str, Server]) -> None:
    server = servers["cors"]
    for origin in (ALLOWED, OTHER_ALLOWED):
        response = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin})
        assert response.headers.get("access-control-allow-origin") == origin, response.headers
        preflight = _preflight(server, origin)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers.get("access-control-allow-origin") == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"]
    response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers={"Origin": ALLOWED})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ALLOWED
    response = httpx.post(f"{server.url}/v1/completions", content=b"{}",
                          headers={"Origin": ALLOWED, "Content-Type": "text/plain"})  # fmt: skip
    assert response.status_code == 415 and response.headers["access-control-allow-origin"] == ALLOWED
    for origin in ("http://evil.example", "http://a.example:8080", "https://a.example"):
        response = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        assert "access-control-allow-origin" not in _preflight(server, origin).headers


# ------------------------------------------------------------------------------------------ Host names
def _with_host(server: Server, host: str, method: str, path: str) -> httpx.Response:
    """A request to `server` whose Host header says `host` (as a page reached by DNS rebinding sends)."""
    port = server.address[1]
    headers = {"Host": host.replace("PORT", str(port)), "Origin": f"http://{host.replace('PORT', str(port))}"}
    body = COMPLETION if method == "POST" else None
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize"])
def test_a_domain_in_the_host_header_gets_400_on_loopback(servers: dict[str, Server], path: str) -> None:
    """A loopback server answers to IP addresses and dotless names only, unless --allowed-hosts names a
    domain: what a page of attacker.example re-pointed at 127.0.0.1 sends is refused, on every route."""
    method = "GET" if path in ("/v1/models", "/health", "/metrics") else "POST"
    for server in servers.values():
        for host in ("attacker.example:PORT", "ATTACKER.example.", "127.0.0.1.nip.io:PORT", PROXIED_HOST):
            if server is servers["cors"] and host == PROXIED_HOST:
                continue
            error = _error(_with_host(server, host, method, path), 400)
            assert "--allowed-hosts" in error["message"] and "DNS rebinding" in error["message"], error
        for host in ("127.0.0.1:PORT", "localhost:PORT", "localhost", "[::1]:PORT", "app.localhost", "x"):
            response = _with_host(server, host, method, path)
            assert response.status_code == 200, (host, response.text)
    response = _with_host(servers["cors"], f"{PROXIED_HOST}:PORT", method, path)
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------------------- header timeout
def _assert_closed_within_bound(sock: socket.socket, since: float) -> None:
    sock.settimeout(HEADER_TIMEOUT_S + CLOSE_SLACK_S)
    assert sock.recv(65536) == b"", "the server answered instead of closing"
    elapsed = time.monotonic() - since
    # Not before the bound (with a little slack for the clocks), well within it plus the slack.
    assert HEADER_TIMEOUT_S - 0.2 <= elapsed <= HEADER_TIMEOUT_S + CLOSE_SLACK_S, elapsed


def test_a_silent_connection_is_closed_at_the_header_timeout(default: Server) -> None:
    with socket.create_connection(default.address, timeout=30) as sock:
        _assert_closed_within_bound(sock, time.monotonic())


def test_half_a_request_line_is_closed_at_the_header_timeout(default: Server) -> None:
    with socket.create_connection(default.address, timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /hea")
        _assert_closed_within_bound(sock, start)


def test_headers_after_a_kept_alive_response_are_timed_too(default: Server) -> None:
    """The bound runs again from the end of a response: a second request that never completes is cut."""
    with socket.create_connection(default.address, timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost")
        _assert_closed_within_bound(sock, start)


def _post_head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
    )


def test_a_body_that_stops_short_is_closed_at_the_bound(default: Server) -> None:
    """Headers in time, then fewer body bytes than the Content-Length, then silence: closed one bound after
    the last byte, and the server serves on."""
    body = json.dumps(COMPLETION).encode()
    with socket.create_connection(default.address, timeout=30) as sock:
        sock.sendall(_post_head(len(body)) + body[:10])
        start = time.monotonic()
        _assert_closed_within_bound(sock, start)
    assert httpx.get(f"{default.url}/health", timeout=30).status_code == 200


def test_a_body_that_keeps_arriving_is_served(default: Server) -> None:
    """The body's bound restarts with each byte: a body sent in pieces, each well inside the bound but the
    whole longer than it, is answered."""
    body = json.dumps(COMPLETION).encode()
    pieces = [body[i : i + len(body) // 4 + 1] for i in range(0, len(body), len(body) // 4 + 1)]
    with socket.create_connection(default.address, timeout=30) as sock:
        sock.sendall(_post_head(len(body)))
        for piece in pieces:
            time.sleep(HEADER_TIMEOUT_S / 3)
            sock.sendall(piece)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed before the response: {data!r}"
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]


# ------------------------------------------------------------------------------------- connection cap
def _open_stream(stack: contextlib.ExitStack, server: Server, max_tokens: int) -> Iterator[str]:
    """A streaming completion on a connection of its own, read up to its first event; the rest later."""
    client = stack.enter_context(httpx.Client(timeout=120))
    body = {**COMPLETION, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    response = stack.enter_context(client.stream("POST", f"{server.url}/v1/completions", json=body))
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return lines


def _finish(lines: Iterator[str]) -> tuple[str | None, str]:
    """The last finish_reason and the last event of a stream read to its end."""
    reason, last = None, ""
    for line in lines:
        if line.startswith("data: "):
            last = line[6:]
            if last != "[DONE]":
                reason = json.loads(last)["choices"][0]["finish_reason"] or reason
    return reason, last


def test_connections_past_the_cap_get_503_while_the_open_ones_go_on(servers: dict[str, Server]) -> None:
    """--max-connections 3: two streams and an idle connection are open; a fourth connection's request
    gets 503 (OpenAI's shape) and the connection is closed; the streams still finish, and the idle one
    still gets answers. Once the streams' connections close, new connections are taken again."""
    server = servers["capped"]
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with contextlib.ExitStack() as streams:
        first, second = (_open_stream(streams, server, 400) for _ in range(2))
        with socket.create_connection(server.address, timeout=30) as idle:
            with socket.create_connection(server.address, timeout=30) as extra:
                extra.sendall(request)
                reply = _read_to_close(extra)  # the server closes it after the answer
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower(), reply
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503, error
            assert "--max-connections 3" in error["message"]
            for lines in (first, second):
                assert _finish(lines) == ("length", "[DONE]")
            idle.sendall(request)
            assert _read_response(idle).startswith(b"HTTP/1.1 200 ")
    deadline = time.monotonic() + 30  # the streams' connections close as the clients go
    while (status := httpx.get(f"{server.url}/health").status_code) == 503:
        assert time.monotonic() < deadline, "new connections stayed refused"
        time.sleep(0.05)
    assert status == 200


# -------------------------------------------------------------------------- the engine after a Ctrl-C
def test_engine_closed_by_ctrl_c_says_so() -> None:
    """A KeyboardInterrupt in a step (raised where the driver sends it to the worker) closes the engine;
    the next call's EngineClosedError names the interrupt."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(MODEL, device="cpu", executor="multiprocess", max_model_len=256) as llm:
        assert len(llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        workers = llm.engine.executor.workers  # type: ignore[attr-defined]
        real_broadcast = workers.broadcast

        def broadcast(message: Any) -> None:
            real_broadcast(message)
            if isinstance(message, ExecuteModel):
                raise KeyboardInterrupt

        workers.broadcast = broadcast
        with pytest.raises(KeyboardInterrupt):
            llm.generate("Hello", params, use_tqdm=False)
        with pytest.raises(EngineClosedError, match=r"closed by a KeyboardInterrupt \(Ctrl-C\)") as info:
            llm.generate("Hello", params, use_tqdm=False)
        assert "create a new LLM" in str(info.value)
        assert all(p.poll() is not None for p in workers.procs), "a worker outlived the interrupt"


# ------------------------------------------------------------------------------------ the command line
def _serve_args(*argv: str) -> argparse.Namespace:
    parser = tp_cli.ArgumentParser(prog="serve")
    serve_cli.add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_takes_the_model_positionally() -> None:
    assert tp_cli.build_parser().parse_args(["serve", "tiny-llama", "-tp", "2"]).model == "tiny-llama"
    assert _serve_args("--port", "0", MODEL).model == MODEL
    assert _serve_args("--model", MODEL, MODEL).model == MODEL  # the same twice: fine
    assert _serve_args().model is None  # neither: the default model, as before
    serve_cli.check_serve(_serve_args(MODEL, "--model", MODEL, "--port", "0"))


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # --model first: argparse's error, at once
        _serve_args("--model", "tiny-llama", MODEL)
    assert exited.value.code == 2
    assert "'tiny-llama-tp' and as --model 'tiny-llama'; give one of them" in capsys.readouterr().err
    args = _serve_args(MODEL, "--model", "tiny-llama", "--port", "0")  # MODEL first: check_serve
    with pytest.raises(ConfigError, match=r"^argument MODEL: the model is given twice"):
        serve_cli.check_serve(args)


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--timeout-headers", "0", "must be more than 0 seconds"),
        ("--timeout-headers", "nan", "must be more than 0 seconds"),
        ("--max-connections", "0", "must be at least 1"),
        ("--allowed-origins", "http://a.example/", "is not an origin"),
        ("--allowed-origins", "a.example", "is not an origin"),
        ("--allowed-origins", '["http://a.example", 3]', "must hold strings only"),
        ("--allowed-origins", "[http://a.example]", "not a valid JSON list"),
        ("--allowed-origins", " , ", "names no origin"),
        ("--allowed-hosts", "http://a.example", "is not a host name"),
        ("--allowed-hosts", "a.example:8000", "is not a host name"),
        ("--allowed-hosts", '["a.example", null]', "must hold strings only"),
        ("--allowed-hosts", ",", "names no host"),
        ("--chat-template", "no-such-template.jinja", "no file 'no-such-template.jinja', and not a template"),
        ("--api-key", "secret\n", "holds a control character"),
        ("--api-key", " secret", "starts or ends with a space"),
        ("--api-key", "sec\rret", "holds a control character"),
        ("--chat-template", "{% for m in messages %}{{ m.content }}", "not a valid Jinja template (line 1"),
    ],
)
def test_bad_server_flags_are_named(flag: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=rf"^argument {flag}: .*{re.escape(expected)}"):
        serve_cli.check_serve(_serve_args(flag, value, "--port", "0"))


def test_allowed_origins_take_json_or_commas() -> None:
    args = _serve_args("--allowed-origins", '["http://a.example", "https://b.example:8443"]', "--port", "0")
    serve_cli.check_serve(args)
    assert args.allowed_origins == ["http://a.example", "https://b.example:8443"]
    args = _serve_args("--allowed-origins", "http://a.example, http://localhost:3000", "--port", "0")
    serve_cli.check_serve(args)
    assert args.allowed_origins == ["http://a.example", "http://localhost:3000"]
    args = _serve_args("--port", "0")
    serve_cli.check_serve(args)
    assert args.allowed_origins is None


def test_allowed_hosts_by_listening_address() -> None:
    """Loopback: dotless names, addresses and --allowed-hosts only; elsewhere any, unless the flag names
    them."""
    from tp_runtime.server.runner import host_names_taken

    args = _serve_args("--allowed-hosts", '["a.example", "b.example."]', "--port", "0")
    serve_cli.check_serve(args)
    assert args.allowed_hosts == ["a.example", "b.example."]
    assert host_names_taken("127.0.0.1", None) == [] and host_names_taken("::1", None) == []
    assert host_names_taken("0.0.0.0", None) is None and host_names_taken("192.168.1.5", None) is None
    assert host_names_taken("127.0.0.1", ["a.example"]) == ["a.example"]
    assert host_names_taken("0.0.0.0", ["a.example"]) == ["a.example"]
    assert host_names_taken("127.0.0.1", ["*"]) is None


def test_chat_template_takes_a_file_or_the_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    for value in (str(path), template):
        args = _serve_args("--chat-template", value, "--port", "0")
        serve_cli.check_serve(args)
        assert args.chat_template == template
    # Longer than a file name may be, with transformers' loop controls.
    long = "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}" + "{{ m.content }}" * 30
    long += "{% endfor %}"
    args = _serve_args("--chat-template", long, "--port", "0")
    serve_cli.check_serve(args)
    assert args.chat_template == long
    # Inline, its escapes are read as vLLM reads them (a shell passes "\n" as two characters); a file's
    # text is taken as it is, and characters past ASCII stay as given either way.
    inline = "{% for m in messages %}{{ m.content }}\\n{% endfor %}{{ 'é中😀' }}\\t"
    args = _serve_args("--chat-template", inline, "--port", "0")
    serve_cli.check_serve(args)
    assert args.chat_template == "{% for m in messages %}{{ m.content }}\n{% endfor %}{{ 'é中😀' }}\t"
    path.write_text(inline)
    args = _serve_args("--chat-template", str(path), "--port", "0")
    serve_cli.check_serve(args)
    assert args.chat_template == inline


def test_a_port_in_use_is_refused_by_the_checks() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            serve_cli.check_serve(_serve_args("--host", "127.0.0.1", "--port", str(port)))
        assert str(info.value).startswith(f"argument --port: port {port} on 127.0.0.1 is already in use; ")
        # The check itself imports nothing heavy (torch is not loaded by it).
        script = (
            "import sys; from tp_runtime import cli; from tp_runtime.server import cli as s\n"
            "p = cli.ArgumentParser(prog='x'); s.add_serve_arguments(p)\n"
            f"try: s.check_serve(p.parse_args(['--port', '{port}']))\n"
            "except Exception as exc: print(exc)\n"
            "print('torch loaded:', 'torch' in sys.modules)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
        ).stdout
        assert f"port {port} on 127.0.0.1 is already in use" in out and "torch loaded: False" in out, out
    serve_cli.check_serve(_serve_args("--port", str(port)))  # free again
    serve_cli.check_serve(_serve_args("--port", "0"))  # any free port: not tried


def test_the_open_file_limit_makes_room_for_the_connection_cap() -> None:
    """A soft limit below --max-connections (plus the server's own descriptors) is raised up to the hard
    limit; one the hard limit keeps too low is a warning."""
    code = (
        "import resource\n"
        "from tp_runtime.server.runner import _room_for_connections\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 1500))\n"
        "_room_for_connections(1024)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "_room_for_connections(4000)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["(1280, 1500)", "(1500, 1500)"], proc.stdout
    assert "open-file limit 1500 (ulimit -n) is below --max-connections 4000" in proc.stderr
