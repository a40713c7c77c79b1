"""`hpcnft reward-server` as a process under a burst of hostile and valid clients at once, on
loopback: large bodies to unknown paths and terms, wrong content types, a body beyond the budget,
slow-drip clients, and valid requests to `jpeg_compressibility`; and under eight clients posting
150 MiB each at once. The server's memory stays within its byte budget (bodies are held as they
arrive, their arrays are views of them), every valid request is answered 200 with the local
term's scores (after 503 Retry-After, when busy), and every hostile one gets its answer or,
dripping, is closed when it falls behind."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch

from hpcnft.algo.root_config import load_config

from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.http_protocol import CONTENT_TYPE, encode_request
from hpcnft.rewards.registry import load_term
from reward_http import connect, drip_until_closed, head, post_until_answered, send_post, wait_for_port

MIB = 1 << 20
BUDGET_MIB, MAX_REQUESTS, DEADLINE_S, PACE_KIB_S = 32, 3, 3, 64
TERM = "jpeg_compressibility"
SCORE = f"/v1/score/{TERM}"
BIG = bytes(64 * MIB)  # one buffer for every large hostile body
# (path, content type, body, expected status): each held whole, the server would grow by 64 MiB
HOSTILE = [("/no/such/path", CONTENT_TYPE, BIG, 404)] * 4 + [("/v1/score/nope", CONTENT_TYPE, BIG, 404)] * 2 + \
          [(SCORE, "text/plain", BIG, 400)] * 2 + [(SCORE, CONTENT_TYPE, BIG[:(BUDGET_MIB + 16) * MIB], 413)]
# (what is sent at once, what is dripped a byte at a time); the admitted ones hold every place
# until they fall behind the pace, so valid requests arriving meanwhile are answered 503 and
# come back
DRIPS = [(b"", head(SCORE, 10)), (head("/no/such/path", MIB), bytes(MIB))] + \
        [(head(SCORE, MIB), bytes(MIB))] * MAX_REQUESTS
# (images per request, clients): the large ones fit the budget one or two at a time, not together
VALID = [(16, 8), (128, 4)]
SIDE = 256


class PeakRss:
    """The largest RSS of a process, sampled every few milliseconds until stopped; on Linux also
    the kernel's own high-water mark (VmHWM), which misses nothing."""

    def __init__(self, pid: int):
        self.process, self.pid, self.peak = psutil.Process(pid), pid, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.high_water_mark())

    def high_water_mark(self) -> int:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except OSError:
            return 0


def valid_requests() -> list[tuple[bytes, np.ndarray]]:
    """(body, the local term's scores) of each valid request."""
    term = load_term(RewardTermConfig(kind=TERM), load_config("tiny"), torch.device("cpu"))
    out = []
    for n, clients in VALID:
        for _ in range(clients):
            images = np.random.default_rng(len(out)).integers(0, 256, (n, SIDE, SIDE, 3), dtype=np.uint8)
            prompts = [f"prompt {len(out)}.{i}" for i in range(n)]
            out.append((encode_request(prompts, images), term(prompts, images).numpy()))
    return out


def score_until_answered(port: int, body: bytes, expected: np.ndarray) -> int:
    status, payload, busy = post_until_answered(port, SCORE, body)
    assert status == 200, payload
    assert np.array_equal(np.array(payload["scores"], np.float32).view(np.int32), expected.view(np.int32))
    return busy


def hostile(port: int, path: str, content_type: str, body: bytes, status: int) -> None:
    answer = send_post(port, path, body, content_type)
    assert answer[0] == status, answer


def drip(port: int, sent: bytes, dripped: bytes) -> None:
    with connect(port) as sock:
        sock.sendall(sent)
        drip_until_closed(sock, dripped, every_s=0.1, hang_guard_s=60)


def serve(tmp_path, *options):
    """A reward-server process of TERM with `options`: (process, port, its stderr file). Its
    stderr goes to a file: a pipe nobody reads would fill and stall it."""
    port_file = str(tmp_path / "port")
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hpcnft", "reward-server", TERM, "--port", "0", "--port-file",
                             port_file, *options], stdout=subprocess.DEVNULL, stderr=err)
    return proc, wait_for_port(proc, port_file), err


