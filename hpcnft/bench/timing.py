"""Timing, FLOP counting and the matmul ceiling of the bench (timing and ceiling: hpcnft.perf.mfu)."""
from __future__ import annotations

import contextlib
import statistics

from hpcnft.bench.shapes import _torch


def sync(dev) -> None:
    torch = _torch()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reset_peak_rss() -> bool:
    """Linux: make the process's peak resident set size its current one (clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_gib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return None


# The allocator's peak folded in before each reset, since start_high_water: a phase's reset
# for its own reading must not lose what an earlier phase, a build or a warm-up reached.
_HIGH_WATER = [0]


def reset_peak(dev) -> None:
    torch = _torch()
    _HIGH_WATER[0] = max(_HIGH_WATER[0], torch.cuda.max_memory_allocated(dev))
    torch.cuda.reset_peak_memory_stats(dev)


def start_high_water(dev) -> None:
    """From now on high_water_gib covers everything: builds, warm-ups and timed calls."""
    _torch().cuda.reset_peak_memory_stats(dev)
    _HIGH_WATER[0] = 0


def high_water_gib(dev) -> float:
    return max(_HIGH_WATER[0], _torch().cuda.max_memory_allocated(dev)) / 2**30


def measure(fn, dev, warm: int, reps: int) -> dict:
    """Median seconds of `fn` after `warm` calls (CUDA events on a GPU), and the peak memory
    during the timed calls: on a GPU what the caching allocator handed out (`peak_gib`; over the
    warm-up calls, which compile, `warm_peak_gib`), on a CPU (Linux) the process's peak resident
    set (`peak_rss_gib`: Python and the libraries too)."""
    torch = _torch()
    from hpcnft.perf.mfu import time_calls

    cuda = dev.type == "cuda"
    if cuda:
        reset_peak(dev)
    for _ in range(warm):
        fn()
    sync(dev)
    rss = False
    if cuda:
        warm_peak = torch.cuda.max_memory_allocated(dev) / 2**30
        reset_peak(dev)
    else:
        rss = _reset_peak_rss()
    times = time_calls(fn, dev, reps)
    out = {"s": statistics.median(times), "runs_s": [round(t, 6) for t in times], "warm": warm}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        if warm:
            out["warm_peak_gib"] = warm_peak
    elif rss and (peak := _peak_rss_gib()) is not None:
        out["peak_rss_gib"] = peak
    return out


def count_flops(fn) -> int:
    """FLOPs of one call of `fn`, counted (hpcnft.perf.mfu.FlopCount) with compiled code run eagerly."""
    torch = _torch()
    from hpcnft.perf.mfu import FlopCount

    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
        else contextlib.nullcontext()
    with stance, FlopCount() as fc:
        fn()
    return int(fc.total)


def matmul_ceiling(dev, n: int) -> dict:
    """{"<dtype>_tflops": ...} of an n^3 dense matmul: fp16 and bf16 on a GPU, fp32 on a CPU."""
    torch = _torch()
    from hpcnft.perf.mfu import measure_matmul

    dtypes = (("fp16", torch.float16), ("bf16", torch.bfloat16)) if dev.type == "cuda" else (("fp32", torch.float32),)
    return {f"{name}_tflops": measure_matmul(dev, dt, n)["flops_per_s"] / 1e12 for name, dt in dtypes}
