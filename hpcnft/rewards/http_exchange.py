"""One connection of the scoring server (http_server.py), from its request's head to its answer:
the head within its deadline, the token, the checks on the head, a place and room for the body
(http_limits.Admission), the body at its pace, scoring, the answer; a refused body read and
dropped. One request per connection."""
from __future__ import annotations

import asyncio
import mmap
import time
from http import HTTPStatus
from urllib.parse import urlsplit

from hpcnft.common.errors import first_line
from hpcnft.rewards.http_limits import Busy, Connection
from hpcnft.rewards.http_protocol import CONTENT_TYPE, HEALTH_PATH, MAX_BODY_BYTES, SCORE_PREFIX, error_body
from hpcnft.rewards.http_wire import (HEAD_END, LOG_TEXT_CHARS, MAX_HEAD_BYTES, Head, Refused, answer, content_length,
                                      json_answer, parse_head, printable, unauthorized)
from hpcnft.rewards.shared_secret import authorization

RETRY_AFTER_S = 1
READ_BYTES = 1 << 20  # the most of a body taken from the connection's buffer at a time
WRITE_TIMEOUT_S = 10.0  # for an answer to leave



def not_here(method: str, path: str) -> str:
    """A 404's reason: what was asked, and the two things this server answers."""
    return f"no {method} {path[:80]} here: this server answers GET {HEALTH_PATH} and POST {SCORE_PREFIX}<term>"

class BodyTooSlow(Exception):
    """A body (or the rest of a refused one) did not keep pace: `got` bytes had come."""

    def __init__(self, got: int):
        super().__init__(got)
        self.got = got


class BadBody(ValueError):
    """A body that is not a request of the protocol (the reason: one line)."""


