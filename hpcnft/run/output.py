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

log = logging.getLogger("hpcnft")


_terminal = None  # the rank's original stderr, once native output goes to its log


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
        _terminal = os.fdopen(os.dup(2), "w", buffering=1)
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


def progress_line(step: int, steps: int, m: dict[str, float], elapsed: float, first_step: int) -> str:
    done = step - first_step + 1
    eta = elapsed / done * (steps - step)
    return (f"step {step}/{steps} | reward {m['rollout/reward/raw_mean']:.4f} ± {m['rollout/reward/raw_std']:.4f} "
            f"| nft_loss {m['train/nft_loss']:.4f} | grad_norm {m['train/grad_norm']:.3e} "
            f"| {m['perf/iteration_s']:.1f} s | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


def save_grid(run_dir: str, step: int, images: torch.Tensor, prompts: list[str]) -> str:
    """samples/step_<k>.png: a column per prompt, headed by its text."""
    from PIL import Image

    os.makedirs(os.path.join(run_dir, "samples"), mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, "samples", f"step_{step:06d}.png")
    Image.fromarray(prompt_grid(images.numpy(), prompts)).save(path)
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
