"""A scoring server for reward terms, speaking http_protocol.py: POST /v1/score/<name> for each
served term, GET /v1/health. One request is scored at a time (a lock around the terms, which
hold models and may not be thread-safe); the others wait while their bodies are read.

Requests are not logged; each error answer is one line through `log`."""
from __future__ import annotations

import json
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import numpy as np
import torch

from hpcnft.common.errors import first_line
from hpcnft.rewards.http_protocol import (CONTENT_TYPE, HEALTH_PATH, MAX_BODY_BYTES, SCORE_PREFIX, ProtocolError,
                                          decode_request, encode_scores, error_body)

BODY_TIMEOUT_S = 120.0  # a client that stops sending mid-body releases its thread after this


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class ScoringServer(ThreadingHTTPServer):
    """Serves `terms` (name -> term) on `address` ((host, port); port 0 picks a free one)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], terms: dict, log=stderr_line):
        self.terms, self.log = dict(terms), log
        self.score_lock = threading.Lock()
        super().__init__(address, ScoreHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def score(self, name: str, prompts: list[str], images: np.ndarray) -> bytes:
        with self.score_lock:
            scores = self.terms[name](prompts, images)
        scores = torch.as_tensor(scores).detach().to(torch.float32).cpu().numpy()
        if scores.shape != (len(images),):
            raise ProtocolError(f"term {name!r} returned scores of shape {list(scores.shape)} for {len(images)} images")
        return encode_scores(scores)

    def handle_error(self, request, client_address) -> None:
        # The client went away mid-answer (it timed out, say): one line, not a traceback.
        self.log(f"reward server: connection from {client_address[0]}: {first_line(sys.exc_info()[1])}")


class ScoreHandler(BaseHTTPRequestHandler):
    server: ScoringServer
    timeout = BODY_TIMEOUT_S

    def log_message(self, format: str, *args) -> None:
        pass  # no line per request; _error logs each error answer

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, text: str) -> None:
        what = f"{self.command} {self.path}" if self.command else "a malformed request"
        self.server.log(f"reward server: {what}: {int(status)} {text}")
        self._answer(status, error_body(text))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, unknown method) as JSON too."""
        self.close_connection = True
        self._error(code, message or HTTPStatus(code).phrase)

    def do_GET(self) -> None:
        if urlsplit(self.path).path != HEALTH_PATH:
            return self._error(HTTPStatus.NOT_FOUND, f"no such path (GET {HEALTH_PATH})")
        self._answer(HTTPStatus.OK, json.dumps({"terms": list(self.server.terms)}).encode())

    def do_POST(self) -> None:
        # The body is read before anything else is looked at: closing a connection with unread
        # data resets it, and the client would see a reset instead of the answer.
        body = self._read_body()
        if body is None:
            return
        path = urlsplit(self.path).path
        name = path[len(SCORE_PREFIX):] if path.startswith(SCORE_PREFIX) else None
        if name is None:
            return self._error(HTTPStatus.NOT_FOUND, f"no such path (POST {SCORE_PREFIX}<term>)")
        if name not in self.server.terms:
            return self._error(HTTPStatus.NOT_FOUND, f"no term {name!r} here (serving "
                                                     f"{', '.join(self.server.terms)})")
        if self.headers.get_content_type() != CONTENT_TYPE:
            return self._error(HTTPStatus.BAD_REQUEST, f"Content-Type must be {CONTENT_TYPE}, "
                                                       f"got {self.headers.get('Content-Type')!r}")
        try:
            prompts, images = decode_request(body)
        except ProtocolError as e:
            return self._error(HTTPStatus.BAD_REQUEST, str(e))
        try:
            answer = self.server.score(name, prompts, images)
        except Exception as e:  # noqa: BLE001 - the client gets the reason, the server serves on
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                               f"term {name!r} failed: {type(e).__name__}: {first_line(e)}")
        self._answer(HTTPStatus.OK, answer)

    def _read_body(self) -> bytes | None:
        """The request's body, or None after answering why not."""
        if self.headers.get("Transfer-Encoding"):
            self._error(HTTPStatus.BAD_REQUEST, "send the body with a Content-Length, not chunked")
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0:
            self._error(HTTPStatus.BAD_REQUEST, "a Content-Length is required")
            return None
        if length > MAX_BODY_BYTES:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes is more than "
                                                             f"{MAX_BODY_BYTES} bytes")
            return None
        body = self.rfile.read(length)
        if len(body) != length:
            self._error(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
            return None
        return body


def serve_in_thread(server: ThreadingHTTPServer, poll_interval: float = 0.05) -> threading.Thread:
    """Serve until server.shutdown(), in a daemon thread; shutdown() waits up to `poll_interval`."""
    thread = threading.Thread(target=server.serve_forever, args=(poll_interval,), name="hpcnft-reward-server",
                              daemon=True)
    thread.start()
    return thread
