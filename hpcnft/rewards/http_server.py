"""A scoring server for reward terms, speaking http_protocol.py: POST /v1/score/<name> for each
served term, GET /v1/health. One request is scored at a time (a lock around the terms, which
hold models and may not be thread-safe).

With a shared secret (`token`), every request must carry it (`Authorization: Bearer <token>`,
shared_secret.py), health checks included; one without it, or with another, is answered 401
(`WWW-Authenticate: Bearer`) before anything else is looked at, its body dropped unread.

What clients may cost the server is bounded:
- a POST's path, term, Content-Type and Content-Length are checked before any of its body is
  read; a refused one is answered at once (`Connection: close`) and its body then read and
  dropped 64 KiB at a time, so that the client sees the answer rather than a reset;
- at most `max_requests` requests are admitted at once, and their bodies (Content-Length) add up
  to at most `body_budget_bytes`; a request that does not fit within `busy_wait_s` is answered
  503 with Retry-After, one larger than the whole budget 413. While its body is decoded a request
  holds about twice its body (the body and its arrays);
- one connection is one request (HTTP/1.0), whose request line, headers and body must all
  arrive within `request_deadline_s`; past it the connection is closed, with one line logged;
- at most `max_connections` connections are open at once (a thread each); one beyond is
  answered 503 with Retry-After by the accepting thread and closed, without a thread;
- the listen backlog is 128, so a burst of clients waits to be accepted rather than being reset.

Requests are not logged; each error answer is one line through `log`, with what the client
sent escaped (printable ASCII only) and cut short."""
from __future__ import annotations

import io
import json
import math
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import numpy as np
import torch

from hpcnft.common.errors import first_line
from hpcnft.common.term_warnings import collected
from hpcnft.rewards.http_protocol import (CONTENT_TYPE, HEALTH_PATH, MAX_BODY_BYTES, SCORE_PREFIX, ProtocolError,
                                          decode_request, encode_scores, error_body)
from hpcnft.rewards.shared_secret import MISSING, authorization

MAX_REQUESTS = 8
MAX_CONNECTIONS = 64
BODY_BUDGET_BYTES = 2 << 30
REQUEST_DEADLINE_S = 120.0
BUSY_WAIT_S = 1.0
RETRY_AFTER_S = 1
DISCARD_CHUNK = 64 << 10
LOG_FIELD_CHARS = 200  # of a request's method and path in a log line
LOG_TEXT_CHARS = 500  # of an error's text in a log line


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def printable(text: str, limit: int = LOG_FIELD_CHARS) -> str:
    """`text` with everything but printable ASCII escaped (\\x1b, \\n, \\\\, \\u2028, ...) and cut
    to `limit` characters: what a client sent reaches a terminal or a log as data, never as codes."""
    shown, size = [], 0
    for char in text[:limit]:
        escaped = char.encode("unicode_escape").decode("ascii")
        if size + len(escaped) > limit:
            break
        shown.append(escaped)
        size += len(escaped)
    return "".join(shown) if len(shown) == len(text) else f"{''.join(shown)}... ({len(text)} characters)"


class DeadlinePassed(Exception):
    """A request's deadline passed before its request line, headers and body had arrived."""


class DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting only for what is left of one deadline: a client sending a
    byte now and then holds its connection no longer than the deadline in all."""

    def __init__(self, sock: socket.socket, deadline: float, write_timeout_s: float):
        self.sock, self.deadline, self.write_timeout_s = sock, deadline, write_timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise DeadlinePassed from None
        finally:
            self.sock.settimeout(self.write_timeout_s)


class Refused(Exception):
    """A request refused on its head: the status, one line of why and the answer's extra headers."""

    def __init__(self, status: int, text: str, headers: dict | None = None):
        super().__init__(text)
        self.status, self.text, self.headers = status, text, headers


def unauthorized(why: str) -> Refused:
    """The 401 of a request without the token (MISSING) or with another (REFUSED): never the token."""
    if why == MISSING:
        return Refused(HTTPStatus.UNAUTHORIZED, "a shared secret is required: send Authorization: Bearer <token>",
                       {"WWW-Authenticate": "Bearer"})
    return Refused(HTTPStatus.UNAUTHORIZED, "the token was refused",
                   {"WWW-Authenticate": 'Bearer error="invalid_token"'})


class Admission:
    """At most `max_requests` requests at once, holding at most `max_bytes` of bodies together."""

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = self.bytes = self.waiting = 0
        self.changed = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        return self.requests < self.max_requests and self.bytes + nbytes <= self.max_bytes

    def enter(self, nbytes: int, wait_s: float) -> bool:
        """Take a place and reserve `nbytes`, waiting up to `wait_s` for them; False if they never fit."""
        with self.changed:
            self.waiting += 1
            try:
                if not self.changed.wait_for(lambda: self._fits(nbytes), timeout=wait_s):
                    return False
            finally:
                self.waiting -= 1
            self.requests += 1
            self.bytes += nbytes
            return True

    def leave(self, nbytes: int) -> None:
        with self.changed:
            self.requests -= 1
            self.bytes -= nbytes
            self.changed.notify_all()


