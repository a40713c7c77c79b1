"""The `remote` reward term: scores from a scoring server equal the local term's bit for bit;
retries on what may pass (refused, timeouts, 5xx, 429) with backoff, fails at once on the rest;
an attempt has timeout_s in all however slowly the answer comes, an answer longer than its
scores need and a redirect are refused; every failure is one line naming the term and its URL."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.common import term_warnings
from hpcnft.common.errors import OutageError

from hpcnft.rewards import remote
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.http_protocol import MAX_CHUNK, encode_scores
from hpcnft.rewards.http_server import ScoringServer
from hpcnft.rewards.registry import load_term
from hpcnft.rewards.remote import RemoteRewardError, RemoteTerm
from reward_http import serving

PROMPTS = ["a red cube", "ein Hund im Schnee", "猫と月"]


def images(n: int = 3, side: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)




def scoring_server(terms: dict) -> ScoringServer:
    return ScoringServer(("127.0.0.1", 0), terms, log=lambda line: None)


def url_of(server, name: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1/score/{name}"


class Scripted(ThreadingHTTPServer):
    """Answers each POST with the next (status, body[, headers]) of `script`, after reading the
    request; a status of None waits on `release` (a server that does not answer in time)."""

    daemon_threads = True

    def __init__(self, script: list[tuple[int | None, bytes]]):
        self.script, self.requests, self.release = list(script), 0, threading.Event()
        super().__init__(("127.0.0.1", 0), ScriptedHandler)

    def shutdown(self):
        self.release.set()
        super().shutdown()


class ScriptedHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        status, body, *headers = self.server.script.pop(0) if self.server.script else (500, b"{}")
        if status is None:
            self.server.release.wait(10)
            return
        self.send_response(status)
        for key, value in (headers[0] if headers else {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def scores_body(values) -> bytes:
    return json.dumps({"scores": list(values)}).encode()


def client(server, name="judge", retries=2, timeout_s=10.0, sleeps=None) -> RemoteTerm:
    """A remote term whose waits are recorded, not slept, each the whole of its backoff (jitter 1)."""
    waits = [] if sleeps is None else sleeps
    return RemoteTerm(name, url_of(server, name), timeout_s, retries, sleep=waits.append, jitter=lambda: 1.0)


class Fixed:
    """A term with given float32 scores, whatever the images."""

    def __init__(self, scores: np.ndarray):
        self.scores = torch.from_numpy(scores)

    def __call__(self, prompts, imgs):
        return self.scores[:len(prompts)].clone()


def test_remote_scores_are_the_local_terms_bit_for_bit():
    cfg, cpu = load_config("tiny"), torch.device("cpu")
    local = {k: load_term(RewardTermConfig(kind=k, name=k), cfg, cpu)
             for k in ("jpeg_compressibility", "jpeg_incompressibility")}
    # float32 at its edges: a third, subnormals, the largest finite value, -0.0, many digits
    awkward = np.array([1 / 3, -2.5e-40, 3.4028235e38, -0.0, 1e-45, np.pi * 1e7, -7.1e-8], dtype=np.float32)
    with serving(scoring_server({**local, "awkward": Fixed(awkward)})) as server:
        imgs = images()
        for name, term in local.items():
            got = client(server, name)(PROMPTS, imgs)
            want = term(PROMPTS, imgs)
            assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
        many = [f"p{i}" for i in range(len(awkward))]
        got = client(server, "awkward")(many, images(len(awkward)))
        assert np.array_equal(got.numpy().view(np.int32), awkward.view(np.int32))


def test_the_server_scores_each_prompt_against_its_image():
    seen = []

    def record(prompts, imgs):
        seen.append((list(prompts), imgs.copy()))
        return torch.zeros(len(prompts))

    imgs = images(seed=3)
    with serving(scoring_server({"judge": record})) as server:
        client(server)(PROMPTS, torch.from_numpy(imgs))
    (prompts, got), = seen
    assert prompts == PROMPTS and got.dtype == np.uint8 and np.array_equal(got, imgs)


def test_two_503s_then_an_answer_succeeds_with_two_retries_and_backs_off():
    sleeps = []
    with serving(Scripted([(503, b"{}"), (503, b"{}"), (200, scores_body([1.5, 2, -3]))])) as server:
        got = client(server, retries=2, sleeps=sleeps)(PROMPTS, images())
        assert server.requests == 3
    assert got.tolist() == [1.5, 2.0, -3.0]
    assert sleeps == [remote.backoff_s(0), remote.backoff_s(1)] == [0.5, 1.0]


def test_a_retry_after_in_seconds_is_waited_for_up_to_a_minute_and_never_less_than_the_backoff():
    busy = [(503, b"{}", {"Retry-After": "3"}), (429, b"{}", {"Retry-After": "86400"}),
            (503, b"{}", {"Retry-After": "0"}), (503, b"{}", {"Retry-After": "Fri, 31 Dec 1999 23:59:59 GMT"})]
    sleeps = []
    with serving(Scripted([*busy, (200, scores_body([1, 2, 3]))])) as server:
        assert client(server, retries=4, sleeps=sleeps)(PROMPTS, images()).tolist() == [1.0, 2.0, 3.0]
    assert sleeps == [3.0, remote.RETRY_AFTER_MAX_S, remote.backoff_s(2), remote.backoff_s(3)] == [3.0, 60.0, 2.0, 4.0]


def test_backoff_doubles_and_is_capped():
    waits = [remote.backoff_s(i) for i in range(10)]
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and max(waits) == remote.BACKOFF_MAX_S


def test_retries_run_out_as_one_line_naming_the_url():
    with serving(Scripted([(503, b'{"error": "busy loading"}')] * 2)) as server:
        term = client(server, retries=1)
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, images())
        assert server.requests == 2
    text = str(e.value)
    assert text == f"reward term 'judge' (remote {term.url}): HTTP 503 (busy loading) after 2 attempts"


def test_429_is_retried():
    with serving(Scripted([(429, b"{}"), (200, scores_body([0, 0, 0]))])) as server:
        assert client(server, retries=1)(PROMPTS, images()).tolist() == [0, 0, 0]
        assert server.requests == 2


@pytest.mark.parametrize("status", [400, 404, 413])
def test_other_client_errors_fail_at_once(status):
    with serving(Scripted([(status, b'{"error": "no such thing"}'), (200, scores_body([0, 0, 0]))])) as server:
        term = client(server, retries=3)
        with pytest.raises(RemoteRewardError, match=rf"^reward term 'judge' \(remote {term.url}\): "
                                                    rf"HTTP {status} \(no such thing\)$"):
            term(PROMPTS, images())
        assert server.requests == 1


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_names_the_url_and_the_attempts():
    sleeps = []
    url = f"http://127.0.0.1:{unused_port()}/v1/score/ocr"
    with pytest.raises(RemoteRewardError) as e:
        RemoteTerm("ocr", url, 5.0, 2, sleep=sleeps.append, jitter=lambda: 1.0)(PROMPTS, images())
    assert str(e.value) == f"reward term 'ocr' (remote {url}): connection refused after 3 attempts"
    assert sleeps == [0.5, 1.0]


class FakeClock:
    """A clock that moves only when the term sleeps: a wait of minutes takes no time."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_server_that_stays_down_is_retried_for_retry_for_s_with_jittered_backoff_then_an_outage():
    clock, said = FakeClock(), []
    url = f"http://127.0.0.1:{unused_port()}/v1/score/ocr"
    term = RemoteTerm("ocr", url, 5.0, -1, sleep=clock.sleep, clock=clock, retry_for_s=120.0)
    term_warnings.announce_to(said.append)
    try:
        with pytest.raises(remote.RemoteOutageError) as e:
            term(PROMPTS, images())
    finally:
        term_warnings.announce_to(None)
    assert isinstance(e.value, OutageError)
    attempts = len(clock.sleeps) + 1
    assert str(e.value) == (f"reward term 'ocr' (remote {url}): connection refused after {attempts} attempts in "
                            "120 s (retry_for_s 120)")
    assert sum(clock.sleeps) == pytest.approx(120.0)  # the last wait is cut to what is left
    for i, wait in enumerate(clock.sleeps[:-1]):  # each between half its backoff and all of it
        assert remote.backoff_s(i) / 2 <= wait <= remote.backoff_s(i)
    assert len(set(clock.sleeps[6:-1])) > 1  # jittered: jobs waiting together come back apart
    assert said == [f"reward term 'ocr' (remote {url}): connection refused; retrying for up to 120 s (retry_for_s)"]