@contextlib.contextmanager
def serving(tmp_path, *options):
    proc, port, err = serve(tmp_path, *options)
    try:
        yield proc, port, err
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        err.close()


@pytest.fixture
def server(tmp_path):
    with serving(tmp_path, "--max-requests", str(MAX_REQUESTS), "--max-body-mib", str(BUDGET_MIB),
                 "--head-deadline-s", str(DEADLINE_S), "--min-body-kib-s", str(PACE_KIB_S)) as running:
        yield running


@pytest.mark.slow
def test_a_hostile_burst_stays_within_the_budget_and_every_valid_request_is_scored(server):
    proc, port, err = server
    requests = valid_requests()
    score_until_answered(port, *requests[0])  # the term's first use, before the baseline
    baseline = psutil.Process(proc.pid).memory_info().rss
    t0 = time.monotonic()
    with PeakRss(proc.pid) as rss, ThreadPoolExecutor(len(HOSTILE) + len(DRIPS) + len(requests)) as pool:
        jobs = [pool.submit(hostile, port, *h) for h in HOSTILE] + [pool.submit(drip, port, *d) for d in DRIPS]
        valid = [pool.submit(score_until_answered, port, *r) for r in requests]
        for job in jobs:
            job.result()
        busy = sum(job.result() for job in valid)
    # What the budget lets requests hold (their bodies, of which the arrays are views), and room
    # for the allocator's free lists; any hostile body held whole would add 64 MiB.
    bound = baseline + BUDGET_MIB * MIB + 32 * MIB
    print(f"\nreward-server RSS: baseline {baseline / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB, bound "
          f"{bound / MIB:.0f} MiB; {len(requests)} valid requests ({busy} answers 503 first), {len(HOSTILE)} "
          f"large hostile ones, {len(DRIPS)} drips, in {time.monotonic() - t0:.1f} s")
    assert rss.peak < bound
    assert proc.poll() is None
    err.seek(0)
    log = err.read()
    assert "Traceback" not in log
    closed = log.count(f"no request within {DEADLINE_S} s") + log.count("body slower than")
    assert closed == len(DRIPS) or "error lines left out" in log


LARGE_CLIENTS, LARGE_BUDGET_MIB = 8, 256


@pytest.mark.slow
def test_eight_clients_posting_150_mib_at_once_keep_the_server_within_its_budget(tmp_path):
    # The case: 8 clients posting 150 MiB at once took the server to 2.6 GiB (each body
    # and its decoded copy held together). Bodies now count as they arrive, the newest of those
    # that fill the budget together gives way, and the arrays are views of the body: the server
    # holds at most its budget of them.
    images = np.zeros((50, 1024, 1024, 3), dtype=np.uint8)  # 150 MiB
    body = encode_request([f"p{i}" for i in range(len(images))], images)
    expected = load_term(RewardTermConfig(kind=TERM), load_config("tiny"), torch.device("cpu"))(
        ["p"], images[:1]).numpy()
    with serving(tmp_path, "--max-body-mib", str(LARGE_BUDGET_MIB)) as (proc, port, err):
        small = encode_request(["p"], images[:1, :64, :64])
        assert post_until_answered(port, SCORE, small)[0] == 200
        baseline = psutil.Process(proc.pid).memory_info().rss
        t0 = time.monotonic()
        with PeakRss(proc.pid) as rss, ThreadPoolExecutor(LARGE_CLIENTS) as pool:
            answers = list(pool.map(lambda _: post_until_answered(port, SCORE, body, hang_guard_s=600),
                                    range(LARGE_CLIENTS)))
        err.seek(0)
        log = err.read()
    bound = baseline + LARGE_BUDGET_MIB * MIB + 64 * MIB
    print(f"\nreward-server RSS with {LARGE_CLIENTS} clients of {len(body) / MIB:.0f} MiB each: baseline "
          f"{baseline / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB "
          f"({LARGE_BUDGET_MIB} MiB of bodies); {sum(a[2] for a in answers)} answers 503 first; "
          f"{time.monotonic() - t0:.1f} s")
    assert [a[0] for a in answers] == [200] * LARGE_CLIENTS
    assert all(np.array_equal(np.array(a[1]["scores"], np.float32), np.repeat(expected, len(images)))
               for a in answers)
    assert rss.peak < bound
    assert "Traceback" not in log
