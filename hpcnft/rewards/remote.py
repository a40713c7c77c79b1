"""The `remote` reward term: scores from a scoring server over HTTP (http_protocol.py), so
judges with their own dependencies (GenEval, OCR, VLMs) run in their own environment, or
another host, and hpcnft depends on none of them.

A request that may succeed on a second try (connection refused or reset, a timeout, 5xx, 429)
is retried `retries` times with exponential backoff; any other answer fails at once. Every
failure is one RemoteRewardError line naming the term and its URL."""
from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from hpcnft.common.errors import first_line
from hpcnft.rewards.base import as_uint8_numpy
from hpcnft.rewards.http_protocol import (CONTENT_TYPE, MAX_BODY_BYTES, ProtocolError, decode_scores, encode_request,
                                          error_text)

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0


class RemoteRewardError(RuntimeError):
    """A remote term's request failed (one line: the term, its URL and why)."""


class Retriable(Exception):
    """An attempt failed in a way a later attempt may not (the reason, one line)."""


def backoff_s(attempt: int) -> float:
    """The wait after failed attempt `attempt` (0-based): 0.5 s, doubling, capped."""
    return min(BACKOFF_START_S * 2 ** attempt, BACKOFF_MAX_S)


def _network_reason(e: BaseException, timeout_s: float) -> str:
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"timed out (timeout_s {timeout_s:g})"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return first_line(reason, type(reason).__name__) if isinstance(reason, BaseException) else str(reason)


class RemoteTerm:
    """POST each chunk to `url`; float32 [n] scores back. `sleep` is the backoff's clock."""

    def __init__(self, name: str, url: str, timeout_s: float, retries: int, sleep=time.sleep):
        self.name, self.url, self.timeout_s, self.retries, self.sleep = name, url, timeout_s, retries, sleep

    def _fail(self, reason: str) -> RemoteRewardError:
        return RemoteRewardError(f"reward term {self.name!r} (remote {self.url}): {reason}")

    def _attempt(self, body: bytes, n: int) -> np.ndarray:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": CONTENT_TYPE, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                status, answer = response.status, response.read()
        except urllib.error.HTTPError as e:
            try:
                detail = error_text(e.read())
            except (OSError, http.client.HTTPException):
                detail = ""
            reason = f"HTTP {e.code}" + (f" ({detail})" if detail else "")
            if e.code >= 500 or e.code == 429:
                raise Retriable(reason) from None
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
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return torch.from_numpy(self._attempt(body, len(images)))
            except Retriable as e:
                reason = str(e)
            if attempt + 1 < attempts:
                self.sleep(backoff_s(attempt))
        raise self._fail(f"{reason} after {attempts} attempt{'s' if attempts > 1 else ''}")


def load(term, cfg, device: torch.device) -> RemoteTerm:
    """A term of kind `remote`: its url, timeout_s and retries (the device is the server's business)."""
    if not term.url.startswith(("http://", "https://")):
        raise RemoteRewardError(f"reward term {term.name or term.kind!r}: url must be http:// or https://, "
                                f"got {term.url!r}")
    return RemoteTerm(term.name or term.kind, term.url, term.timeout_s, term.retries)
