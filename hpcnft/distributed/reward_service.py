"""The reward rank's scoring service and the train ranks' client, over point-to-point
messages on the host (gloo), whatever the job's collective backend.

A train rank sends each decoded chunk as soon as it exists and keeps generating; the reward
rank scores chunk j while chunk j+1 is being made. Messages:

  request  header int64[6] = (kind, step, n, H, W, F), then uint8 images [n, H, W, 3] (F = 0)
           or videos' frames [n, F, H, W, 3] (F > 0, a video family's), and int64 sample indices
           [n]   (kind ROLLOUT or EVAL). DONE sends the header only, with
           n = 1 when the run stops for preemption; ERROR adds a uint8[MSG_BYTES] message;
           SNAPSHOT asks the reward rank to write its RNG state into step's checkpoint.
  reply    header int64[5] = (status, n, busy_us, idle_us, preempt), then float32 scores [n, T]
           (one column per reward term of the request's kind: `columns`) and uint8[MSG_BYTES]
           message (SNAPSHOT: header and message only). `preempt` tells the train ranks
           that the reward rank got the preemption signal. The message of a
           failure is its reason; of a success, the warnings the terms gave while scoring
           the chunk (hpcnft.common.term_warnings), one a line, which the client keeps for
           its rank to report (`take_warnings`). Status OUTAGE: a term's service stayed
           unreachable past its wait (common.errors.OutageError); the reward rank answers
           every later chunk so too, unscored, and goes on serving snapshots and the end
           message, so that the train ranks checkpoint the steps they finished and stop.

The reward rank maps indices to prompts with its own copy of the prompt lists, so text never
travels. Sizes are checked against bounds before anything is allocated.

Why the requests travel over gloo under NCCL too: the reward rank must take the next request from
whichever train rank sends first, and only gloo receives from any source and matches messages by
tag. NCCL does neither: a receive waits on the GPU for one peer, in the order posted. Pre-posted
receives per train rank (even on a communicator per pair) leave kernels spinning on the device
until that rank's next request, and CUDA shares its hardware queues between streams
(CUDA_DEVICE_MAX_CONNECTIONS), so such a kernel can hold the traffic of another train rank
behind it while the train ranks wait for each other in FSDP's collectives: a deadlock (seen on
one H200 in the 3+1 layout).

The images (the payload) travel on one of two channels, layout.reward_transport's
(hpcnft.distributed.reward_images): over gloo with the request, or from GPU to GPU over NCCL.
Scores and messages stay on gloo.
"""
from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcnft.common.errors import OutageError, first_line
from hpcnft.common.term_warnings import collected
from hpcnft.distributed.reward_images import PAYLOAD_TAG, DeviceImages, HostImages
from hpcnft.distributed.reward_limits import MAX_CHUNK, MAX_CHUNK_BYTES, MAX_SIDE

ROLLOUT, EVAL, DONE, ERROR, SNAPSHOT = 1, 2, 3, 4, 5
OK, FAILED, OUTAGE = 0, 1, 2
MSG_BYTES = 1024
REPLY_HEADER = 5
HEADER_TAG, REPLY_TAG = 1, 3  # gloo matches receives by tag (PAYLOAD_TAG: reward_images)

log = logging.getLogger("hpcnft")


class RewardServiceError(RuntimeError):
    """The other side of the reward traffic failed or sent something malformed."""


class RewardOutage(RewardServiceError):
    """A reward term's service stayed unreachable past its wait (the term's line): the chunk was
    not scored, and the train ranks stop with a checkpoint of the steps they finished."""