def test_the_wait_is_said_once_as_it_begins_and_once_when_the_server_answers_again():
    clock, said = FakeClock(), []
    with serving(Scripted([(503, b'{"error": "loading"}')] * 3 + [(200, scores_body([1, 2, 3]))] * 2)) as server:
        term = RemoteTerm("judge", url_of(server, "judge"), 5.0, -1, sleep=clock.sleep, clock=clock)
        term_warnings.announce_to(said.append)
        try:
            assert term(PROMPTS, images()).tolist() == [1.0, 2.0, 3.0]
            assert term(PROMPTS, images()).tolist() == [1.0, 2.0, 3.0]  # nothing more to say
        finally:
            term_warnings.announce_to(None)
    assert said == [f"reward term 'judge' (remote {term.url}): HTTP 503 (loading); retrying for up to 300 s "
                    "(retry_for_s)",
                    f"reward term 'judge' (remote {term.url}): answered again after {sum(clock.sleeps):.0f} s"]


def test_retry_for_s_0_is_one_attempt():
    clock = FakeClock()
    url = f"http://127.0.0.1:{unused_port()}/v1/score/ocr"
    with pytest.raises(remote.RemoteOutageError, match="connection refused after 1 attempt in 0 s"):
        RemoteTerm("ocr", url, 5.0, -1, sleep=clock.sleep, clock=clock, retry_for_s=0.0)(PROMPTS, images())
    assert clock.sleeps == []


