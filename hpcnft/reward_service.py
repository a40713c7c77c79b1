"""The reward rank's PickScore service and the train ranks' client, over point-to-point
collectives (gloo on CPUs, NCCL on GPUs).

A train rank sends each decoded chunk as soon as it exists and keeps generating; the reward
rank scores chunk j while chunk j+1 is being made. Messages:

  request  header int64[6] = (kind, step, n, H, W, 0), then uint8 images [n, H, W, 3] and
           int64 sample indices [n]   (kind ROLLOUT or EVAL). DONE sends the header only, with
           n = 1 when the run stops for preemption; ERROR adds a uint8[MSG_BYTES] message;
           SNAPSHOT asks the reward rank to write its RNG state into step's checkpoint.
  reply    header int64[5] = (status, n, busy_us, idle_us, preempt), then float32 scores [n] and
           uint8[MSG_BYTES] message (SNAPSHOT: header and message only). `preempt` tells the
           train ranks that the reward rank got the preemption signal.

The reward rank maps indices to prompts with its own copy of the prompt lists, so text never
travels. Sizes are checked against bounds before anything is allocated.

Each train rank talks to its reward rank over a process group of just the two (a `Link`). NCCL
runs the operations posted on one communicator in order and does not match messages by tag: on
a group shared by several train ranks, the reward rank's pending header receive for one train
rank would hold every later receive and reply for the others, while those wait for each other
in FSDP's collectives (a deadlock). One group per pair keeps each train rank's traffic in its
own queue.
"""
from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROLLOUT, EVAL, DONE, ERROR, SNAPSHOT = 1, 2, 3, 4, 5
OK, FAILED = 0, 1
MSG_BYTES = 1024
REPLY_HEADER = 5
HEADER_TAG, PAYLOAD_TAG, REPLY_TAG = 1, 2, 3  # gloo matches receives by tag
MAX_CHUNK = 4096
MAX_SIDE = 8192
MAX_CHUNK_BYTES = 1 << 30  # one chunk of uint8 images: 1 GiB (the recipe's 8 images of 512² are 6 MiB)


class RewardServiceError(RuntimeError):
    """The other side of the reward traffic failed or sent something malformed."""


