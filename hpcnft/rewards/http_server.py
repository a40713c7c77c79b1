"""A scoring server for reward terms, speaking http_protocol.py: POST /v1/score/<name> for each
served term, GET /v1/health. One request is scored at a time (in one worker thread: the terms
hold models and may not be thread-safe).

The connections live on one asyncio event loop (the standard library's; no thread per
connection), so an idle or slow socket costs a few kilobytes, not a thread: what a client may
hold is bounded by http_limits.py (connections per address and in all, evicting sockets that
have not sent their request; places for requests; body bytes counted as they arrive). Why not
an ASGI server or aiohttp: neither has a deadline for a request's head, a cap per address, nor a
way to let a token holder in ahead of idle anonymous sockets, so each would need the same code
beside a new dependency; the standard library parses the headers (http_wire.py).

With a shared secret (`token`), every request must carry it (`Authorization: Bearer <token>`,
shared_secret.py), health checks included; one without it, or with another, is answered 401
(`WWW-Authenticate: Bearer`) before anything else is looked at, its body dropped unread.

What clients may cost the server:
- a request's line and headers must arrive within `head_deadline_s` of its connection, 64 KiB
  at most; a connection still waiting for them may be evicted by a newer one (http_limits.py);
- a POST's path, term, Content-Type and single Content-Length are checked before any of its body
  is read; a refused one is answered at once (`Connection: close`) and its body then read and
  dropped, so that the client sees the answer rather than a reset;
- a body must keep pace: byte k must arrive within `head_deadline_s` + k / `min_body_rate`
  seconds of the head (the time the server made it wait for room excepted); past that the
  connection is closed;
- at most `max_requests` requests are admitted at once, and their bodies hold at most
  `body_budget_bytes` (503 with Retry-After beyond, 413 for a body larger than that). A body
  is read into memory that grows as it arrives, and the arrays are views of it: resident
  memory is the server's own, plus the body budget, plus what one term uses while it scores,
  plus at most about 400 KiB for each open connection's buffers;
- error lines are rate-limited (http_limits.LogLimiter); requests are not logged; each error
  line escapes what the client sent (printable ASCII only) and cuts it short."""
from __future__ import annotations

import asyncio
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

import numpy as np
import torch

from hpcnft.common.errors import first_line
from hpcnft.common.term_warnings import collected
from hpcnft.rewards.http_exchange import RETRY_AFTER_S, BadBody, Exchange
from hpcnft.rewards.http_limits import Admission, Connections, LogLimiter, check_limits
from hpcnft.rewards.http_protocol import MAX_BODY_BYTES, ProtocolError, decode_request, encode_scores, error_body
from hpcnft.rewards.http_wire import LOG_TEXT_CHARS, MAX_HEAD_BYTES, answer, printable

