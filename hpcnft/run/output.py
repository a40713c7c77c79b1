"""What a rank tells: its log file, the progress line, sample grids, and failures as one line
naming the rank and its reason."""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import torch

from hpcnft.algo.sampler import image_grid
from hpcnft.common.errors import one_line

log = logging.getLogger("hpcnft")


def setup_logging(run_dir: str, rank: int) -> None:
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700, exist_ok=True)
    handler = logging.FileHandler(os.path.join(run_dir, "logs", f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def progress_line(step: int, steps: int, m: dict[str, float], elapsed: float, first_step: int) -> str:
    done = step - first_step + 1
    eta = elapsed / done * (steps - step)
    return (f"step {step}/{steps} | reward {m['rollout/reward/raw_mean']:.4f} ± {m['rollout/reward/raw_std']:.4f} "
            f"| nft_loss {m['train/nft_loss']:.4f} | grad_norm {m['train/grad_norm']:.3e} "
            f"| {m['perf/iteration_s']:.1f} s | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


def save_grid(run_dir: str, step: int, images: torch.Tensor, n: int) -> str:
    from PIL import Image

    os.makedirs(os.path.join(run_dir, "samples"), mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, "samples", f"step_{step:06d}.png")
    Image.fromarray(image_grid(images[:n].numpy())).save(path)
    return path


def fail_line(topo, e: BaseException) -> str:
    return f"rank {topo.rank} ({topo.role}): {one_line(e)}"


def print_err(line: str) -> None:
    print(f"hpcnft: {line}", file=sys.stderr, flush=True)


def log_exception(topo, e: BaseException) -> None:
    log.error("%s\n%s", fail_line(topo, e), traceback.format_exc())