@dataclass(frozen=True)
class Link:
    """One train rank's channel to its reward rank: `group` holds the two ranks and carries
    payloads and replies. Request headers travel on it too under NCCL, where the reward rank
    polls one pre-posted receive per link; gloo cannot poll a receive, but it can take the next
    header from any source on the world group (`header_group` None), matched by tag."""
    peer: int
    group: object  # a ProcessGroup of [train rank, reward rank]
    header_group: object | None

    @staticmethod
    def between(peer: int, group, backend: str) -> "Link":
        return Link(peer, group, group if backend == "nccl" else None)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _encode_msg(text: str) -> torch.Tensor:
    raw = text.encode("utf-8", errors="replace")[:MSG_BYTES]
    buf = torch.zeros(MSG_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def _decode_msg(buf: torch.Tensor) -> str:
    raw = bytes(buf.cpu().tolist())
    return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def _wait(works, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    for w in works:
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            w.wait(timeout=datetime.timedelta(seconds=remaining))
        except RuntimeError as e:
            first = first_line(e)
            if "timed out" in first.lower() or "timeout" in first.lower():
                raise RewardServiceError(f"timed out after {timeout_s:.0f} s waiting for {what}") from None
            raise RewardServiceError(f"lost the connection while waiting for {what} ({first})") from None


def validate_header(h: list[int]) -> None:
    """Refuse a request header before anything is allocated for its payload."""
    if len(h) != 6:
        raise RewardServiceError(f"malformed request: header of {len(h)} values")
    kind, step, n, height, width, _ = h
    if kind not in (ROLLOUT, EVAL, DONE, ERROR, SNAPSHOT):
        raise RewardServiceError(f"malformed request: unknown kind {kind}")
    if step < 0:
        raise RewardServiceError(f"malformed request: step {step}")
    if kind in (ROLLOUT, EVAL) and not (0 < n <= MAX_CHUNK and 0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE
                                        and n * height * width * 3 <= MAX_CHUNK_BYTES):
        raise RewardServiceError(f"malformed request: {n} images of {height}x{width} is out of bounds")
    if kind == DONE and n not in (0, 1):
        raise RewardServiceError(f"malformed request: end message with flag {n}")


@dataclass
class Pending:
    works: list
    scores: torch.Tensor
    header: torch.Tensor
    msg: torch.Tensor
    keep_alive: tuple  # send buffers must outlive their isend
    reward_rank: int


class RemoteRewardClient:
    """Train-rank side: submit chunks without blocking, collect scores later."""

    def __init__(self, link: Link, comm_device: torch.device, timeout_s: float):
        self.link, self.dst, self.dev, self.timeout_s = link, link.peer, comm_device, timeout_s
        self.server_busy_s = self.server_idle_s = 0.0  # the reward rank's totals, from its replies
        self.peer_preempt = False

    def submit(self, kind: int, step: int, images: torch.Tensor, indices: list[int]) -> Pending:
        n, h, w, _ = images.shape
        header = torch.tensor([kind, step, n, h, w, 0], dtype=torch.int64, device=self.dev)
        imgs = images.to(self.dev)
        idx = torch.tensor(indices, dtype=torch.int64, device=self.dev)
        works = [self._send_header(header), self._send(imgs), self._send(idx)]
        r_header = torch.zeros(REPLY_HEADER, dtype=torch.int64, device=self.dev)
        scores = torch.zeros(n, dtype=torch.float32, device=self.dev)
        msg = torch.zeros(MSG_BYTES, dtype=torch.uint8, device=self.dev)
        works += [self._recv_reply(t) for t in (r_header, scores, msg)]
        return Pending(works, scores, r_header, msg, (header, imgs, idx), self.dst)

    def _send_header(self, header: torch.Tensor):
        return dist.isend(header, self.dst, group=self.link.header_group, tag=HEADER_TAG)

    def _send(self, payload: torch.Tensor):
        return dist.isend(payload, self.dst, group=self.link.group, tag=PAYLOAD_TAG)

    def _recv_reply(self, buf: torch.Tensor):
        return dist.irecv(buf, self.dst, group=self.link.group, tag=REPLY_TAG)

    def collect(self, p: Pending) -> torch.Tensor:
        _wait(p.works, self.timeout_s, f"scores from reward rank {p.reward_rank}")
        status = int(p.header[0].item())
        if status != OK:
            raise RewardServiceError(f"reward rank {p.reward_rank} failed: {_decode_msg(p.msg)}")
        self.server_busy_s, self.server_idle_s = p.header[2].item() / 1e6, p.header[3].item() / 1e6
        self.peer_preempt = self.peer_preempt or bool(p.header[4].item())
        return p.scores.cpu()

    def snapshot(self, step: int) -> None:
        """Have the reward rank write its RNG state into the checkpoint of `step`."""
        header = torch.tensor([SNAPSHOT, step, 0, 0, 0, 0], dtype=torch.int64, device=self.dev)
        r_header = torch.zeros(REPLY_HEADER, dtype=torch.int64, device=self.dev)
        msg = torch.zeros(MSG_BYTES, dtype=torch.uint8, device=self.dev)
        _wait([self._send_header(header), self._recv_reply(r_header), self._recv_reply(msg)], self.timeout_s,
              f"reward rank {self.dst}'s snapshot")
        if int(r_header[0].item()) != OK:
            raise RewardServiceError(f"reward rank {self.dst} failed: {_decode_msg(msg)}")

    def finish(self, step: int = 0, preempted: bool = False) -> None:
        header = torch.tensor([DONE, step, int(preempted), 0, 0, 0], dtype=torch.int64, device=self.dev)
        _wait([self._send_header(header)], self.timeout_s, "the reward rank to take the end message")

    def report_error(self, text: str) -> None:
        """Best effort: tell the reward rank why this train rank is stopping."""
        try:
            header = torch.tensor([ERROR, 0, 0, 0, 0, 0], dtype=torch.int64, device=self.dev)
            _wait([self._send_header(header), self._send(_encode_msg(text).to(self.dev))], 10.0,
                  "the reward rank to take the error message")
        except Exception:  # noqa: BLE001 - the peer may be gone already
            pass


class LocalRewardClient:
    """World 1 (colocated): score in the training process, same interface. With `overlap`
    (perf.overlap_reward) a chunk is scored in one worker thread while the caller goes on
    sampling the next one: the CPU image preprocessing then hides behind the DiT's GPU work.
    One worker scores the chunks in submission order with the same kernels, so the scores are
    those of the synchronous path."""

    def __init__(self, score_fn, overlap: bool = False):
        self.score_fn = score_fn
        self.server_busy_s = self.server_idle_s = 0.0
        self.peer_preempt = False
        self._pool = None
        if overlap:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcnft-reward")

    def _timed(self, *args) -> torch.Tensor:
        t0 = time.perf_counter()
        scores = self.score_fn(*args)
        self.server_busy_s += time.perf_counter() - t0
        return scores

    def submit(self, kind: int, step: int, images: torch.Tensor, indices: list[int]):
        if self._pool is not None:
            return self._pool.submit(self._timed, kind, step, images, indices)
        return self._timed(kind, step, images, indices)

    def collect(self, pending) -> torch.Tensor:
        if self._pool is not None:
            return pending.result()  # re-raises the worker's exception here
        return pending

    def snapshot(self, step: int) -> None:
        pass

    def finish(self, step: int = 0, preempted: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def report_error(self, text: str) -> None:
        pass




class HeaderReceiver:
    """The next request header from any client. Under NCCL each link has one pre-posted receive,
    polled for completion (NCCL cannot receive from any source); under gloo the header is taken
    from any source on the world group by its tag (gloo's receives report completion only once
    waited on, so they cannot be polled)."""

    def __init__(self, links: dict[int, Link], device: torch.device, timeout_s: float):
        self.links, self.device, self.timeout_s = links, device, timeout_s
        self.polling = any(link.header_group is not None for link in links.values())
        self.headers = {c: torch.zeros(6, dtype=torch.int64, device=device) for c in links}
        self.posted = {c: self._post(c) for c in links} if self.polling else {}

    def _post(self, client: int):
        return dist.irecv(self.headers[client], client, group=self.links[client].header_group, tag=HEADER_TAG)

    def next(self, active: list[int]) -> tuple[int, torch.Tensor]:
        if not self.polling:
            h = torch.zeros(6, dtype=torch.int64)
            try:  # any source; bounded by the process group's timeout (layout.timeout_s)
                src = dist.recv(h, None, tag=HEADER_TAG)
            except RuntimeError as e:
                raise RewardServiceError(f"no request from train ranks {active} ({first_line(e)})") from None
            return src, h
        deadline = time.monotonic() + self.timeout_s
        while True:
            for c in active:
                if self.posted[c].is_completed():
                    self.posted[c].wait()
                    return c, self.headers[c].clone()
            if time.monotonic() > deadline:
                raise RewardServiceError(f"no request from train ranks {active} for {self.timeout_s:.0f} s")
            time.sleep(0.0005)

    def rearm(self, client: int) -> None:
        if self.polling:
            self.posted[client] = self._post(client)

    def drop(self, client: int) -> None:
        self.posted.pop(client, None)


def serve(links: dict[int, Link], score_fn, comm_device: torch.device, idle_timeout_s: float, log,
          snapshot_fn=None, preempt_flag=None) -> dict[str, float]:
    """The reward rank's loop: answer every train rank in `links` (train rank -> its Link) until
    all said DONE.
    `score_fn(kind, step, images uint8 [n,H,W,3] CPU, indices) -> float32 [n]`. Returns
    busy/idle seconds and whether the train ranks stopped for preemption.
    `snapshot_fn(step)` writes this rank's RNG state into that step's checkpoint. A train rank's ERROR, or a scoring failure, raises RewardServiceError
    after the failing side has been told."""
    receiver = HeaderReceiver(links, comm_device, idle_timeout_s)
    active = deque(links)
    busy = idle = 0.0
    preempted = False
    last = time.monotonic()

    def reply(to: int, status: int, n: int, *tensors) -> None:
        head = [status, n, int(busy * 1e6), int(idle * 1e6), int(bool(preempt_flag and preempt_flag.requested))]
        for t in (torch.tensor(head, dtype=torch.int64), *tensors):
            dist.send(t.to(comm_device), to, group=links[to].group, tag=REPLY_TAG)

    while active:
        ready, header = receiver.next(list(active))

        now = time.monotonic()
        idle += now - last
        h = header.cpu().tolist()
        validate_header(h)
        kind, step, n, height, width, _ = h
        if kind == DONE:
            preempted = preempted or bool(n)
            active.remove(ready)
            receiver.drop(ready)
            last = time.monotonic()
            continue
        if kind == ERROR:
            msg = torch.zeros(MSG_BYTES, dtype=torch.uint8, device=comm_device)
            dist.recv(msg, ready, group=links[ready].group, tag=PAYLOAD_TAG)
            raise RewardServiceError(f"train rank {ready} failed: {_decode_msg(msg)}")
        if kind == SNAPSHOT:
            try:
                snapshot_fn(step)
                reply(ready, OK, 0, _encode_msg(""))
            except Exception as e:  # noqa: BLE001
                reply(ready, FAILED, 0, _encode_msg(f"{type(e).__name__}: {e}"))
                raise
            receiver.rearm(ready)
            last = time.monotonic()
            continue
        images = torch.empty((n, height, width, 3), dtype=torch.uint8, device=comm_device)
        idx = torch.empty(n, dtype=torch.int64, device=comm_device)
        dist.recv(images, ready, group=links[ready].group, tag=PAYLOAD_TAG)
        dist.recv(idx, ready, group=links[ready].group, tag=PAYLOAD_TAG)
        try:
            scores = score_fn(kind, step, images.cpu(), idx.cpu().tolist()).to(torch.float32)
            status, text = OK, ""
        except Exception as e:  # noqa: BLE001 - the train rank must hear about it, then we stop
            scores, status, text = torch.zeros(n), FAILED, f"{type(e).__name__}: {e}"
        busy += time.monotonic() - now
        reply(ready, status, n, scores, _encode_msg(text))
        if status != OK:
            raise RewardServiceError(f"scoring failed: {text}")
        receiver.rearm(ready)
        active.remove(ready)  # round-robin between clients that are ready together
        active.append(ready)
        last = time.monotonic()
    return {"busy_s": busy, "idle_s": idle, "preempted": preempted}
