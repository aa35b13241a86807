"""What uvicorn's HTTP/1.1 protocol (h11) lacks for a server facing clients it does not trust: a bound on
how long a request's headers may take to arrive, and a cap on open connections.

- Header timeout. uvicorn arms no timer while it waits for a request's headers: its only one,
  timeout_keep_alive, is armed once a response is complete and disarmed by the next byte that arrives, so
  a connection that sends nothing, or half a request line, stays open for good (and holds a file
  descriptor). Here a timer of `timeout_headers` seconds runs from the moment the connection is made,
  and again from the end of each response on a kept-alive connection, until the request's headers are
  complete; when it fires, the connection is closed. The same bound then holds between the body's bytes:
  a request whose body stops arriving (fewer bytes than its Content-Length, or a chunked body never
  ended) for `timeout_headers` seconds is closed too, unless the server is the one waiting (it has paused
  reading, or not yet answered an `Expect: 100-continue`).
- Connection cap. uvicorn's limit_concurrency counts every open connection, the one asking included, on
  each request: at the limit, the next request of a connection already open gets 503 too. Here the
  decision is made once per connection, when it is made: past `max_connections` (counting those admitted)
  it is refused, and its first request gets a 503 in OpenAI's error shape and `Connection: close`
  (answered on the request, not at once: a response written before the request is read could be cut off
  by a reset). The connections already admitted, and their streams, go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tp_runtime.server.openai_format import error_body
from tp_runtime.server.protocol import ErrorInfo


def _over_capacity(limit: int) -> Any:
    """The ASGI app a refused connection's request gets: 503 in OpenAI's shape, then the close."""
    message = f"the server has too many open connections (--max-connections {limit}); retry later"
    info = ErrorInfo(message=message, type="server_error", code=503)
    body = json.dumps(error_body(info), separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the header timeout and the connection cap (see the module's doc); the
    class attributes are set by `guarded_protocol`."""

    timeout_headers: float = 5.0
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_waits_for: object | None = None  # IDLE (headers) or SEND_BODY
        self._last_bytes_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.max_connections
        if limit is not None:
            admitted = sum(not getattr(c, "refused", False) for c in self.connections)
            if admitted >= limit:
                self.refused = True
                self.app = _over_capacity(limit)
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        self._last_bytes_at = self.loop.time()
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for(self) -> object | None:
        """IDLE: no part of a request parsed yet, or only part of its request line and headers; SEND_BODY:
        the headers are in, the body is not; None: nothing is awaited from the client."""
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            return None
        return state

    def _watch(self) -> None:
        """Arm the timer when a wait for headers or body begins (the headers' bound runs on while bytes
        trickle in, the body's restarts with each byte: see _late); disarm it once nothing is awaited."""
        waiting = self._waiting_for()
        if waiting is not self._timer_waits_for:
            self._disarm()
        if waiting is not None and self._timer is None:
            self._timer = self.loop.call_later(self.timeout_headers, self._late)
            self._timer_waits_for = waiting

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_waits_for = None

    def _server_holds_the_body(self) -> bool:
        cycle = self.cycle
        return self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)

    def _late(self) -> None:
        waited_for, self._timer, self._timer_waits_for = self._timer_waits_for, None, None
        waiting = self._waiting_for()
        if waiting is None or waiting is not waited_for:
            self._watch()
            return
        if waiting is h11.SEND_BODY:
            quiet = self.loop.time() - self._last_bytes_at
            if self._server_holds_the_body() or quiet < self.timeout_headers:
                wait = self.timeout_headers if self._server_holds_the_body() else self.timeout_headers - quiet
                self._timer = self.loop.call_later(wait, self._late)
                self._timer_waits_for = waiting
                return
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def guarded_protocol(timeout_headers: float, max_connections: int | None) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...): headers within `timeout_headers` seconds, at
    most `max_connections` open connections (None: no cap)."""

    class Configured(GuardedH11Protocol):
        pass

    Configured.timeout_headers = timeout_headers
    Configured.max_connections = max_connections
    return Configured