def test_a_server_that_does_not_answer_in_time_is_a_timeout():
    with serving(Scripted([(None, b"")])) as server:
        term = client(server, retries=0, timeout_s=0.3)
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, images())
    assert str(e.value) == (f"reward term 'judge' (remote {term.url}): timed out: no whole answer within 0.3 s "
                            f"(timeout_s) after 1 attempt")


class Custom(ThreadingHTTPServer):
    """Answers each request with `respond(handler)`; records each request's method and path.
    `release` is set on shutdown, for a respond that waits; `done` once a respond has returned."""

    daemon_threads = True

    def __init__(self, respond):
        self.respond, self.seen, self.release, self.done = respond, [], threading.Event(), threading.Event()
        super().__init__(("127.0.0.1", 0), CustomHandler)

    @property
    def requests(self) -> int:
        return len(self.seen)

    def shutdown(self):
        self.release.set()
        super().shutdown()


class CustomHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self):
        self.server.seen.append((self.command, self.path))
        if "Content-Length" in self.headers:
            self.rfile.read(int(self.headers["Content-Length"]))
        try:
            self.server.respond(self)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.server.done.set()

    do_GET = do_POST = _answer


def head_bytes(status: int = 200, headers: dict | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def drip(handler, data: bytes, every_s: float = 0.2) -> None:
    """Write `data` a byte at a time, `every_s` apart, until done or the server shuts down."""
    for i in range(len(data)):
        handler.wfile.write(data[i:i + 1])
        if handler.server.release.wait(every_s):
            return


# The whole answer dripped takes far longer than timeout_s, each byte far less.
PADDED = b" " * 60 + scores_body([1.0, 2.0, 3.0])


@pytest.mark.parametrize("phase", ["head", "body"])
def test_an_answer_dripped_slowly_times_out_after_timeout_s_in_all(phase):
    def respond(handler):
        head = head_bytes(headers={"Content-Length": len(PADDED)})
        if phase == "head":
            drip(handler, head + PADDED)
        else:
            handler.wfile.write(head)
            drip(handler, PADDED)

    timeout_s, sleeps = 1.0, []
    with serving(Custom(respond)) as server:
        term = client(server, retries=1, timeout_s=timeout_s, sleeps=sleeps)
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, images())
        took = time.monotonic() - t0
        assert server.requests == 2  # a timeout is retried, as before
    assert took < 2 * (5 * timeout_s) + 5  # a hang guard only
    assert str(e.value) == (f"reward term 'judge' (remote {term.url}): timed out: no whole answer within 1 s "
                            f"(timeout_s) after 2 attempts")
    assert sleeps == [0.5]


