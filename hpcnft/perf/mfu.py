"""Throughput accounting for perf/* metrics: FLOPs counted with FlopCounterMode's formulas over real work,
against a matmul ceiling measured on this rank's device."""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode


def time_calls(fn, device: torch.device, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn` (CUDA events on a GPU, wall clock elsewhere)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int | None = None, warm: int = 3,
                   reps: int | None = None) -> dict:
    """Achieved FLOP/s of an n x n x n dense matmul: the median of `reps` timed calls after `warm`.
    Returns {"flops_per_s", "n", "dtype", "s", "runs_s"}. Seeded inputs from a private generator,
    so the global RNG streams are left alone."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)
    reps = reps or (10 if cuda else 3)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warm):
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    times = time_calls(lambda: a @ b, device, reps)
    s = statistics.median(times)
    return {"flops_per_s": 2 * n**3 / s, "n": n, "dtype": str(dtype).removeprefix("torch."), "s": s,
            "runs_s": times}


def matmul_ceiling(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved FLOP/s of a large dense matmul here: the denominator of MFU (fp32 on a CPU)."""
    return measure_matmul(device, dtype if device.type == "cuda" else torch.float32)["flops_per_s"]


class _TotalFlopCounter(FlopCounterMode):
    """FlopCounterMode without its per-module breakdown (only the total is read): the module
    tracker behind that breakdown holds each checkpointed block's recomputed tensors until the
    count ends, so a counted backward grows by a block's activations per block
    (tests/unit/perf/test_mfu.py). Every count lands on the tracker's root, "Global"."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        done = self.mode.__exit__(*exc)
        self.mode = None
        return done


class FlopCount:
    """`with counter:` counts the FLOPs of everything inside (dispatch level, so backward too),
    in the memory the counted work itself takes."""

    def __init__(self):
        self.mode = _TotalFlopCounter(display=False)
        self.total = 0

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.total = self.mode.get_total_flops()
        return False


def mfu(flops: float, seconds: float, ceiling: float) -> float:
    return flops / max(seconds, 1e-12) / ceiling


def span(name: str):
    """A named range `hpcnft/<name>` for torch.profiler (hpcnft bench --profile sums the time of
    each range, host and device); a few microseconds when no profiler runs."""
    return torch.profiler.record_function(f"hpcnft/{name}")
