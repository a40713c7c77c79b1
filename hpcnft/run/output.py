"""What a rank tells: its log file, the progress line, sample grids, and failures as one line
naming the rank and its reason."""
from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback

import torch

from hpcnft.algo.sampler import prompt_grid
from hpcnft.common.errors import first_line
from hpcnft.distributed import netif
from hpcnft.run.failures import CONSEQUENCE_WAIT_S, FailureClaim
from hpcnft.run.output_guard import guard, guard_std_streams

log = logging.getLogger("hpcnft")


_terminal = None  # the rank's original stderr, once native output goes to its log
_on_closed = [lambda: None]  # what a write to a closed output asks for (guard_output)


def guard_output(on_closed) -> None:
    """A write to a closed stdout or stderr (or the rank's copy of the terminal) stops printing
    and calls `on_closed()` once, instead of killing the process (run.output_guard)."""
    _on_closed[0] = on_closed
    guard_std_streams(lambda: _on_closed[0]())


def setup_logging(run_dir: str, rank: int) -> None:
    """Log to RUN_DIR/logs/rank{r}.log, and send what native libraries write to stderr there
    too: NCCL's watchdog and gloo report a lost peer with pages of stack dumps, which belong in
    the rank's log; the terminal keeps hpcnft's own one-line reports (print_err)."""
    global _terminal
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, "logs", f"rank{rank}.log")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    if _terminal is None:
        sys.stderr.flush()
        _terminal = guard(os.fdopen(os.dup(2), "w", buffering=1), lambda: _on_closed[0]())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(fd, 2)
        os.close(fd)


def restore_stderr() -> None:
    """Undo setup_logging's diversion of stderr (a rank's run ends; the process may go on)."""
    global _terminal
    if _terminal is not None:
        sys.stderr.flush()
        os.dup2(_terminal.fileno(), 2)
        _terminal.close()
        _terminal = None