def test_the_bound_on_an_answer_holds_the_longest_scores():
    longest = np.full(1, -1.1754944e-38, dtype=np.float32)  # the longest shortest decimal of a float32
    assert len(repr(float(longest[0]))) == 23  # sign, 17 digits, point, e-38
    for n in (1, 3, MAX_CHUNK):
        assert len(encode_scores(np.resize(longest, n))) <= remote.max_answer_bytes(n)


BIG = 32 << 20  # more than a loopback connection buffers: the server cannot write it all unread


def big_answer(length_header: bool):
    """An answer of BIG bytes of whitespace before valid scores; with or without its
    Content-Length (else it ends when the connection closes). Records whether it was all written."""
    body = b" " * BIG + scores_body([1.0, 2.0, 3.0])

    def respond(handler):
        handler.server.wrote_all = False
        handler.wfile.write(head_bytes(headers={"Content-Length": len(body)} if length_header else None))
        view = memoryview(body)
        for i in range(0, len(body), 1 << 20):
            handler.wfile.write(view[i:i + (1 << 20)])
        handler.server.wrote_all = True
    return respond


@pytest.mark.parametrize("length_header", [True, False])
def test_an_answer_longer_than_its_scores_need_is_refused_unread(length_header):
    bound = remote.max_answer_bytes(len(PROMPTS))
    with serving(Custom(big_answer(length_header))) as server:
        term = client(server, retries=3)
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, images())
        assert server.done.wait(60)  # the server's writes end once the client has hung up
        assert server.requests == 1 and not server.wrote_all
    text = str(e.value)
    if length_header:
        length = BIG + len(scores_body([1.0, 2.0, 3.0]))
        assert text == (f"reward term 'judge' (remote {term.url}): an answer of {length} bytes (Content-Length) "
                        f"is more than 3 scores need (at most {bound})")
    else:
        assert text == (f"reward term 'judge' (remote {term.url}): an answer of more than {bound} bytes is more "
                        f"than 3 scores need")


def test_an_answer_within_the_bound_is_read_without_a_content_length():
    def respond(handler):
        handler.wfile.write(head_bytes())
        handler.wfile.write(b" " * 4000 + scores_body([1.0, 2.0, 3.0]))
    with serving(Custom(respond)) as server:
        assert client(server)(PROMPTS, images()).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_never_followed(status):
    def answer(handler):
        body = scores_body([1.0, 2.0, 3.0])
        handler.wfile.write(head_bytes(200, {"Content-Length": len(body)}) + body)

    with serving(Custom(answer)) as target:
        elsewhere = url_of(target, "judge")

        def redirect(handler):
            handler.wfile.write(head_bytes(status, {"Location": elsewhere, "Content-Length": 2}) + b"{}")

        with serving(Custom(redirect)) as server:
            term = client(server, retries=3)
            with pytest.raises(RemoteRewardError) as e:
                term(PROMPTS, images())
            assert server.seen == [("POST", "/v1/score/judge")]
        assert target.seen == []  # neither a GET nor a POST
    assert str(e.value) == (f"reward term 'judge' (remote {term.url}): HTTP {status} redirect to {elsewhere!r} "
                            f"refused (a redirect would turn the POST into a GET): set url to the scoring "
                            f"endpoint itself")


@pytest.mark.parametrize("body,reason", [
    (scores_body([1.0, 2.0]), "2 scores for 3 images"),
    (b'{"scores": [1.0, NaN, 2.0]}', "NaN"),
    (b'{"scores": [1.0, Infinity, 2.0]}', "Infinity"),
    (b'{"scores": [1.0, 1e400, 2.0]}', "not finite"),
    (b'{"scores": [1.0, 1e39, 2.0]}', "not finite float32"),
    (b'{"scores": [1.0, "2", 3.0]}', "not numbers"),
    (b'{"scores": [1.0, true, 3.0]}', "not numbers"),
    (b'{"score": [1.0, 2.0, 3.0]}', 'no "scores" list'),
    (b"[1.0, 2.0, 3.0]", 'no "scores" list'),
    (b"<html>ok</html>", "not JSON"),
    (b"\xff\xfe{", "not JSON"),
])
def test_a_malformed_answer_fails_at_once(body, reason):
    with serving(Scripted([(200, body), (200, scores_body([0, 0, 0]))])) as server:
        term = client(server, retries=3)
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, images())
        assert server.requests == 1
    text = str(e.value)
    assert text.startswith(f"reward term 'judge' (remote {term.url}): malformed answer: ") and reason in text
    assert "\n" not in text


