"""The scoring server: checks every request against the protocol before scoring (never
unpickles, never allocates beyond the body), answers errors as JSON with their status, scores
one request at a time, and logs errors only, one line each, escaped. What a client may cost it
is bounded: refusals come before the body is read (which is then dropped, not held), a few
requests at once within a byte budget (503 Retry-After beyond), one deadline for a whole
request, and a listen backlog that takes a burst of clients."""
from __future__ import annotations

import http.client
import io
import json
import pickle
import socket
import struct
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hpcnft.rewards.http_protocol import CONTENT_TYPE, MAX_BODY_BYTES, decode_request, encode_request
from hpcnft.rewards.http_server import ScoringServer, printable
from reward_http import connect, drip_until_closed, head, post_until_answered, read_answer, send_post, serving

PROMPTS = ["a red cube", "a blue ball"]


def images(n: int = 2, h: int = 8, w: int = 8, dtype=np.uint8) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, h, w, 3)).astype(dtype)


def zero_term(prompts, imgs):
    return torch.zeros(len(prompts))


def running(terms: dict, log=None, **limits):
    lines = [] if log is None else log
    server = ScoringServer(("127.0.0.1", 0), terms, log=lines.append, **limits) if log is not False else \
        ScoringServer(("127.0.0.1", 0), terms, **limits)
    return serving(server)


def post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": CONTENT_TYPE, **(headers or {})})
    r = conn.getresponse()
    status, payload = r.status, json.loads(r.read())
    conn.close()
    return status, payload


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/health")
    r = conn.getresponse()
    assert (r.status, r.getheader("Content-Type")) == (200, "application/json")
    return json.loads(r.read())