MAX_REQUESTS = 8
MAX_CONNECTIONS = 256
MAX_PER_ADDRESS = 32
BODY_BUDGET_BYTES = 2 << 30
HEAD_DEADLINE_S = 10.0
MIN_BODY_RATE = 1 << 20  # bytes a second
BUSY_WAIT_S = 1.0
EVICT_AFTER_S = 0.25  # a connection this old that has not sent its head may give way to a new one
LISTEN_BACKLOG = 128  # a burst of clients waits to be accepted rather than being reset
CLOSE_TIMEOUT_S = 10.0  # for a closed connection's last bytes to leave


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def listening_socket(address: tuple[str, int]) -> socket.socket:
    """A socket listening on (host, port): IPv4 or IPv6, whichever the host is ("::" takes both)."""
    host, port = address
    family, _, _, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server gets its port back
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class ScoringServer:
    """Serves `terms` (name -> term) on `address` ((host, port); port 0 picks a free one), within
    the limits above; to clients sending `token` alone where one is given. Driven like
    socketserver's servers: serve_forever() in one thread, shutdown() from another, then
    server_close() (or `with server:`)."""

    def __init__(self, address: tuple[str, int], terms: dict, log=stderr_line, *, max_requests: int = MAX_REQUESTS,
                 max_connections: int = MAX_CONNECTIONS, max_per_address: int = MAX_PER_ADDRESS,
                 body_budget_bytes: int = BODY_BUDGET_BYTES, head_deadline_s: float = HEAD_DEADLINE_S,
                 min_body_rate: float = MIN_BODY_RATE, busy_wait_s: float = BUSY_WAIT_S,
                 evict_after_s: float = EVICT_AFTER_S, token: str | None = None):
        check_limits(max_requests, max_connections, max_per_address, body_budget_bytes, head_deadline_s,
                     min_body_rate, busy_wait_s)
        self.terms, self.log = dict(terms), LogLimiter(log)
        self.token = token.encode("ascii") if token else None
        self.table = Connections(max_connections, max_per_address, evict_after_s)
        self.admission = Admission(max_requests, body_budget_bytes)
        self.head_deadline_s, self.min_body_rate, self.busy_wait_s = head_deadline_s, min_body_rate, busy_wait_s
        self.max_request_bytes = min(MAX_BODY_BYTES, body_budget_bytes)
        self.score_lock = threading.Lock()
        self.socket = listening_socket(address)
        self.server_address = self.socket.getsockname()
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="hpcnft-reward-score")
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="hpcnft-reward-decode")
        self._tasks: set[asyncio.Task] = set()
        self._state = threading.Lock()
        self._loop = self._stop = None
        self._started, self._done, self._shutdown_asked = threading.Event(), threading.Event(), False

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def connections(self) -> int:
        return len(self.table)

    # -- socketserver's surface -------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until shutdown() (`poll_interval` is socketserver's; shutdown wakes the loop at once)."""
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(self._loop_error)
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()
            self._done.set()

    def shutdown(self) -> None:
        """Stop serve_forever (from another thread) and wait until it has returned."""
        with self._state:
            self._shutdown_asked = True
            started = self._started.is_set()
        if started:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has closed already
                pass
            self._done.wait()

    def server_close(self) -> None:
        self.socket.close()
        self.scorer.shutdown(wait=False, cancel_futures=True)
        self._decoder.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.server_close()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        with self._state:
            self._started.set()
            if self._shutdown_asked:
                return
        server = await asyncio.start_server(self._connection, sock=self.socket, limit=MAX_HEAD_BYTES,
                                            backlog=LISTEN_BACKLOG)
        ticker = asyncio.create_task(self._tick())
        try:
            await self._stop.wait()
        finally:
            ticker.cancel()
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.log.flush()

    async def _tick(self) -> None:
        while True:  # the error lines left out are counted once a second at most
            await asyncio.sleep(1.0)
            self.log.flush()

    def _loop_error(self, loop, context: dict) -> None:
        """What asyncio itself reports (an accept out of descriptors, say): one line, no traceback."""
        error = context.get("exception")
        self.log(f"reward server: {context.get('message', 'error')}" +
                 (f": {printable(first_line(error, type(error).__name__), LOG_TEXT_CHARS)}" if error else ""))

    # -- scoring ----------------------------------------------------------------------------
    def health(self) -> dict:
        """What GET /v1/health answers: the terms served and the load at this moment."""
        admission = self.admission
        return {"terms": list(self.terms), "requests": admission.requests, "waiting": admission.waiting,
                "body_bytes": admission.bytes, "connections": self.connections}

    def score(self, name: str, prompts: list[str], images: np.ndarray) -> bytes:
        with self.score_lock, collected() as found:
            scores = self.terms[name](prompts, images)
        for text in found:  # the client gets the scores; the warnings are the server's to say
            self.log(f"reward server: warning: {printable(text, LOG_TEXT_CHARS)}")
        scores = torch.as_tensor(scores).detach().to(torch.float32).cpu().numpy()
        if scores.shape != (len(images),):
            raise ProtocolError(f"term {name!r} returned scores of shape {list(scores.shape)} for {len(images)} images")
        return encode_scores(scores)

    def decode_and_score(self, name: str, body) -> bytes:
        """In the scoring thread: the answer's scores for a request's body (BadBody: not a request
        of the protocol). The arrays are views of the body, dropped with it on return."""
        try:
            prompts, images = decode_request(body)
        except ProtocolError as e:
            raise BadBody(str(e)) from None
        return self.score(name, prompts, images)

    # -- one connection ---------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername") or ("?",)
        address = str(peer[0])

        def close() -> None:
            writer.transport.abort()
            task.cancel()

        conn, evicted = self.table.admit(address, close)
        for victim in evicted:
            self.log(f"reward server: connection from {victim.address}: closed before it sent its request, for a "
                     f"newer one (at most {self.table.max_per_address} connections from one address, "
                     f"{self.table.max_connections} in all)")
        if conn is None:
            return self._turn_away(address, writer)
        self._tasks.add(task)
        try:
            await Exchange(self, conn, reader, writer).run()
        except asyncio.CancelledError:
            pass  # evicted, or the server stops
        except (ConnectionError, OSError) as e:
            self.log(f"reward server: connection from {address}: {printable(first_line(e), LOG_TEXT_CHARS)}")
        except Exception as e:  # noqa: BLE001 - one line, never a traceback; the server serves on
            self.log(f"reward server: connection from {address}: {type(e).__name__}: "
                     f"{printable(first_line(e), LOG_TEXT_CHARS)}")
        finally:
            self._tasks.discard(task)
            self.table.remove(conn)
            if self._stop.is_set():
                writer.transport.abort()
            else:
                writer.transport.close()  # sends what is left of the answer, then closes
                self._loop.call_later(CLOSE_TIMEOUT_S, writer.transport.abort)  # unless the client never reads

    def _turn_away(self, address: str, writer: asyncio.StreamWriter) -> None:
        """No room for a new connection: a 503 (a short answer fits the socket's buffer), closed."""
        full = self.table.per_address[address] >= self.table.max_per_address
        what = f"more than {self.table.max_per_address} connections from {address}" if full else \
            f"more than {self.table.max_connections} connections"
        self.log(f"reward server: connection from {address}: 503 {what} open; closed")
        writer.write(answer(HTTPStatus.SERVICE_UNAVAILABLE, error_body(f"busy ({what} open); retry after "
                                                                       f"{RETRY_AFTER_S} s"),
                            {"Retry-After": str(RETRY_AFTER_S)}))
        writer.transport.close()
        asyncio.get_running_loop().call_later(CLOSE_TIMEOUT_S, writer.transport.abort)

def serve_in_thread(server: ScoringServer, poll_interval: float = 0.05) -> threading.Thread:
    """Serve until server.shutdown(), in a daemon thread."""
    thread = threading.Thread(target=server.serve_forever, args=(poll_interval,), name="hpcnft-reward-server",
                              daemon=True)
    thread.start()
    return thread
