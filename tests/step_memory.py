"""Peak resident memory of one Trainer.step, measured in a process of its own.

`python tests/step_memory.py SIZE SAMPLES:MICRO_BATCH ...` builds the tiny DiT's policy and
trainer as the job does at world 1 (LoRA, FSDP2 over a one-rank gloo mesh, fp32 on the CPU) for
SIZE² images, runs a warm-up step of one sample, then one step for each case on random rollout tensors, and
prints one JSON list: per case the growth of the peak resident set during the step over the
resident set before it (bytes).

glibc would keep freed blocks for reuse and raise its mmap threshold as large blocks come and
go, so the resident set would follow the allocator's history; a fixed 64 KiB threshold maps every
larger block on its own and unmaps it on free, so the resident set follows the live tensors.
The peak is the kernel's high-water mark (VmHWM), reset before each step (/proc/self/clear_refs)."""
from __future__ import annotations

import ctypes
import json
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also turns off the dynamic threshold


def kernel_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak resident set size to the current one


def main(size: int, cases: list[tuple[int, int]]) -> list[dict]:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    import torch
    from diffusers import SD3Transformer2DModel

    from hpcnft.algo.nft.pairs import PairBatch
    from hpcnft.algo.policy import Policy
    from hpcnft.algo.root_config import load_config
    from hpcnft.algo.sampler import sigma_grid
    from hpcnft.algo.nft.trainer import Trainer
    from hpcnft.bench.shapes import scheduler, world1_mesh
    from hpcnft.models.tiny import TINY_TRANSFORMER

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    cfg = load_config("tiny", [f"rollout.height={size}", f"rollout.width={size}", "layout.train_ranks=1",
                               "layout.reward_ranks=0"])
    torch.manual_seed(0)
    policy = Policy(cfg, SD3Transformer2DModel(**TINY_TRANSFORMER), dev, world1_mesh(dev))
    trainer = Trainer(cfg, policy, None, 1)
    sigmas = sigma_grid(scheduler(), cfg.rollout.num_steps)
    latent = (TINY_TRANSFORMER["in_channels"], size // 8, size // 8)
    k = cfg.trained_steps

    def batch(n: int) -> PairBatch:
        g = torch.Generator().manual_seed(n)
        return PairBatch(torch.randn(n, *latent, generator=g),
                         torch.randn(n, cfg.rollout.max_sequence_length, TINY_TRANSFORMER["joint_attention_dim"],
                                     generator=g),
                         torch.randn(n, TINY_TRANSFORMER["pooled_projection_dim"], generator=g),
                         torch.randn(n, dtype=torch.float64, generator=g),
                         torch.rand(n, dtype=torch.float64, generator=g), list(range(n)), n * k)

    def peak_growth(n: int, micro_batch: int, step: int) -> int:
        b = batch(n)
        cfg.train.micro_batch = micro_batch
        reset_peak()
        before = kernel_bytes("VmRSS")
        trainer.step(b, sigmas, step)
        return kernel_bytes("VmHWM") - before

    peak_growth(1, cases[0][1], 1)  # warm-up: the optimizer's state, lazy initialisations
    out = []
    for n, m in cases:
        out.append({"samples": n, "micro_batch": m, "peak_growth": peak_growth(n, m, 2)})
    return out


if __name__ == "__main__":
    cases = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[2:]]
    print(json.dumps(main(int(sys.argv[1]), cases)))
