"""The server's connections, bounded: read deadlines, a cap on open connections, and an accept loop that survives
running out of file descriptors. uvicorn (HTTP/1.1 by h11, on asyncio) has none of these, so `nanoforge serve`
gives it a listening socket (`Listener`) and a protocol class (`GuardedProtocol`) of ours.

Deadlines are whole-phase, not per read: a request's headers must all arrive within `header_timeout` seconds of
the connection opening (of the last reply, on a kept-alive connection), and its body within `body_timeout` of the
headers, however steadily the bytes trickle in. A connection past either gets a 408 `request_timeout` and is
closed; one that has sent nothing at all is closed without a word (a browser's spare connection, not an attack).

The cap: up to `max_connections` connections are served as usual; the next HEALTH_RESERVE ones (the reserve) are
accepted too but answer only `GET /health` (anything else gets a 503 `server_busy`) and close after one reply, so
a full server can still say it is alive; past those, a new connection is closed as soon as it is accepted.

File descriptors: `connection_cap` lowers the cap to what the process's limit (`ulimit -n`) leaves room for, so
accept() does not normally run out. If it does anyway, accepting pauses for about a second (asyncio's retry,
triggered once per pause rather than once per waiting connection) while waiting connections queue in the kernel.

Every event here is logged in one line without a traceback, through serve/repeats.py's filter (one line per kind
per window, with a count)."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoforge.serve.protocol import APIError

HEALTH_RESERVE = 8  # connections beyond the cap that may still ask GET /health
FD_MARGIN = 32  # file descriptors kept free for what the process opens besides connections
REJECTS_PER_ACCEPT = 64  # connections closed at once per call of accept(), so other work runs between calls
RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
LATE = {"headers": "closed a connection whose request headers took over %g s (--header-timeout)",
        "body": "closed a connection whose request body took over %g s (--body-timeout)"}

log = logging.getLogger("nanoforge.serve")


@dataclass
class Gate:
    """What every connection of one server shares: the limits and the connections open now."""
    max_connections: int
    header_timeout: float
    body_timeout: float
    open: set = field(default_factory=set)  # GuardedProtocol instances, from connection_made to connection_lost
    # the file descriptors of connections accepted whose protocol is not made yet (asyncio makes them a loop
    # iteration or two later, after a whole burst may have been accepted); one left by a connection asyncio failed
    # to set up goes when its number is reused
    arriving: set = field(default_factory=set)
    paused_until: float = 0.0  # accept() refuses until then, after running out of file descriptors

    def full(self) -> bool:
        return len(self.open) + len(self.arriving) >= self.max_connections + HEALTH_RESERVE


class OutOfDescriptors(OSError):
    """accept() ran out of file descriptors (or kernel memory). Raised to asyncio, whose accept loop then stops
    listening for a second; already logged here, so the log filter drops asyncio's report of it."""