def test_an_unknown_get_names_itself_and_what_the_server_answers():
    with running({"ocr": zero_term}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/healthz")
        answer = conn.getresponse()
        error = json.loads(answer.read())["error"]
        conn.close()
    assert (answer.status, error) == (404, "no GET /v1/healthz here: this server answers GET /v1/health and "
                                           "POST /v1/score/<term>")


def test_health_lists_the_terms_and_scoring_answers_json():
    with running({"ocr": zero_term, "geneval": zero_term}) as server:
        assert health(server.port) == {"terms": ["ocr", "geneval"], "requests": 0, "waiting": 0, "body_bytes": 0,
                                       "connections": 1}  # its own
        assert post(server, "/v1/score/ocr", encode_request(PROMPTS, images())) == (200, {"scores": [0.0, 0.0]})


def test_an_unknown_term_or_path_is_404():
    with running({"ocr": zero_term}) as server:
        status, answer = post(server, "/v1/score/vlm", encode_request(PROMPTS, images()))
        assert status == 404 and "no term 'vlm'" in answer["error"] and "ocr" in answer["error"]
        assert post(server, "/score/ocr", encode_request(PROMPTS, images()))[0] == 404
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/score/ocr")
        assert conn.getresponse().status == 404


class Trap:
    """Unpickling this opens (creates) `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("which", ["images", "prompts"])
def test_a_pickled_array_is_refused_unread(tmp_path, which):
    trap = str(tmp_path / "unpickled")
    arrays = {"images": images(), "prompts": np.array(PROMPTS)}
    arrays[which] = np.array([Trap(trap)] * 2, dtype=object)
    assert pickle.loads(pickle.dumps(Trap(trap))) and (tmp_path / "unpickled").exists()  # the trap works
    (tmp_path / "unpickled").unlink()
    with running({"ocr": zero_term}) as server:
        status, answer = post(server, "/v1/score/ocr", npz(**arrays))
    assert status == 400 and answer["error"].startswith(f"{which}: expected")
    assert not (tmp_path / "unpickled").exists()


@pytest.mark.parametrize("arrays,needle", [
    ({"images": images(h=8, w=8)[..., :2], "prompts": np.array(PROMPTS)}, "images: expected uint8 [n, H, W, 3]"),
    ({"images": images()[0], "prompts": np.array(PROMPTS)}, "images: expected uint8 [n, H, W, 3]"),
    ({"images": images(dtype=np.float32), "prompts": np.array(PROMPTS)}, "images: expected uint8"),
    ({"images": images(dtype=np.int16), "prompts": np.array(PROMPTS)}, "images: expected uint8"),
    ({"images": images(), "prompts": np.array([PROMPTS])}, "prompts: expected a unicode array [n]"),
    ({"images": images(), "prompts": np.array([b"a", b"b"])}, "prompts: expected a unicode array"),
    ({"images": images(), "prompts": np.array(["x" * 4097, "y"])}, "longer than 4096"),
    ({"images": images(), "prompts": np.array(PROMPTS[:1])}, "1 prompts for 2 images"),
    ({"images": images(n=0), "prompts": np.array([], dtype=np.str_)}, "out of bounds"),
    ({"images": images(n=4097, h=1, w=1), "prompts": np.array(["p"] * 4097)}, "out of bounds"),
    ({"images": images(n=1, h=1, w=8193), "prompts": np.array(["p"])}, "out of bounds"),
    ({"images": images()}, "expected exactly the arrays images, prompts"),
    ({"images": images(), "prompts": np.array(PROMPTS), "extra": np.zeros(1)}, "expected exactly the arrays"),
])
def test_bad_arrays_are_400(arrays, needle):
    with running({"ocr": zero_term}) as server:
        status, answer = post(server, "/v1/score/ocr", npz(**arrays))
    assert status == 400 and needle in answer["error"]


def stored_zip(members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data, compress_type=compression)
    return buf.getvalue()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_an_array_header_that_claims_more_than_its_data_is_refused_before_reading():
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "|u1", "fortran_order": False, "shape": (4096, 256, 256, 3)})
    body = stored_zip({"images.npy": head.getvalue() + b"\0" * 10, "prompts.npy": npy(np.array(["p"] * 4096))})
    with pytest.raises(ValueError, match="holds 10 data bytes, its header says 805306368"):
        decode_request(body)


def test_compressed_npz_and_non_npz_bodies_are_400():
    arrays = {"images": images(), "prompts": np.array(PROMPTS)}
    compressed = io.BytesIO()
    np.savez_compressed(compressed, **arrays)
    with running({"ocr": zero_term}) as server:
        status, answer = post(server, "/v1/score/ocr", compressed.getvalue())
        assert status == 400 and "compressed" in answer["error"]
        status, answer = post(server, "/v1/score/ocr", b"PK\3\4 not really")
        assert status == 400 and "not an npz file" in answer["error"]
        status, answer = post(server, "/v1/score/ocr", npz(**arrays), {"Content-Type": "application/octet-stream"})
        assert status == 400 and CONTENT_TYPE in answer["error"]


def test_a_body_beyond_the_limit_is_413_unread():
    with running({"ocr": zero_term}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.putrequest("POST", "/v1/score/ocr")
        conn.putheader("Content-Type", CONTENT_TYPE)
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()  # no body follows: the server must answer without waiting for it
        r = conn.getresponse()
        assert r.status == 413 and "more than" in json.loads(r.read())["error"]


def test_a_request_without_a_length_is_400():
    with running({"ocr": zero_term}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.putrequest("POST", "/v1/score/ocr")
        conn.putheader("Content-Type", CONTENT_TYPE)
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]


def test_http_servers_own_refusals_are_json_too():
    with running({"ocr": zero_term}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("PUT", "/v1/score/ocr", body=b"x")
        r = conn.getresponse()
        assert r.status == 501 and "PUT" in json.loads(r.read())["error"]


@pytest.mark.parametrize("scores,needle", [(torch.tensor([1.0, float("nan")]), "not finite"),
                                           (torch.zeros(3), "shape [3] for 2 images")])
def test_bad_scores_from_a_term_are_500(scores, needle):
    with running({"ocr": lambda prompts, imgs: scores}) as server:
        status, answer = post(server, "/v1/score/ocr", encode_request(PROMPTS, images()))
    assert status == 500 and answer["error"].startswith("term 'ocr' failed: ") and needle in answer["error"]


def test_one_request_is_scored_at_a_time():
    active, most = [0], [0]

    def slow(prompts, imgs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.05)
        active[0] -= 1
        return torch.zeros(len(prompts))

    with running({"ocr": slow}) as server:
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            post(server, "/v1/score/ocr", encode_request(PROMPTS, images()))[0])) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [200] * 4 and most[0] == 1


def test_requests_are_not_logged_and_each_error_is_one_line(capfd):
    with running({"ocr": zero_term}, log=False) as server:
        assert post(server, "/v1/score/ocr", encode_request(PROMPTS, images()))[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/health")
        conn.getresponse().read()
        assert capfd.readouterr().err == ""
        assert post(server, "/v1/score/ocr", b"junk")[0] == 400
        err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("reward server: POST /v1/score/ocr: 400 the body is not an npz")


class Gate:
    """A term that holds each request until `opened` is set."""

    def __init__(self):
        self.opened = threading.Event()

    def __call__(self, prompts, imgs):
        assert self.opened.wait(30)
        return torch.zeros(len(prompts))


def wait_until(condition, hang_guard_s: float = 20) -> None:
    deadline = time.monotonic() + hang_guard_s
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


BODY = encode_request(PROMPTS, images())
OCR = "/v1/score/ocr"


@pytest.mark.parametrize("path,content_type,length,status,needle", [
    ("/no/such/path", CONTENT_TYPE, 100 << 20, 404,
     "no POST /no/such/path here: this server answers GET /v1/health and POST /v1/score/<term>"),
    ("/v1/score/vlm", CONTENT_TYPE, 100 << 20, 404, "no term 'vlm'"),
    (OCR, "text/plain", 100 << 20, 400, "Content-Type must be"),
    (OCR, CONTENT_TYPE, 4097, 413, "more than 4096 bytes"),
])
def test_a_request_is_refused_on_its_head_before_any_body_is_sent(path, content_type, length, status, needle):
    with running({"ocr": zero_term}, body_budget_bytes=4096) as server, connect(server.port) as sock:
        sock.sendall(head(path, length, content_type))
        answer = read_answer(sock)
    assert (answer[0], answer[1]["Connection"]) == (status, "close") and needle in answer[2]["error"]


@pytest.mark.parametrize("path,content_type,status", [("/no/such/path", CONTENT_TYPE, 404),
                                                      (OCR, "text/plain", 400)])
def test_a_refused_body_is_read_and_dropped_so_the_client_gets_the_answer_not_a_reset(path, content_type, status):
    big = bytes(32 << 20)  # beyond what the socket buffers take: unread, it would reset the connection
    with running({"ocr": zero_term}) as server:
        assert send_post(server.port, path, big, content_type)[0] == status


def test_requests_beyond_max_requests_are_503_with_retry_after_and_answered_on_retry():
    gate = Gate()
    with running({"ocr": gate}, max_requests=1, busy_wait_s=0) as server, ThreadPoolExecutor(1) as pool:
        first = pool.submit(send_post, server.port, OCR, BODY)
        wait_until(lambda: server.admission.requests == 1)
        status, headers, answer = send_post(server.port, OCR, BODY)
        assert (status, headers["Retry-After"], headers["Connection"]) == (503, "1", "close")
        assert answer["error"] == f"busy (at most 1 requests, {2 << 30} bytes of bodies at once); retry after 1 s"
        gate.opened.set()
        assert first.result()[0] == 200
        assert post_until_answered(server.port, OCR, BODY)[:2] == (200, {"scores": [0.0, 0.0]})


def test_bodies_beyond_the_byte_budget_are_503_and_one_beyond_the_whole_budget_413():
    gate, budget = Gate(), len(BODY) * 3 // 2
    with running({"ocr": gate}, body_budget_bytes=budget, busy_wait_s=0) as server, ThreadPoolExecutor(1) as pool:
        first = pool.submit(send_post, server.port, OCR, BODY)
        wait_until(lambda: server.admission.bytes == len(BODY))
        assert send_post(server.port, OCR, BODY)[0] == 503  # a second place, but not the bytes
        status, _, answer = send_post(server.port, OCR, bytes(budget + 1))
        assert status == 413 and answer["error"] == f"body of {budget + 1} bytes is more than {budget} bytes"
        gate.opened.set()
        assert first.result()[0] == 200
        wait_until(lambda: server.admission.bytes == 0)
        assert send_post(server.port, OCR, BODY)[0] == 200


def test_a_request_that_does_not_fit_waits_briefly_for_a_place():
    gate = Gate()
    with running({"ocr": gate}, max_requests=1, busy_wait_s=60) as server, ThreadPoolExecutor(2) as pool:
        first = pool.submit(send_post, server.port, OCR, BODY)
        wait_until(lambda: server.admission.requests == 1)
        second = pool.submit(send_post, server.port, OCR, BODY)
        wait_until(lambda: health(server.port)["waiting"] == 1)
        assert health(server.port) == {"terms": ["ocr"], "requests": 1, "waiting": 1, "body_bytes": len(BODY),
                                       "connections": 3}
        gate.opened.set()
        assert first.result()[0] == second.result()[0] == 200


def test_connections_beyond_max_connections_are_503_without_a_thread_and_counted_back():
    lines = []
    with running({"ocr": zero_term}, lines, max_requests=1, max_connections=2) as server:
        idle = [connect(server.port) for _ in range(2)]  # open, silent: each holds a thread
        wait_until(lambda: server.connections == 2)
        threads = threading.active_count()
        with connect(server.port) as sock:
            status, headers, answer = read_answer(sock)
        assert (status, headers["Retry-After"], headers["Connection"]) == (503, "1", "close")
        assert answer["error"] == "busy (more than 2 connections open); retry after 1 s"
        assert threading.active_count() == threads
        assert lines == ["reward server: connection from 127.0.0.1: 503 more than 2 connections open; closed"]
        for sock in idle:
            sock.close()  # their threads end (a malformed request each) and give their places back
        wait_until(lambda: server.connections == 0)
        assert send_post(server.port, OCR, BODY)[0] == 200


def test_a_request_gives_back_its_place_and_bytes_whatever_its_answer():
    def failing(prompts, imgs):
        raise RuntimeError("judge down")

    with running({"ocr": zero_term, "bad": failing}, max_requests=1, busy_wait_s=10) as server:
        statuses = [send_post(server.port, "/v1/score/bad", BODY)[0], send_post(server.port, OCR, b"junk")[0]]
        with connect(server.port) as sock:
            sock.sendall(head(OCR, len(BODY)) + BODY[:10])
            sock.shutdown(socket.SHUT_WR)  # the body ends early
            statuses.append(read_answer(sock)[0])
        statuses.append(send_post(server.port, OCR, BODY)[0])
        wait_until(lambda: (server.admission.requests, server.admission.bytes) == (0, 0))
    assert statuses == [500, 400, 400, 200]


HEAD_LINE = "reward server: connection from 127.0.0.1: no request within 1 s; closed"
SLOW_LINE = "reward server: POST {path}: body slower than 1 KiB/s ({got} of 100000 bytes); closed"


def test_a_request_head_dripped_slowly_is_closed_at_its_deadline():
    lines = []
    with running({"ocr": zero_term}, lines, head_deadline_s=1) as server, connect(server.port) as sock:
        assert drip_until_closed(sock, head(OCR, 10)) == b""
    assert lines == [HEAD_LINE]


@pytest.mark.parametrize("path,answered", [(OCR, b""), ("/no/such/path", b"HTTP/1.0 404 ")])
def test_a_body_slower_than_the_pace_is_closed_whether_it_is_read_or_dropped(path, answered):
    # byte k must arrive within head_deadline_s + k / min_body_rate: a byte every 50 ms is
    # 20 B/s, far behind 1 KiB/s once the second of grace is spent
    lines = []
    with running({"ocr": zero_term}, lines, head_deadline_s=1, min_body_rate=1024) as server, \
            connect(server.port) as sock:
        sock.sendall(head(path, 100_000))
        received = drip_until_closed(sock, bytes(100_000))
    assert received.startswith(answered) and (received == b"") == (answered == b"")
    slow = [line for line in lines if "slower" in line]
    assert len(slow) == 1 and slow[0].startswith(f"reward server: POST {path}: body slower than 1 KiB/s (")


def test_a_body_that_keeps_the_pace_is_read_however_long_it_takes():
    # 20 bytes every 50 ms (400 B/s) against a pace of 100 B/s after 0.2 s: longer than the
    # grace and the first bytes' share of it, never behind
    lines = []
    body = encode_request(PROMPTS[:1], images(n=1, h=1, w=1))
    with running({"ocr": zero_term}, lines, head_deadline_s=0.2, min_body_rate=100) as server, \
            connect(server.port) as sock:
        sock.sendall(head(OCR, len(body)))
        for i in range(0, len(body), 20):
            time.sleep(0.05)
            sock.sendall(body[i:i + 20])
        status, _, payload = read_answer(sock)
    assert (status, payload, lines) == (200, {"scores": [0.0]}, [])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a listener's TCP_INFO is Linux's")
def test_the_listen_backlog_takes_a_burst_of_clients():
    server = ScoringServer(("127.0.0.1", 0), {"ocr": zero_term})
    try:
        info = server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    finally:
        server.server_close()
    backlog = struct.unpack_from("=I", info, 28)[0]  # tcpi_sacked: a listening socket's backlog
    with open("/proc/sys/net/core/somaxconn") as f:
        assert backlog >= min(128, int(f.read()))


def test_what_a_client_sent_is_logged_escaped_and_cut_short():
    lines = []
    path = b"/v1/score/\x1b[2J\x07\x9b" + b"a" * 10_000
    requests = [b"POST " + path + b" HTTP/1.0\r\nContent-Type: application/x-npz\r\nContent-Length: 0\r\n\r\n",
                b"\x1b]0;owned\x07 / HTTP/1.0\r\n\r\n"]
    statuses = []
    with running({"ocr": zero_term}, lines) as server:
        for request in requests:
            with connect(server.port) as sock:
                sock.sendall(request)
                statuses.append(read_answer(sock)[0])
    assert statuses == [404, 501] and len(lines) == 2
    assert all(line.isascii() and line.isprintable() and len(line) < 1000 for line in lines)
    assert lines[0].startswith("reward server: POST /v1/score/\\x1b[2J\\x07\\x9baaa") and "10016 characters" in lines[0]
    assert lines[1].startswith("reward server: \\x1b]0;owned\\x07 /: 501 ")


def test_printable_escapes_all_but_printable_ascii_and_cuts():
    assert printable("ok /v1/score/x") == "ok /v1/score/x"
    assert printable("a\x1b[31m\\\n\x9b\u00e9\u2028") == "a\\x1b[31m\\\\\\n\\x9b\\xe9\\u2028"
    assert printable("x" * 30, limit=10) == "xxxxxxxxxx... (30 characters)"
    assert printable("\x00" * 10, limit=10) == "\\x00\\x00... (10 characters)"  # never half an escape


@pytest.mark.parametrize("limits,needle", [({"max_requests": 0}, "max_requests must be at least 1"),
                                           ({"max_requests": 3, "max_connections": 2}, "max_connections must be"),
                                           ({"body_budget_bytes": 0}, "body_budget_bytes must be at least 1"),
                                           ({"head_deadline_s": 0}, "head_deadline_s must be a positive"),
                                           ({"head_deadline_s": float("inf")}, "head_deadline_s must be"),
                                           ({"min_body_rate": 0}, "min_body_rate must be a positive"),
                                           ({"max_per_address": 0}, "max_per_address must be at least 1"),
                                           ({"busy_wait_s": -1}, "busy_wait_s must be")])
def test_bad_limits_are_refused(limits, needle):
    with pytest.raises(ValueError, match=needle):
        ScoringServer(("127.0.0.1", 0), {"ocr": zero_term}, **limits)