def check_limits(max_requests: int, max_connections: int, body_budget_bytes: int, request_deadline_s: float,
                 busy_wait_s: float) -> None:
    if max_requests < 1:
        raise ValueError(f"max_requests must be at least 1, got {max_requests}")
    if max_connections < max_requests:
        raise ValueError(f"max_connections must be at least max_requests ({max_requests}), got {max_connections}")
    if body_budget_bytes < 1:
        raise ValueError(f"body_budget_bytes must be at least 1, got {body_budget_bytes}")
    if not (math.isfinite(request_deadline_s) and request_deadline_s > 0):
        raise ValueError(f"request_deadline_s must be a positive number of seconds, got {request_deadline_s}")
    if not (math.isfinite(busy_wait_s) and busy_wait_s >= 0):
        raise ValueError(f"busy_wait_s must be a number of seconds >= 0, got {busy_wait_s}")


class ScoringServer(ThreadingHTTPServer):
    """Serves `terms` (name -> term) on `address` ((host, port); port 0 picks a free one), within
    the limits above; to clients sending `token` alone where one is given."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 resets the clients beyond a handful arriving together

    def __init__(self, address: tuple[str, int], terms: dict, log=stderr_line, *, max_requests: int = MAX_REQUESTS,
                 max_connections: int = MAX_CONNECTIONS, body_budget_bytes: int = BODY_BUDGET_BYTES,
                 request_deadline_s: float = REQUEST_DEADLINE_S, busy_wait_s: float = BUSY_WAIT_S,
                 token: str | None = None):
        check_limits(max_requests, max_connections, body_budget_bytes, request_deadline_s, busy_wait_s)
        self.terms, self.log = dict(terms), log
        self.token = token.encode("ascii") if token else None
        self.max_connections, self.connections = max_connections, 0
        self.connections_lock = threading.Lock()
        self.request_deadline_s, self.busy_wait_s = request_deadline_s, busy_wait_s
        self.max_request_bytes = min(MAX_BODY_BYTES, body_budget_bytes)
        self.admission = Admission(max_requests, body_budget_bytes)
        self.score_lock = threading.Lock()
        super().__init__(address, ScoreHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def process_request(self, request, client_address) -> None:
        """A thread for the connection while fewer than max_connections are open; else a 503 from
        here (a short answer fits the socket's send buffer) and the connection closed."""
        with self.connections_lock:
            admitted = self.connections < self.max_connections
            self.connections += admitted
        if admitted:
            return super().process_request(request, client_address)
        self.log(f"reward server: connection from {client_address[0]}: 503 more than {self.max_connections} "
                 "connections open; closed")
        try:
            request.settimeout(0)
            request.send(turn_away_answer(self.max_connections))
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.connections_lock:
                self.connections -= 1

    def health(self) -> dict:
        """What GET /v1/health answers: the terms served and the load at this moment."""
        admission = self.admission
        with admission.changed:
            load = {"requests": admission.requests, "waiting": admission.waiting, "body_bytes": admission.bytes}
        return {"terms": list(self.terms), **load, "connections": self.connections}

    def score(self, name: str, prompts: list[str], images: np.ndarray) -> bytes:
        with self.score_lock, collected() as found:
            scores = self.terms[name](prompts, images)
        for text in found:  # the client gets the scores; the warnings are the server's to say
            self.log(f"reward server: warning: {printable(text, LOG_TEXT_CHARS)}")
        scores = torch.as_tensor(scores).detach().to(torch.float32).cpu().numpy()
        if scores.shape != (len(images),):
            raise ProtocolError(f"term {name!r} returned scores of shape {list(scores.shape)} for {len(images)} images")
        return encode_scores(scores)

    def handle_error(self, request, client_address) -> None:
        # The client went away mid-answer (it timed out, say): one line, not a traceback.
        reason = printable(first_line(sys.exc_info()[1]), LOG_TEXT_CHARS)
        self.log(f"reward server: connection from {client_address[0]}: {reason}")


def turn_away_answer(max_connections: int) -> bytes:
    body = error_body(f"busy (more than {max_connections} connections open); retry after {RETRY_AFTER_S} s")
    return (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
            ).encode("ascii") + body


class ScoreHandler(BaseHTTPRequestHandler):
    server: ScoringServer

    def setup(self) -> None:
        self.timeout = self.server.request_deadline_s  # bounds each write; the reads share one deadline
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + self.server.request_deadline_s
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, deadline, self.timeout))

    def handle(self) -> None:
        try:
            super().handle()
        except DeadlinePassed:
            self.close_connection = True
            self.server.log(f"reward server: connection from {self.client_address[0]}: request deadline of "
                            f"{self.server.request_deadline_s:g} s passed; closed")

    def log_message(self, format: str, *args) -> None:
        pass  # no line per request; _error logs each error answer

    def _answer(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # one request per connection
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, text: str, headers: dict | None = None) -> None:
        what = f"{printable(self.command)} {printable(self.path)}" if self.command else "a malformed request"
        self.server.log(f"reward server: {what}: {int(status)} {printable(text, LOG_TEXT_CHARS)}")
        self._answer(status, error_body(text), headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, unknown method) as JSON too."""
        self.close_connection = True
        self._error(code, message or HTTPStatus(code).phrase)

    def _check_token(self) -> None:
        """Refused (401) unless the request carries the server's token, where it has one."""
        if self.server.token is not None:
            why = authorization(self.headers.get_all("Authorization") or [], self.server.token)
            if why is not None:
                raise unauthorized(why)

    def do_GET(self) -> None:
        try:
            self._check_token()
        except Refused as e:
            return self._refuse(e.status, e.text, e.headers)
        if urlsplit(self.path).path != HEALTH_PATH:
            return self._error(HTTPStatus.NOT_FOUND, f"no such path (GET {HEALTH_PATH})")
        self._answer(HTTPStatus.OK, json.dumps(self.server.health()).encode())

    def do_POST(self) -> None:
        try:
            name, length = self._check_head()
        except Refused as e:
            return self._refuse(e.status, e.text, e.headers)
        if not self.server.admission.enter(length, self.server.busy_wait_s):
            admission = self.server.admission
            return self._refuse(HTTPStatus.SERVICE_UNAVAILABLE,
                                f"busy (at most {admission.max_requests} requests, {admission.max_bytes} bytes "
                                f"of bodies at once); retry after {RETRY_AFTER_S} s",
                                {"Retry-After": str(RETRY_AFTER_S)})
        try:
            self._score_request(name, length)
        finally:
            self.server.admission.leave(length)

    def _term_name(self) -> str | None:
        path = urlsplit(self.path).path
        return path[len(SCORE_PREFIX):] if path.startswith(SCORE_PREFIX) else None

    def _content_length(self) -> int | None:
        """The declared length of the body; None if there is none (or it is chunked)."""
        text = (self.headers.get("Content-Length") or "").strip()
        if self.headers.get("Transfer-Encoding") or not (text.isascii() and text.isdigit()):
            return None
        return int(text)

    def _check_head(self) -> tuple[str, int]:
        """The term and body length of this POST, from its head alone; Refused if it is refused.
        The token first: a client without it learns nothing, not even the terms served."""
        self._check_token()
        if self.headers.get("Transfer-Encoding"):
            raise Refused(HTTPStatus.BAD_REQUEST, "send the body with a Content-Length, not chunked")
        name = self._term_name()
        if name is None:
            raise Refused(HTTPStatus.NOT_FOUND, f"no such path (POST {SCORE_PREFIX}<term>)")
        if name not in self.server.terms:
            raise Refused(HTTPStatus.NOT_FOUND, f"no term {name!r} here (serving {', '.join(self.server.terms)})")
        if self.headers.get_content_type() != CONTENT_TYPE:
            raise Refused(HTTPStatus.BAD_REQUEST, f"Content-Type must be {CONTENT_TYPE}, "
                                                  f"got {self.headers.get('Content-Type')!r}")
        length = self._content_length()
        if length is None:
            raise Refused(HTTPStatus.BAD_REQUEST, "a Content-Length is required")
        if length > self.server.max_request_bytes:
            raise Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes is more than "
                                                               f"{self.server.max_request_bytes} bytes")
        return name, length

    def _refuse(self, status: int, text: str, headers: dict | None = None) -> None:
        """Answer without reading the body, then read and drop it: closing a connection with
        unread data resets it, and the client would see the reset instead of the answer."""
        self._error(status, text, headers)
        self._discard(self._body_left())

    def _body_left(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            return MAX_BODY_BYTES  # chunked: whatever comes until the client closes, within the deadline
        return self._content_length() or 0

    def _discard(self, nbytes: int) -> None:
        while nbytes > 0:
            chunk = self.rfile.read1(min(DISCARD_CHUNK, nbytes))
            if not chunk:
                return
            nbytes -= len(chunk)

    def _score_request(self, name: str, length: int) -> None:
        request = self._read_request(length)
        if request is None:
            return
        try:
            answer = self.server.score(name, *request)
        except Exception as e:  # noqa: BLE001 - the client gets the reason, the server serves on
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                               f"term {name!r} failed: {type(e).__name__}: {first_line(e)}")
        self._answer(HTTPStatus.OK, answer)

    def _read_request(self, length: int) -> tuple[list[str], np.ndarray] | None:
        """(prompts, images) from the body, or None after answering why not. The body is dropped
        on return: the request waits to be scored holding its arrays only."""
        body = self.rfile.read(length)
        if len(body) != length:
            self._error(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
            return None
        try:
            return decode_request(body)
        except ProtocolError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return None


def serve_in_thread(server: ThreadingHTTPServer, poll_interval: float = 0.05) -> threading.Thread:
    """Serve until server.shutdown(), in a daemon thread; shutdown() waits up to `poll_interval`."""
    thread = threading.Thread(target=server.serve_forever, args=(poll_interval,), name="hpcnft-reward-server",
                              daemon=True)
    thread.start()
    return thread