def connection_cap(requested: int) -> tuple[int, str | None]:
    """The connection cap this process can hold (`requested`, or less where `ulimit -n` leaves no room for it),
    and a note saying so when it is less."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested, None
    room = soft - _open_files() - FD_MARGIN - HEALTH_RESERVE
    if requested <= room:
        return requested, None
    cap = max(room, 1)
    return cap, (f"note: --max-connections {requested} lowered to {cap}: this process may have {soft} files open "
                 f"(ulimit -n), some already in use")


def _open_files() -> int:
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(listing))
        except OSError:
            continue
    return 64  # an estimate where the system does not list them


class Listener(socket.socket):
    """The listening socket. asyncio's accept loop calls its accept(), which closes connections past the cap at
    once and turns running out of file descriptors into one pause (see the module's doc)."""
    gate: Gate

    def accept(self):
        for _ in range(REJECTS_PER_ACCEPT):
            if time.monotonic() < self.gate.paused_until:
                raise BlockingIOError(errno.EAGAIN, "accepting paused")  # asyncio: nothing more to accept now
            try:
                conn, address = super().accept()
            except OSError as e:
                if e.errno not in RESOURCE_ERRORS:
                    raise
                # asyncio stops listening for ACCEPT_RETRY_DELAY (1 s) on this error; the pause is shorter, so
                # only the rest of asyncio's current accept loop is refused, not the retry
                self.gate.paused_until = time.monotonic() + 0.5
                log.warning("cannot accept more connections (%s): new ones wait until some close (%d open)",
                            os.strerror(e.errno), len(self.gate.open) + len(self.gate.arriving))
                raise OutOfDescriptors(e.errno, e.strerror) from None
            if not self.gate.full():
                self.gate.arriving.add(conn.fileno())
                return conn, address
            conn.close()
            _log_over_cap(self.gate)
        raise BlockingIOError(errno.EAGAIN, "enough refused for one call")


def _log_over_cap(gate: Gate) -> None:
    log.warning("over %d connections (--max-connections, and %d more for /health): new ones are closed at once",
                gate.max_connections, HEALTH_RESERVE)


def bind_listeners(host: str, port: int, gate: Gate) -> list[Listener]:
    """Listeners bound to (host, port), one per address the host names (as asyncio would bind them: "localhost"
    may be 127.0.0.1 and ::1), not yet listening (asyncio listens when the server starts, so until the model has
    loaded connections are refused rather than left waiting). OSError when one cannot be bound."""
    listeners: list[Listener] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = Listener(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.gate = gate
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


class GuardedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the deadlines and the cap's reserve (see the module's doc). uvicorn makes
    one per connection: `Config(http=functools.partial(GuardedProtocol, gate=gate))`."""

    def __init__(self, *args, gate: Gate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.deadline: asyncio.TimerHandle | None = None
        self.phase: type | None = None  # the h11 state the deadline is for: h11.IDLE (headers) or h11.SEND_BODY
        self.heard = False  # whether any byte came in since the header deadline was set
        self.timed_out = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.gate.arriving.discard(transport.get_extra_info("socket").fileno())
        if self.gate.full():  # one of a burst accepted in one go, before the first of them was counted
            _log_over_cap(self.gate)
            transport.close()
            return
        if len(self.gate.open) >= self.gate.max_connections:
            self.app = _health_only(self.app)
        self.gate.open.add(self)
        self._watch()

    def data_received(self, data: bytes) -> None:
        self.heard = True
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.open.discard(self)
        self._arm(None, 0)
        if (self.conn.their_state is h11.SEND_BODY and not self.timed_out and self.cycle is not None
                and not self.cycle.response_complete):
            log.warning("a client hung up before sending its whole request body (%s %s)",
                        self.scope["method"], self.scope["path"])
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Set the deadline of the phase the request is in: headers, body, or none (the reply is being made)."""
        state = self.conn.their_state
        if state is h11.IDLE and self.phase is not h11.IDLE:
            self.heard = False
            self._arm(h11.IDLE, self.gate.header_timeout)
        elif state is h11.SEND_BODY and self.phase is not h11.SEND_BODY:
            self._arm(h11.SEND_BODY, self.gate.body_timeout)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._arm(None, 0)

    def _arm(self, phase: type | None, seconds: float) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.phase, self.deadline = phase, None
        if phase is not None and seconds > 0:
            self.deadline = self.loop.call_later(seconds, self._expired)

    def _expired(self) -> None:
        phase, self.phase, self.deadline = self.phase, None, None
        if self.transport.is_closing() or self.conn.their_state is not phase:
            return
        if phase is h11.IDLE and not self.heard:
            self.transport.close()  # an idle connection: nothing to say, nothing to log
            return
        what, seconds = ("headers", self.gate.header_timeout) if phase is h11.IDLE else ("body", self.gate.body_timeout)
        log.warning(LATE[what], seconds)  # a template each: the log filter counts each kind apart
        self.timed_out = True
        if phase is h11.IDLE or not self.cycle.response_started:  # (a body is read only once the cycle began)
            self.transport.write(_raw_reply(APIError(
                408, f"the request {what} did not arrive within {seconds:g} s", code="request_timeout")))
        self.transport.close()


def _raw_reply(error: APIError) -> bytes:
    """An error reply written straight to the socket, before or instead of h11's (which will not answer a request
    whose headers have not arrived), closing the connection."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def _health_only(app):
    """The app as a reserve connection serves it: GET /health only, then the connection closes."""
    busy = JSONResponse(APIError(503, "the server has too many connections open; try again later",
                                 code="server_busy", type="server_error").body(), status_code=503)

    async def reserve(scope, receive, send):
        async def send_and_close(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/health":
            await app(scope, receive, send_and_close)
        else:
            await busy(scope, receive, send_and_close)
    return reserve
