"""The `remote` reward term: scores from a scoring server over HTTP (http_protocol.py), so
judges with their own dependencies (GenEval, OCR, VLMs) run in their own environment, or
another host, and hpcnft depends on none of them.

An attempt (connect, send the request, read the whole answer) has `timeout_s` in all, however
slowly the server trickles its answer, and reads at most a bound that n scores need; redirects
are refused, as following one would turn the POST into a GET. A request that may succeed on a
later try (connection refused or reset, a timeout, 5xx, 429: a server that is down, restarting
or busy) is retried for up to `retry_for_s` seconds (at most `retries` times, where that is not
-1), with exponential backoff and jitter (so that many jobs do not come back at once), waiting
longer where a 503 or 429 asks so (Retry-After in seconds, at most a minute). The term says
once, as the wait begins, that it waits, and once that the server answers again. A request that
runs out of its wait is a RemoteOutageError (the job checkpoints the steps it finished and
stops); any other answer fails at once. Every failure is one RemoteRewardError line naming the
term and its URL.

Each request carries the shared secret from the environment variable token_env names, if it
is set (`Authorization: Bearer`, shared_secret.py); a 401 or 403 fails at once, naming that
variable, never its value. A refused redirect never takes the token elsewhere."""
from __future__ import annotations

import http.client
import io
import random
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from hpcnft.common.errors import OutageError, first_line
from hpcnft.common.term_warnings import announce
from hpcnft.rewards.base import as_uint8_numpy
from hpcnft.rewards.http_protocol import (CONTENT_TYPE, MAX_BODY_BYTES, ProtocolError, decode_scores, encode_request,
                                          error_text)
from hpcnft.rewards.shared_secret import TokenError, bearer, client_token

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0
RETRY_AFTER_MAX_S = 60.0  # a server's Retry-After is honoured up to this
# An answer's bound: a float32 as its shortest float64 decimal is at most 23 characters, so 64
# per score leaves room for separators and indentation, 4096 for the rest of the JSON.
ANSWER_BYTES_PER_SCORE = 64
ANSWER_SLACK_BYTES = 4096
ERROR_BODY_BYTES = 65536  # what is read of an error answer, for its one-line reason
READ_BYTES = 65536


class RemoteRewardError(RuntimeError):
    """A remote term's request failed (one line: the term, its URL and why)."""


class RemoteOutageError(RemoteRewardError, OutageError):
    """A remote term's server stayed down or busy for the whole of the request's wait."""


class Retriable(Exception):
    """An attempt failed in a way a later attempt may not (the reason, one line), and the wait
    the server asked for (Retry-After), if any."""

    def __init__(self, reason: str, retry_after_s: float = 0.0):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


def backoff_s(attempt: int) -> float:
    """The longest wait after failed attempt `attempt` (0-based): 0.5 s, doubling, capped; a
    wait is between half of it and all of it (jitter)."""
    return min(BACKOFF_START_S * 2 ** attempt, BACKOFF_MAX_S)


def retry_after_s(value: str | None) -> float:
    """A Retry-After header's wait in seconds, at most RETRY_AFTER_MAX_S; 0 where it is absent or
    not a number of seconds (an HTTP date is not honoured: clocks of cluster nodes disagree)."""
    text = (value or "").strip()
    return min(float(text), RETRY_AFTER_MAX_S) if text.isascii() and text.isdigit() else 0.0


def max_answer_bytes(n: int) -> int:
    """The most bytes the JSON answer for n scores may take."""
    return ANSWER_BYTES_PER_SCORE * n + ANSWER_SLACK_BYTES


class Deadline:
    """The end of an attempt: `left()` is the time until it, TimeoutError once it has passed."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the attempt's deadline passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """Reads of a socket, each waiting at most until the deadline (a socket timeout alone
    restarts with every byte that arrives)."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._io = sock.makefile("rb", buffering=0)  # holds the socket open while the answer is read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._io.readinto(buffer)

    def close(self) -> None:
        self._io.close()
        super().close()


class _DeadlineSocket:
    """A connected socket as http.client uses it (sendall, makefile, close), every send and
    read bounded by the deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data) -> None:
        self._sock.settimeout(self._deadline.left())  # sendall's timeout covers all of it
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        if mode != "rb":
            raise ValueError(f"mode {mode!r}: only 'rb'")
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        self._sock.close()

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, deadline: Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = self.deadline.left()
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTPSConnection(_DeadlineHTTPConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_DeadlineHTTPConnection, req, deadline=self.deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_DeadlineHTTPSConnection, req, deadline=self.deadline, context=self._context)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx reaches the caller as an HTTPError


def _opener(deadline: Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener (so http_proxy and no_proxy apply as before), bounded by `deadline`,
    following no redirect."""
    return urllib.request.build_opener(_NoRedirects(), _HTTPHandler(deadline), _HTTPSHandler(deadline))


def _network_reason(e: BaseException, timeout_s: float) -> str:
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"timed out: no whole answer within {timeout_s:g} s (timeout_s)"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return first_line(reason, type(reason).__name__) if isinstance(reason, BaseException) else str(reason)