def _encode_msg(text: str) -> torch.Tensor:
    raw = text.encode("utf-8", errors="replace")[:MSG_BYTES]
    buf = torch.zeros(MSG_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def _decode_msg(buf: torch.Tensor) -> str:
    raw = bytes(buf.cpu().tolist())
    return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def warnings_msg(texts: list[str]) -> str:
    """A chunk's warnings as one reply message: as many whole lines as fit, then how many more."""
    for kept in range(len(texts), -1, -1):
        left = len(texts) - kept
        more = [f"... and {left} more (the reward rank's log has every one)"] if left else []
        text = "\n".join(texts[:kept] + more)
        if len(text.encode("utf-8")) <= MSG_BYTES:
            return text
    return ""



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
    kind, step, n, height, width, frames = h
    if kind not in (ROLLOUT, EVAL, DONE, ERROR, SNAPSHOT):
        raise RewardServiceError(f"malformed request: unknown kind {kind}")
    if step < 0:
        raise RewardServiceError(f"malformed request: step {step}")
    if kind in (ROLLOUT, EVAL) and not (0 < n <= MAX_CHUNK and 0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE
                                        and 0 <= frames <= MAX_CHUNK
                                        and n * max(frames, 1) * height * width * 3 <= MAX_CHUNK_BYTES):
        what = f"videos of {frames} frames" if frames else "images"
        raise RewardServiceError(f"malformed request: {n} {what} of {height}x{width} is out of bounds")
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


ONE_TERM = {ROLLOUT: 1, EVAL: 1}


class RemoteRewardClient:
    """Train-rank side: submit chunks without blocking, collect scores later. `group` is the
    job's host group (None: the world group, when it is gloo already); `columns` the number of
    reward terms a reply holds per kind."""

    def __init__(self, reward_rank: int, group, timeout_s: float, columns: dict[int, int] = ONE_TERM,
                 images: HostImages | DeviceImages | None = None):
        self.dst, self.group, self.timeout_s, self.columns = reward_rank, group, timeout_s, dict(columns)
        self.images = images or HostImages(group)  # the payload's channel (layout.reward_transport)
        self.server_busy_s = self.server_idle_s = 0.0  # the reward rank's totals, from its replies
        self.peer_preempt = False
        self.warnings: list[str] = []  # the terms' warnings from the replies, until taken

    def _send(self, t: torch.Tensor, tag: int):
        return dist.isend(t, self.dst, group=self.group, tag=tag)

    def _recv(self, t: torch.Tensor):
        return dist.irecv(t, self.dst, group=self.group, tag=REPLY_TAG)

    def submit(self, kind: int, step: int, images: torch.Tensor, indices: list[int]) -> Pending:
        n, h, w = images.shape[0], images.shape[-3], images.shape[-2]
        frames = images.shape[1] if images.dim() == 5 else 0  # a video family's [n, F, H, W, 3]
        header = torch.tensor([kind, step, n, h, w, frames], dtype=torch.int64)
        idx = torch.tensor(indices, dtype=torch.int64)
        works = [self._send(header, HEADER_TAG)]  # first: the reward rank posts the images' receive on it
        sent, imgs = self.images.isend(images, self.dst)
        works += [sent, self._send(idx, PAYLOAD_TAG)]
        r_header = torch.zeros(REPLY_HEADER, dtype=torch.int64)
        scores = torch.zeros((n, self.columns[kind]), dtype=torch.float32)
        msg = torch.zeros(MSG_BYTES, dtype=torch.uint8)
        works += [self._recv(t) for t in (r_header, scores, msg)]
        return Pending(works, scores, r_header, msg, (header, imgs, idx), self.dst)

    def collect(self, p: Pending) -> torch.Tensor:
        _wait(p.works, self.timeout_s, f"scores from reward rank {p.reward_rank}")
        status = int(p.header[0].item())
        if status == OUTAGE:
            raise RewardOutage(_decode_msg(p.msg))
        if status != OK:
            raise RewardServiceError(f"reward rank {p.reward_rank} failed: {_decode_msg(p.msg)}")
        self.server_busy_s, self.server_idle_s = p.header[2].item() / 1e6, p.header[3].item() / 1e6
        self.peer_preempt = self.peer_preempt or bool(p.header[4].item())
        text = _decode_msg(p.msg)
        if text:
            self.warnings += text.split("\n")
        return p.scores

    def take_warnings(self) -> list[str]:
        """The terms' warnings of the chunks collected since the last call."""
        taken, self.warnings = self.warnings, []
        return taken

    def snapshot(self, step: int) -> None:
        """Have the reward rank write its RNG state into the checkpoint of `step`."""
        header = torch.tensor([SNAPSHOT, step, 0, 0, 0, 0], dtype=torch.int64)
        r_header = torch.zeros(REPLY_HEADER, dtype=torch.int64)
        msg = torch.zeros(MSG_BYTES, dtype=torch.uint8)
        _wait([self._send(header, HEADER_TAG), self._recv(r_header), self._recv(msg)], self.timeout_s,
              f"reward rank {self.dst}'s snapshot")
        if int(r_header[0].item()) != OK:
            raise RewardServiceError(f"reward rank {self.dst} failed: {_decode_msg(msg)}")

    def finish(self, step: int = 0, preempted: bool = False) -> None:
        header = torch.tensor([DONE, step, int(preempted), 0, 0, 0], dtype=torch.int64)
        _wait([self._send(header, HEADER_TAG)], self.timeout_s, "the reward rank to take the end message")

    def report_error(self, text: str) -> None:
        """Best effort: tell the reward rank why this train rank is stopping."""
        try:
            header = torch.tensor([ERROR, 0, 0, 0, 0, 0], dtype=torch.int64)
            _wait([self._send(header, HEADER_TAG), self._send(_encode_msg(text), PAYLOAD_TAG)], 10.0,
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
        self.warnings: list[str] = []  # the terms' warnings, until taken
        self._pool = None
        if overlap:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcnft-reward")

    def _timed(self, *args) -> torch.Tensor:
        t0 = time.perf_counter()
        with collected() as found:
            scores = self.score_fn(*args)
        self.server_busy_s += time.perf_counter() - t0
        self.warnings += found
        return scores

    def take_warnings(self) -> list[str]:
        """The terms' warnings of the chunks scored since the last call (call it once every
        submitted chunk is collected)."""
        taken, self.warnings = self.warnings, []
        return taken

    def submit(self, kind: int, step: int, images: torch.Tensor, indices: list[int]):
        if self._pool is not None:
            return self._pool.submit(self._timed, kind, step, images, indices)
        try:
            return self._timed(kind, step, images, indices)
        except OutageError as e:  # said at collect, as the reward rank's client would
            return RewardOutage(first_line(e))

    def collect(self, pending) -> torch.Tensor:
        if self._pool is not None:
            try:
                return pending.result()  # re-raises the worker's exception here
            except OutageError as e:
                raise RewardOutage(first_line(e)) from None
        if isinstance(pending, RewardOutage):
            raise pending
        return pending

    def snapshot(self, step: int) -> None:
        pass

    def finish(self, step: int = 0, preempted: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def report_error(self, text: str) -> None:
        pass




def next_request(group, active: list[int]) -> tuple[int, torch.Tensor]:
    """The next request header from whichever train rank sends first (any source, by tag),
    bounded by the group's timeout (layout.timeout_s)."""
    h = torch.zeros(6, dtype=torch.int64)
    try:
        src = dist.recv(h, None, group=group, tag=HEADER_TAG)
    except RuntimeError as e:
        raise RewardServiceError(f"no request from train ranks {active} ({first_line(e)})") from None
    if src not in active:
        raise RewardServiceError(f"a request from rank {src}, which is not one of this reward rank's train "
                                 f"ranks {active}")
    return src, h


def serve(clients: list[int], group, score_fn, snapshot_fn=None, preempt_flag=None,
          columns: dict[int, int] = ONE_TERM, on_failure=lambda: None,
          images: HostImages | DeviceImages | None = None) -> dict[str, float]:
    """The reward rank's loop: answer every train rank in `clients` until all said DONE, on the
    host group `group` (None: the world group, when it is gloo already); the images come on
    `images` (the host group by default).
    `score_fn(kind, step, images uint8 [n,H,W,3] (videos [n,F,H,W,3]), indices) -> float32 [n, columns[kind]]`, the
    images on the host (gloo) or on this rank's GPU (nccl). Returns
    busy/idle seconds, whether the train ranks stopped for preemption and, where a term's service
    stayed unreachable (OUTAGE), its line.
    `snapshot_fn(step)` writes this rank's RNG state into that step's checkpoint. A train rank's
    ERROR, or a scoring failure, raises RewardServiceError after the failing side has been told;
    `on_failure()` runs first, before the train rank hears of it (the failure claim)."""
    active = list(clients)
    channel = images or HostImages(group)
    busy = idle = 0.0
    preempted = False
    outage = ""  # a term's service stayed unreachable: every later chunk is answered so, unscored
    last = time.monotonic()

    def recv(t: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(t, src, group=group, tag=PAYLOAD_TAG)
        return t

    def reply(to: int, status: int, n: int, *tensors) -> None:
        head = [status, n, int(busy * 1e6), int(idle * 1e6), int(bool(preempt_flag and preempt_flag.requested))]
        for t in (torch.tensor(head, dtype=torch.int64), *tensors):
            dist.send(t, to, group=group, tag=REPLY_TAG)

    while active:
        ready, header = next_request(group, active)
        now = time.monotonic()
        idle += now - last
        h = header.tolist()
        validate_header(h)
        kind, step, n, height, width, frames = h
        if kind == DONE:
            preempted = preempted or bool(n)
            active.remove(ready)
        elif kind == ERROR:
            msg = recv(torch.zeros(MSG_BYTES, dtype=torch.uint8), ready)
            raise RewardServiceError(f"train rank {ready} failed: {_decode_msg(msg)}")
        elif kind == SNAPSHOT:
            try:
                snapshot_fn(step)
                reply(ready, OK, 0, _encode_msg(""))
            except Exception as e:  # noqa: BLE001
                on_failure()
                reply(ready, FAILED, 0, _encode_msg(f"{type(e).__name__}: {e}"))
                raise
        else:
            pixels = channel.recv((n, frames, height, width, 3) if frames else (n, height, width, 3), ready)
            idx = recv(torch.empty(n, dtype=torch.int64), ready)
            if outage:
                reply(ready, OUTAGE, n, torch.zeros((n, columns[kind])), _encode_msg(outage))
                last = time.monotonic()
                continue
            try:
                with collected() as found:
                    scores = score_fn(kind, step, pixels, idx.tolist()).to(torch.float32).cpu().contiguous()
                if tuple(scores.shape) != (n, columns[kind]):
                    raise RewardServiceError(f"scores of shape {tuple(scores.shape)} for {n} images and "
                                             f"{columns[kind]} reward terms")
                for warning in found:
                    log.warning("step %d: %s", step, warning)
                status, text = OK, warnings_msg(found)
            except OutageError as e:  # the train ranks checkpoint what they finished; we serve on
                outage = first_line(e)
                log.warning("step %d: %s", step, outage)
                scores, status, text = torch.zeros((n, columns[kind])), OUTAGE, outage
            except Exception as e:  # noqa: BLE001 - the train rank must hear about it, then we stop
                on_failure()
                scores, status, text = torch.zeros((n, columns[kind])), FAILED, f"{type(e).__name__}: {e}"
            busy += time.monotonic() - now
            reply(ready, status, n, scores, _encode_msg(text))
            if status == FAILED:
                raise RewardServiceError(f"scoring failed: {text}")
        last = time.monotonic()
    return {"busy_s": busy, "idle_s": idle, "preempted": preempted, "outage": outage}