def test_a_failing_term_is_a_500_with_its_reason():
    def broken(prompts, imgs):
        raise RuntimeError("CUDA out of memory\nTried to allocate ...")

    with serving(scoring_server({"judge": broken})) as server:
        with pytest.raises(RemoteRewardError) as e:
            client(server, retries=1)(PROMPTS, images())
    assert str(e.value).endswith("HTTP 500 (term 'judge' failed: RuntimeError: CUDA out of memory) after 2 attempts")


def test_a_request_beyond_the_servers_limit_is_refused_before_sending(monkeypatch):
    monkeypatch.setattr(remote, "MAX_BODY_BYTES", 1000)
    with serving(Scripted([])) as server:
        with pytest.raises(RemoteRewardError, match="more than a server takes"):
            client(server)(PROMPTS, images())
        assert server.requests == 0


def test_prompts_and_images_must_pair_up():
    with pytest.raises(RemoteRewardError, match="2 prompts for 3 images"):
        RemoteTerm("judge", "http://127.0.0.1:9/", 1.0, 0)(PROMPTS[:2], images())
    with pytest.raises(ValueError, match="uint8"):
        RemoteTerm("judge", "http://127.0.0.1:9/", 1.0, 0)(PROMPTS, images().astype(np.float32))


def test_a_remote_term_loads_from_its_config():
    cfg = load_config("tiny", ['reward.terms=[{kind="remote", name="ocr", url="http://h:8000/v1/score/ocr", '
                               'timeout_s=5.5, retries=4, retry_for_s=90}]'])
    term = load_term(cfg.reward.terms[0], cfg, torch.device("cpu"))
    assert isinstance(term, RemoteTerm)
    assert (term.name, term.url, term.timeout_s, term.retries, term.retry_for_s) == \
        ("ocr", "http://h:8000/v1/score/ocr", 5.5, 4, 90.0)


@pytest.mark.parametrize("setting,key", [('url="ftp://h/x"', "url"), ('url=""', "url"),
                                         ('url="http://h/x", retries=-2', "retries"),
                                         ('url="http://h/x", retry_for_s=-1', "retry_for_s"),
                                         ('url="http://h/x", timeout_s=0', "timeout_s")])
def test_a_remote_terms_config_is_checked(setting, key):
    with pytest.raises(ConfigError, match=rf"reward\.terms\[0\]\.{key}"):
        load_config("tiny", [f'reward.terms=[{{kind="remote", {setting}}}]'])


def test_a_remote_terms_wait_must_end_before_the_train_ranks_stop_waiting():
    # the tiny recipe's layout.timeout_s is 120 s; the default wait 60 + 300 s
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ['reward.terms=[{kind="pickscore"}, {kind="remote", url="http://h/x"}]'])
    assert str(e.value) == ("reward.terms[1].retry_for_s: the remote terms may take 360 s over a chunk (timeout_s + "
                            "retry_for_s), not less than layout.timeout_s (120 s), which the train ranks wait for its "
                            "scores: lower retry_for_s or raise layout.timeout_s")
    load_config("tiny", ['reward.terms=[{kind="remote", url="http://h/x"}]', "layout.timeout_s=361"])
    load_config("tiny", ['reward.terms=[{kind="remote", url="http://h/x", retries=0}]'])  # no retries: 60 s


def test_http_proxy_still_applies(monkeypatch):
    def answer(handler):
        body = scores_body([1.0, 2.0, 3.0])
        handler.wfile.write(head_bytes(200, {"Content-Length": len(body)}) + body)

    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with serving(Custom(answer)) as proxy:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.server_address[1]}")
        url = "http://judge-node.invalid:8000/v1/score/ocr"
        assert RemoteTerm("ocr", url, 10.0, 0)(PROMPTS, images()).tolist() == [1.0, 2.0, 3.0]
        assert proxy.seen == [("POST", url)]