class Exchange:
    """`conn`'s request on `server` (a ScoringServer), read from `reader`, answered on `writer`."""

    def __init__(self, server, conn: Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.conn, self.reader, self.writer = server, conn, reader, writer
        self.head: Head | None = None

    async def run(self) -> None:
        server, conn = self.server, self.conn
        try:
            async with asyncio.timeout(server.head_deadline_s):
                raw = await self.reader.readuntil(HEAD_END)
        except TimeoutError:
            return server.log(f"reward server: connection from {conn.address}: no request within "
                              f"{server.head_deadline_s:g} s; closed")
        except asyncio.IncompleteReadError:
            return  # the client went away before its request was whole: nothing to answer
        except asyncio.LimitOverrunError:
            return await self.error(Refused(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                            f"a request line and headers over {MAX_HEAD_BYTES} bytes"))
        try:
            self.head = parse_head(raw)
        except Refused as e:
            self.head = e.head
            return await self.error(e)
        conn.evictable = False
        try:
            self.check_token()
            if self.head.method == "GET":
                return await self.get()
            name, length = self.check_post()
        except Refused as e:
            return await self.refuse(e, declared_length(self.head))
        await self.post(name, length)

    def check_token(self) -> None:
        """Refused (401) unless the request carries the server's token, where it has one."""
        if self.server.token is not None:
            why = authorization(self.head.headers.get_all("Authorization") or [], self.server.token)
            if why is not None:
                raise unauthorized(why)

    async def get(self) -> None:
        if urlsplit(self.head.path).path != HEALTH_PATH:
            return await self.error(Refused(HTTPStatus.NOT_FOUND, not_here("GET", self.head.path)))
        await self.send(json_answer(HTTPStatus.OK, self.server.health()))

    def check_post(self) -> tuple[str, int]:
        """The term and body length of this POST, from its head alone; Refused if it is refused."""
        terms, headers = self.server.terms, self.head.headers
        path = urlsplit(self.head.path).path
        if not path.startswith(SCORE_PREFIX):
            raise Refused(HTTPStatus.NOT_FOUND, not_here("POST", path))
        name = path[len(SCORE_PREFIX):]
        if name not in terms:
            raise Refused(HTTPStatus.NOT_FOUND, f"no term {name!r} here (serving {', '.join(terms)})")
        if headers.get_content_type() != CONTENT_TYPE:
            raise Refused(HTTPStatus.BAD_REQUEST, f"Content-Type must be {CONTENT_TYPE}, "
                                                  f"got {headers.get('Content-Type')!r}")
        length = content_length(self.head)
        if length > self.server.max_request_bytes:
            raise Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes is more than "
                                                               f"{self.server.max_request_bytes} bytes")
        return name, length

    def busy(self) -> Refused:
        admission = self.server.admission
        return Refused(HTTPStatus.SERVICE_UNAVAILABLE, f"busy (at most {admission.max_requests} requests, "
                                                       f"{admission.max_bytes} bytes of bodies at once); retry after "
                                                       f"{RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})

    async def post(self, name: str, length: int) -> None:
        admission = self.server.admission
        if not await admission.enter(self.conn, self.server.busy_wait_s):
            return await self.refuse(self.busy(), length)
        try:
            left = await self.read_and_score(name, length)
        finally:
            admission.leave(self.conn)  # before the rest of a refused body is dropped
        if left is not None:
            await self.refuse(self.busy(), left)

    async def read_and_score(self, name: str, length: int) -> int | None:
        """Read, decode, score and answer an admitted request; the bytes of its body left to
        drop after a 503 when room for it did not come, else None."""
        try:
            body = await self.read_body(length)
        except Busy as e:
            return length - e.args[0]
        except BodyTooSlow as e:
            return self.too_slow(e.got, length)
        if len(body) != length:
            return await self.error(Refused(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes"))
        server = self.server
        try:
            scores = await asyncio.get_running_loop().run_in_executor(server.scorer, server.decode_and_score, name,
                                                                      body)
        except BadBody as e:
            return await self.error(Refused(HTTPStatus.BAD_REQUEST, str(e)))
        except Exception as e:  # noqa: BLE001 - the client gets the reason, the server serves on
            return await self.error(Refused(HTTPStatus.INTERNAL_SERVER_ERROR,
                                            f"term {name!r} failed: {type(e).__name__}: {first_line(e)}"))
        finally:
            del body  # the arrays were views of it
        await self.send(answer(HTTPStatus.OK, scores))
        return None

    async def read_body(self, length: int):
        """The body, read into memory that grows as it arrives (an anonymous mmap: pages are
        resident once written); each read's bytes are counted against the budget before they
        join it (until then they sit in the connection's buffer, a few hundred KiB at most).
        Shorter than `length` if the client stopped. Busy(bytes read) when room did not come;
        BodyTooSlow when the client fell behind the pace."""
        server, admission = self.server, self.server.admission
        body = mmap.mmap(-1, length) if length else b""
        got, deadline = 0, time.monotonic() + server.head_deadline_s
        while got < length:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    chunk = await self.reader.read(min(READ_BYTES, length - got))
            except TimeoutError:
                raise BodyTooSlow(got) from None
            if not chunk:
                return memoryview(body)[:got]
            try:
                # the time it waits for room is not the client's
                deadline += await admission.take(self.conn, len(chunk), server.busy_wait_s)
            except Busy:
                raise Busy(got + len(chunk)) from None
            body[got:got + len(chunk)] = chunk
            got += len(chunk)
            deadline += len(chunk) / server.min_body_rate
        return body

    def too_slow(self, got: int, length: int) -> None:
        self.server.log(f"reward server: {self.head.describe()}: body slower than "
                        f"{self.server.min_body_rate / 1024:g} KiB/s ({got} of {length} bytes); closed")

    async def refuse(self, refused: Refused, left: int) -> None:
        """Answer without reading the body, then read and drop it (`left` bytes, at the body's
        pace; the connection may be evicted meanwhile): closing a connection with unread data
        resets it, and the client would see the reset instead of the answer."""
        await self.error(refused)
        self.conn.evictable = True
        got, deadline = 0, time.monotonic() + self.server.head_deadline_s
        while got < left:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    chunk = await self.reader.read(min(READ_BYTES, left - got))
            except TimeoutError:
                return self.too_slow(got, left)
            if not chunk:
                return
            got += len(chunk)
            deadline += len(chunk) / self.server.min_body_rate

    async def error(self, refused: Refused) -> None:
        head = self.head
        what = head.describe() if head is not None and head.method else "a malformed request"
        self.server.log(f"reward server: {what}: {int(refused.status)} {printable(refused.text, LOG_TEXT_CHARS)}")
        await self.send(answer(refused.status, error_body(refused.text), refused.headers))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await self.writer.drain()


def declared_length(head: Head) -> int:
    """How much of a refused request's body to read and drop: its Content-Length where it has a
    single one, whatever comes (up to the largest body) where it is chunked, else none."""
    if head.headers.get("Transfer-Encoding") is not None:
        return MAX_BODY_BYTES
    values = head.headers.get_all("Content-Length") or []
    text = values[0].strip() if len(values) == 1 else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else 0
