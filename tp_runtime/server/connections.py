"""What uvicorn's HTTP/1.1 protocol (h11) lacks for a server facing clients it does not trust: a bound on
how long a request's headers may take to arrive, and a cap on open connections.

- Header timeout. uvicorn arms no timer while it waits for a request's headers: its only one,
  timeout_keep_alive, is armed once a response is complete and disarmed by the next byte that arrives, so
  a connection that sends nothing, or half a request line, stays open for good (and holds a file
  descriptor). Here a timer of `timeout_headers` seconds runs from the moment the connection is made,
  and again from the end of each response on a kept-alive connection, until the request's headers are
  complete; when it fires, the connection is closed.
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
        self._headers_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.max_connections
        if limit is not None:
            admitted = sum(not getattr(c, "refused", False) for c in self.connections)
            if admitted >= limit:
                self.refused = True
                self.app = _over_capacity(limit)
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        # IDLE: no part of a request parsed yet, or only part of its request line and headers.
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_headers(self) -> None:
        """Arm the timer when a wait for headers begins (kept running while bytes trickle in); disarm it
        once they are in (or the connection is closing)."""
        if not self._waiting_for_headers():
            self._disarm()
        elif self._headers_timer is None:
            self._headers_timer = self.loop.call_later(self.timeout_headers, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self._waiting_for_headers():
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