def progress_line(step: int, steps: int, m: dict[str, float], elapsed: float, first_step: int,
                  loss_key: str) -> str:
    """`step 3/10 | reward ... | <the algorithm's loss, LOSS_KEY> ... | grad_norm ... | ... s | ETA ...`"""
    loss = loss_key.removeprefix("train/")
    done = step - first_step + 1
    eta = elapsed / done * (steps - step)
    return (f"step {step}/{steps} | reward {m['rollout/reward/raw_mean']:.4f} ± {m['rollout/reward/raw_std']:.4f} "
            f"| {loss} {m['train/' + loss]:.4f} | grad_norm {m['train/grad_norm']:.3e} "
            f"| {m['perf/iteration_s']:.1f} s | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


def eval_line(step: int, m: dict[str, float]) -> str:
    """`eval at step 8 | pickscore 0.1234 ± 0.0567`: an evaluation's terms, as run.h5 has them."""
    terms = sorted(k[len("eval/"):-len("_mean")] for k in m if k.startswith("eval/") and k.endswith("_mean"))
    parts = [f"{t} {m[f'eval/{t}_mean']:.4f} ± {m.get(f'eval/{t}_std', float('nan')):.4f}" for t in terms]
    return f"eval at step {step} | " + " | ".join(parts)


def pass_line(p: int, first: int, last: int, reward: float, latest_eval: tuple[int, dict] | None) -> str:
    """`pass 1 over the prompts (steps 1-8) | reward -4.1020 | eval -4.0710 at step 8`: what the
    README's per-pass tables and `hpcnft plot --smooth epoch` show, as the run goes."""
    line = f"pass {p + 1} over the prompts (steps {first}-{last}) | reward {reward:.4f}"
    if latest_eval:
        step, m = latest_eval
        means = [f"{k[len('eval/'):-len('_mean')]} {v:.4f}" for k, v in sorted(m.items())
                 if k.startswith("eval/") and k.endswith("_mean")]
        line += f" | eval {', '.join(means)} at step {step}"
    return line


# What each kind's score is, for the line that says what the progress line's reward means
TERM_MEANING = {"pickscore": "PickScore", "hpsv2": "HPS v2.1", "clipscore": "CLIP score",
                "aesthetic": "LAION aesthetic", "jpeg_compressibility": "-JPEG kB", "jpeg_incompressibility": "JPEG kB",
                "remote": "remote"}


def reward_header(scale: float, terms) -> str:
    """`reward = 0.5 x hps (HPS v2.1) + 1 x small (-JPEG kB)`: the training reward the progress
    line's `reward` shows, from reward.scale and the training terms."""
    weighted = len(terms) > 1 or terms[0].weight != 1
    parts = [f"{f'{t.weight:g} x ' if weighted else ''}{t.name} ({TERM_MEANING.get(t.kind, t.kind)})" for t in terms]
    total = " + ".join(parts).replace("+ -", "- ")
    return f"reward = {total}" if scale == 1 else f"reward = {scale:g} x ({total})"


GIF_FRAME_MS = 62  # a video grid's frame time: Wan2.1's 16 frames a second


def save_grid(run_dir: str, step: int, images: torch.Tensor, prompts: list[str]) -> str:
    """samples/step_<k>.png: a column per prompt, headed by its text. Videos ([n, F, H, W, 3]):
    the grid of each frame in turn as an animation, samples/step_<k>.gif (PIL's GIF writer,
    looping), beside the PNG of their first frames; the trackers show the GIF (io/trackers.py)."""
    from PIL import Image

    path = os.path.join(run_dir, "samples", f"step_{step:06d}.png")
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if images.dim() == 5:
            frames = [Image.fromarray(prompt_grid(images[:, f].numpy(), prompts)) for f in range(images.shape[1])]
            frames[0].save(path)
            gif = path[:-len(".png")] + ".gif"
            frames[0].save(gif, save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)
            return path
        Image.fromarray(prompt_grid(images.numpy(), prompts)).save(path)
    except OSError as e:  # a write's own error names no file (a full disk: "[Errno 28]")
        raise OSError(e.errno, f"{path}: cannot write the sample grid ({e.strerror or e})") from None
    return path


def fail_line(topo, e: BaseException) -> str:
    # c10d prefixes NCCL's reason with the C++ source line that raised it; the reason is what counts
    first = re.sub(r"NCCL error in: \S+:\d+, ", "NCCL error: ", first_line(e))
    hosts = list(getattr(topo, "hosts", None) or [])
    if len(set(hosts)) < 2:  # one node: the host says nothing
        return f"rank {topo.rank} ({topo.role}): {type(e).__name__}: {first}"
    # across nodes: this rank's host, and the rank and host behind a peer address gloo names
    peers = netif.peers_named(first, hosts)
    lost = f" [peer: {peers}]" if peers else ""
    return f"rank {topo.rank} ({topo.role}) on {hosts[topo.rank]}: {type(e).__name__}: {first}{lost}"


def print_err(line: str) -> None:
    print(f"hpcnft: {line}", file=_terminal or sys.stderr, flush=True)


def log_exception(topo, e: BaseException) -> None:
    log.error("%s\n%s", fail_line(topo, e), traceback.format_exc())


# A reward-service error that relays another rank's failure, or says the connection to it is gone
RELAYED = ("reward rank ", "train rank ", "lost the connection", "no request from train ranks")


def is_consequence(e: BaseException) -> bool:
    """Whether a rank's error only follows from another rank's failure: a peer gone, or a
    failure relayed by the reward service."""
    from hpcnft.distributed.reward_service import RewardServiceError

    text = first_line(e)
    return netif.names_a_lost_peer(text) or (isinstance(e, RewardServiceError) and text.startswith(RELAYED))


def claim_first_failure(run_dir: str, rank: int, e: BaseException) -> bool:
    """Claim the job's first failure for this rank's error `e` (failures.py): an error that only
    follows from another rank's waits a moment for the cause to claim first."""
    claim = FailureClaim(run_dir)
    if is_consequence(e):
        claim.wait_for_holder(CONSEQUENCE_WAIT_S)
    return claim.claim(rank)


def report_failure(topo, run_dir: str, e: BaseException, where: str = "") -> None:
    """A rank's failure: its traceback to its log; its line to the terminal if it is the job's
    first failure, else to its log only. `where`: a pointer added to the line (its traceback)."""
    log_exception(topo, e)
    if claim_first_failure(run_dir, topo.rank, e):
        print_err(fail_line(topo, e) + where)
    else:
        log.error("after rank %s's failure: %s", FailureClaim(run_dir).holder(), fail_line(topo, e))


def truncation_warning(cfg, tr) -> str:
    """How many of the run's prompts (train and evaluated) the text encoders will cut, and where;
    "" when none. `tr`: the train rank's parts (its pipeline and prompt lists)."""
    from hpcnft.algo.sampler import truncated_prompts

    n_eval = min(cfg.eval.num_prompts or len(tr.eval_prompts), len(tr.eval_prompts))
    prompts = tr.stream.prompts + tr.eval_prompts[:n_eval]
    n_cut, by_encoder = truncated_prompts(tr.pipe, prompts, cfg.rollout.max_sequence_length)
    if not n_cut:
        return ""
    limits = {"CLIP": f"{tr.pipe.tokenizer_max_length} tokens"}  # T5, Qwen2.5-VL: rollout.max_sequence_length
    msl = f"rollout.max_sequence_length = {cfg.rollout.max_sequence_length} tokens"
    detail = ", ".join(f"{name} cuts {n} (over {limits.get(name, msl)})" for name, n in by_encoder.items() if n)
    return (f"{n_cut} of {len(prompts)} prompts (train and eval) are longer than the text encoders take and are "
            f"truncated: {detail}")


def steps_text(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"