class RemoteTerm:
    """POST each chunk to `url`; float32 [n] scores back. `sleep` and `clock` time the waits,
    `jitter()` gives each wait's share of its backoff in [0, 1) (its own random stream: the
    global ones are the job's); the token is read from the variable `token_env` names once,
    here ("": none sent)."""

    def __init__(self, name: str, url: str, timeout_s: float, retries: int, sleep=time.sleep, token_env: str = "",
                 retry_for_s: float = 300.0, clock=time.monotonic, jitter=None):
        self.name, self.url, self.timeout_s, self.retries, self.sleep = name, url, timeout_s, retries, sleep
        self.retry_for_s, self.clock = retry_for_s, clock
        self.jitter = jitter or random.Random().random
        self.token_env = token_env
        self.waiting_since: float | None = None  # the server has not answered since then (said once)
        try:
            self._token = client_token(token_env)
        except TokenError as e:
            raise self._fail(str(e)) from None

    def _token_reason(self) -> str:
        """Why a server answered 401 or 403, as far as this side knows: where the token comes from."""
        if self._token is not None:
            return f"the token from ${self.token_env} (token_env) was refused"
        if not self.token_env:
            return "no token sent (token_env is empty)"
        return f"no token sent: ${self.token_env} (token_env) is unset or empty"

    def _fail(self, reason: str) -> RemoteRewardError:
        return RemoteRewardError(f"reward term {self.name!r} (remote {self.url}): {reason}")

    def _read_answer(self, response, n: int) -> bytes:
        """The answer's body, refused (at once, without reading it) when longer than n scores need."""
        bound = max_answer_bytes(n)
        if response.length is not None and response.length > bound:
            raise self._fail(f"an answer of {response.length} bytes (Content-Length) is more than {n} scores "
                             f"need (at most {bound})")
        parts, size = [], 0
        while chunk := response.read(min(READ_BYTES, bound + 1 - size)):
            parts.append(chunk)
            size += len(chunk)
            if size > bound:
                raise self._fail(f"an answer of more than {bound} bytes is more than {n} scores need")
        return b"".join(parts)

    def _attempt(self, body: bytes, n: int) -> np.ndarray:
        headers = {"Content-Type": CONTENT_TYPE, "Accept": "application/json"}
        if self._token is not None:
            headers["Authorization"] = bearer(self._token)
        request = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        deadline = Deadline(self.timeout_s)
        try:
            with _opener(deadline).open(request, timeout=self.timeout_s) as response:
                status, answer = response.status, self._read_answer(response, n)
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                location = " ".join(str(e.headers.get("Location", "")).split())[:200]
                raise self._fail(f"HTTP {e.code} redirect to {location!r} refused (a redirect would turn the "
                                 f"POST into a GET): set url to the scoring endpoint itself") from None
            try:
                detail = error_text(e.read(ERROR_BODY_BYTES))
            except (OSError, http.client.HTTPException):
                detail = ""
            finally:
                e.close()
            if self._token is not None:  # a server may echo what it was sent
                detail = detail.replace(self._token, "<token>")
            reason = f"HTTP {e.code}" + (f" ({detail})" if detail else "")
            if e.code >= 500 or e.code == 429:
                raise Retriable(reason, retry_after_s(e.headers.get("Retry-After"))) from None
            if e.code in (401, 403):  # another attempt sends the same token
                raise self._fail(f"{reason}: {self._token_reason()}") from None
            raise self._fail(reason) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise Retriable(_network_reason(e, self.timeout_s)) from None
        if status != 200:
            raise self._fail(f"HTTP {status}, expected 200 with the scores")
        try:
            return decode_scores(answer, n)
        except ProtocolError as e:
            raise self._fail(f"malformed answer: {e}") from None

    def __call__(self, prompts: list[str], images) -> torch.Tensor:
        images = as_uint8_numpy(images)
        if len(prompts) != len(images):
            raise self._fail(f"{len(prompts)} prompts for {len(images)} images")
        if len(images) == 0:
            return torch.zeros(0, dtype=torch.float32)
        body = encode_request(prompts, images)
        if len(body) > MAX_BODY_BYTES:
            raise self._fail(f"a request of {len(body)} bytes is more than a server takes ({MAX_BODY_BYTES})")
        return torch.from_numpy(self._with_retries(body, len(images)))

    def _with_retries(self, body: bytes, n: int) -> np.ndarray:
        """Attempts until one answers, while the wait allows: `retry_for_s` seconds of waits
        and attempts after the first, at most `retries` more attempts (-1: no such limit)."""
        attempt, spent = 0, 0.0
        while True:
            t0 = self.clock()
            try:
                scores = self._attempt(body, n)
                break
            except Retriable as e:
                reason, asked_s = str(e), e.retry_after_s
            attempt += 1
            spent += self.clock() - t0 if attempt > 1 else 0.0
            left = self.retry_for_s - spent
            if (0 <= self.retries < attempt) or left <= 0:
                self.waiting_since = None
                tried = f"after {attempt} attempt{'s' if attempt > 1 else ''}"
                if self.retries < 0 or attempt <= self.retries:
                    tried += f" in {spent:.0f} s (retry_for_s {self.retry_for_s:g})"
                raise RemoteOutageError(self._fail(f"{reason} {tried}")) from None
            if self.waiting_since is None:
                self.waiting_since = self.clock()
                announce(f"reward term {self.name!r} (remote {self.url}): {reason}; retrying for up to "
                         f"{self.retry_for_s:g} s (retry_for_s)")
            wait = min(max(backoff_s(attempt - 1) * (0.5 + 0.5 * self.jitter()), asked_s), left)
            self.sleep(wait)
            spent += wait
        if self.waiting_since is not None:
            announce(f"reward term {self.name!r} (remote {self.url}): answered again after "
                     f"{self.clock() - self.waiting_since:.0f} s")
            self.waiting_since = None
        return scores


def load(term, cfg, device: torch.device) -> RemoteTerm:
    """A term of kind `remote`: its url, timeout_s, retry_for_s, retries and token_env (the device
    is the server's business)."""
    if not term.url.startswith(("http://", "https://")):
        raise RemoteRewardError(f"reward term {term.name or term.kind!r}: url must be http:// or https://, "
                                f"got {term.url!r}")
    return RemoteTerm(term.name or term.kind, term.url, term.timeout_s, term.retries, token_env=term.token_env,
                      retry_for_s=term.retry_for_s)
