"""The scoring server: checks every request against the protocol before scoring (never
unpickles, never allocates beyond the body), answers errors as JSON with their status, scores
one request at a time, and logs errors only, one line each."""
from __future__ import annotations

import http.client
import io
import json
import pickle
import threading
import time
import zipfile

import numpy as np
import pytest
import torch

from hpcnft.rewards.http_protocol import CONTENT_TYPE, MAX_BODY_BYTES, decode_request, encode_request
from hpcnft.rewards.http_server import ScoringServer
from reward_http import serving

PROMPTS = ["a red cube", "a blue ball"]


def images(n: int = 2, h: int = 8, w: int = 8, dtype=np.uint8) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, h, w, 3)).astype(dtype)


def zero_term(prompts, imgs):
    return torch.zeros(len(prompts))


def running(terms: dict, log=None):
    lines = [] if log is None else log
    server = ScoringServer(("127.0.0.1", 0), terms, log=lines.append) if log is not False else \
        ScoringServer(("127.0.0.1", 0), terms)
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


def test_health_lists_the_terms_and_scoring_answers_json():
    with running({"ocr": zero_term, "geneval": zero_term}) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/health")
        r = conn.getresponse()
        assert (r.status, r.getheader("Content-Type"), json.loads(r.read())) == \
            (200, "application/json", {"terms": ["ocr", "geneval"]})
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
