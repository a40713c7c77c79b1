"""What the scoring server (http_server.py) reads and writes on the wire: a request's head parsed
and checked (the request line, the headers with the standard library's parser, one
Content-Length), refusals as status and one line, answers as bytes, and what a client sent made
safe for a log line. No sockets here."""
from __future__ import annotations

import http.client
import io
import json
from dataclasses import dataclass
from http import HTTPStatus

from hpcnft.rewards.shared_secret import MISSING

HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 64 << 10  # a request line and its headers; http.server allows a 64 KiB line
METHODS = ("GET", "POST")
VERSIONS = ("HTTP/1.0", "HTTP/1.1")
LOG_FIELD_CHARS = 200  # of a request's method and path in a log line
LOG_TEXT_CHARS = 500  # of an error's text in a log line


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


@dataclass
class Head:
    """A request's line and headers. `method` and `path` are as sent (for the log, escaped);
    `headers` is the standard library's parse of them (http.client.HTTPMessage)."""
    method: str
    path: str
    version: str
    headers: http.client.HTTPMessage | None = None

    def describe(self) -> str:
        return f"{printable(self.method)} {printable(self.path)}"


def parse_head(raw: bytes) -> Head:
    """The head of a request (its bytes up to and including the blank line). Refused for a
    malformed line (400), an HTTP version other than 1.0 or 1.1 (505), a method other than GET
    and POST (501) or headers the standard library's parser refuses (400); the Head it got so far
    rides on the Refused as `.head`, for the log."""
    line, _, rest = raw.partition(b"\r\n")
    words = line.decode("iso-8859-1").split()
    if len(words) != 3:
        refused = Refused(HTTPStatus.BAD_REQUEST, "malformed request line")
        refused.head = Head(" ".join(words)[:LOG_FIELD_CHARS] if words else "", "", "")
        raise refused
    head = Head(*words)
    if head.version not in VERSIONS:
        raise _with(Refused(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"HTTP version {printable(head.version)} "
                                                                    "(HTTP/1.0 or HTTP/1.1)"), head)
    if head.method not in METHODS:
        raise _with(Refused(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({printable(head.method)!r})"), head)
    try:
        head.headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException as e:
        raise _with(Refused(HTTPStatus.BAD_REQUEST, f"malformed headers ({printable(str(e), LOG_TEXT_CHARS)})"),
                    head) from None
    return head


def _with(refused: Refused, head: Head) -> Refused:
    refused.head = head
    return refused


def content_length(head: Head) -> int:
    """The body length a POST declares: exactly one Content-Length header of decimal digits, and
    no Transfer-Encoding (a request smuggled between two framings is refused, not guessed at)."""
    if head.headers.get("Transfer-Encoding") is not None:
        raise Refused(HTTPStatus.BAD_REQUEST, "send the body with a Content-Length, not chunked")
    values = head.headers.get_all("Content-Length") or []
    if not values:
        raise Refused(HTTPStatus.BAD_REQUEST, "a Content-Length is required")
    if len(values) > 1:
        raise Refused(HTTPStatus.BAD_REQUEST, f"{len(values)} Content-Length headers; send one")
    text = values[0].strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise Refused(HTTPStatus.BAD_REQUEST, f"Content-Length {printable(text)!r} is not a number of bytes")
    return int(text)


def answer(status: int, body: bytes, headers: dict | None = None) -> bytes:
    """A whole answer: one request per connection (HTTP/1.0, Connection: close)."""
    lines = [f"HTTP/1.0 {int(status)} {HTTPStatus(status).phrase}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{key}: {value}" for key, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_answer(status: int, payload) -> bytes:
    return answer(status, json.dumps(payload).encode())
