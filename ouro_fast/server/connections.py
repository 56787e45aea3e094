"""Connection bounds: a cap on open connections and per-phase deadlines that bytes do not extend.

Sanic's own REQUEST_TIMEOUT restarts with every byte received, so a client that trickles one
byte every few seconds holds its connection forever. BoundedHttpProtocol replaces Sanic's
timeout check with deadlines fixed when a phase starts:

- header: the request line and headers complete within `header_timeout` of the connection's
  start (first request) or of the request's first byte (later requests on a kept-alive one);
- body: the whole body arrives within `body_timeout` of the end of the headers;
- idle: a kept-alive connection waits at most `keep_alive_timeout` for its next request.

A running request has no deadline here: its queue wait is the engine's (queue_timeout), and a
stream that its client stops reading is cut by the stream buffer. A connection beyond
`max_connections` is answered 503 and closed in connection_made, before any task or buffer.
BoundedSanic makes this protocol the default of every launcher (`ouro-fast serve`, `sanic`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from time import monotonic

from sanic import Sanic
from sanic.exceptions import RequestTimeout
from sanic.http import Http, Stage
from sanic.server.protocols.http_protocol import HttpProtocol

# The longest a connection goes unchecked: phases change between checks, deadlines never move.
_MAX_CHECK_INTERVAL_S = 1.0
# How long a connection past its deadline may take to send its 408 before it is aborted.
_CLOSE_GRACE_S = 1.0
_REFUSAL_BODY = (
    b'{"error":{"message":"the server has too many open connections; retry later",'
    b'"type":"server_error","param":null,"code":"too_many_connections"}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)
# File descriptors kept beyond the connection cap: the model's files, logs, the listening socket.
_FD_RESERVE = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds every connection of the server is held to (seconds, and a count)."""

    max_connections: int
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float


class _TimedHttp(Http):
    """Sanic's HTTP/1.1 cycle, telling its protocol when a request starts and when its head is in."""

    __slots__ = ()

    def init_for_request(self):
        super().init_for_request()
        self.protocol.request_starts()

    async def http1_request_header(self):
        await super().http1_request_header()
        self.protocol.head_received()


class BoundedHttpProtocol(HttpProtocol):
    """HttpProtocol with the connection cap and fixed header, body and keep-alive deadlines."""

    HTTP_CLASS = _TimedHttp
    __slots__ = ("limits", "refused", "expired", "served", "head_start", "body_start", "idle_since")

    def connection_made(self, transport):
        limits = self.app.ctx.connection_limits  # set before the server listens
        self.limits, self.refused, self.expired, self.served = limits, False, False, 0
        now = monotonic()
        # A fresh connection's header clock runs from its start: connecting and sending nothing counts.
        self.head_start, self.body_start, self.idle_since = now, None, now
        if len(self.connections) >= limits.max_connections:
            self.refused = True
            _closed(self.app, "limit")
            transport.write(_REFUSAL)
            transport.close()  # no task, no buffer: connection_lost only has to forget it
            return
        super().connection_made(transport)

    def connection_lost(self, exc):
        if not self.refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes):
        if self.head_start is None:
            self.head_start = monotonic()  # the first byte of a request on a kept-alive connection
        super().data_received(data)

    def request_starts(self) -> None:
        """Http's loop begins a request: after the first, the connection idles until a byte arrives."""
        if self.served:
            self.idle_since = monotonic()
            self.head_start = self.idle_since if self.recv_buffer else None
        self.served += 1
        self.body_start = None

    def head_received(self) -> None:
        self.body_start = monotonic()

    def deadline(self) -> tuple[float | None, str]:
        """When the current phase must end, and its name; None while a request is being handled."""
        http, limits = self._http, self.limits
        stage = http.stage
        if stage is Stage.IDLE or stage is Stage.REQUEST:
            if self.head_start is not None:
                return self.head_start + limits.header_timeout, "header_timeout"
            return self.idle_since + limits.keep_alive_timeout, "idle"
        if stage is Stage.HANDLER and http.request_body and self.body_start is not None:
            return self.body_start + limits.body_timeout, "body_timeout"
        return None, ""

    def check_timeouts(self):
        """Sanic's periodic check, with deadlines that received bytes do not move."""
        if not self._task or self._http is None:
            return
        if self.expired:
            self.abort()  # still open after its 408: Sanic drains a cut body with no deadline of its own
            return
        deadline, reason = self.deadline()
        now = monotonic()
        if deadline is None or now < deadline:
            wait = _MAX_CHECK_INTERVAL_S if deadline is None else min(deadline - now, _MAX_CHECK_INTERVAL_S)
            self._callback_check_timeouts = self.loop.call_later(wait, self.check_timeouts)
            return
        self.expired = True
        _closed(self.app, reason)
        if reason != "idle":
            phase = "request headers" if reason == "header_timeout" else "request body"
            limit = self.limits.header_timeout if reason == "header_timeout" else self.limits.body_timeout
            # Answered 408 by Sanic's cancellation path, then closed.
            self._http.exception = RequestTimeout(f"the {phase} did not arrive within {limit:g} s")
        self._task.cancel()
        self._callback_check_timeouts = self.loop.call_later(_CLOSE_GRACE_S, self.check_timeouts)


def _closed(app: Sanic, reason: str) -> None:
    client = getattr(app.ctx, "client", None)
    if client is not None:
        client.metrics.connection_closed(reason)


class BoundedSanic(Sanic):
    """Sanic whose servers use BoundedHttpProtocol unless a launcher names another protocol."""

    def prepare(self, *args, protocol=None, **kwargs):
        super().prepare(*args, protocol=protocol or BoundedHttpProtocol, **kwargs)


def raise_open_files_limit(limits: ConnectionLimits) -> int:
    """Raise the soft open-files limit toward the cap plus a reserve (never past the hard limit);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limits.max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft
