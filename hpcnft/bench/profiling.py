"""--profile: torch.profiler over one call of a phase; its op table, a summary by kernel kind and the
totals of the package's named ranges (hpcnft.perf.mfu.span)."""
from __future__ import annotations

import bisect
import os
import time

from hpcnft.bench.timing import sync

CATEGORIES = ("gemm", "attention_fwd", "attention_bwd", "triton", "other")
# lower-case name fragments, tested in the order triton, attention, gemm: inductor names its
# kernels after the ops they fuse ("triton_poi_fused__scaled_dot_product_flash_attention_0"), and
# attention kernels can say "cutlass" ("fmha_cutlassF_f16_aligned_64x64_rf_sm80")
ATTENTION = ("flash_", "fmha", "attention", "sdpa")
BACKWARD = ("bwd", "backward", "bprop", "cutlassb")  # cuDNN SDPA says fprop/bprop, mem-efficient cutlassF/B
GEMM = ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet")
TOP_OPS = 15
# What the profiler lists among device events but are not kernels: "Command Buffer Full" marks
# the time a launch waited for room in a full launch queue (the CPU is ahead: GPU-bound); named
# ranges (record_function, hpcnft.perf.mfu.span) are also drawn on the GPU timeline, as user annotations.
NOT_KERNELS = ("Command Buffer Full",)
# The CUDA runtime and driver calls among the host events: in an idle gap they are the launch that
# ends it, not what kept the host busy.
RUNTIME_CALLS = ("cuda", "cuLaunch", "cuMem", "cuStream", "cuEvent")


def kernel_category(name: str) -> str:
    """The category of one device kernel, from its name."""
    n = name.lower()
    if n.startswith("triton_"):
        return "triton"
    if any(k in n for k in ATTENTION):
        return "attention_bwd" if any(k in n for k in BACKWARD) else "attention_fwd"
    if any(k in n for k in GEMM):
        return "gemm"
    return "other"


def categorize(kernels) -> dict:
    """(name, seconds) pairs -> {"total_s", "categories": {category: {"s", "share"}}}."""
    sums = dict.fromkeys(CATEGORIES, 0.0)
    for name, s in kernels:
        sums[kernel_category(name)] += s
    total = sum(sums.values())
    return {"total_s": total,
            "categories": {c: {"s": v, "share": v / total if total > 0 else 0.0} for c, v in sums.items()}}


def idle_gaps(kernels, host, min_gap_s: float = 2e-4, top: int = 12, prefix: str = "hpcnft/") -> dict:
    """Where the device had no kernel to run. `kernels`: (start_s, end_s, name) of the device's
    kernels (streams merged); `host`: (start_s, end_s, name) of the host's ranges on the same
    clock, the package's named ranges (`prefix`) and the ops. Every gap is charged to the
    innermost named range open at its middle (`by_span`: all gaps, and those of at least
    `min_gap_s`); each of those long ones also to the innermost op open then, in `top`: what the
    host was doing while the device waited (host work after a sync, a launch-bound loop)."""
    busy = sorted(kernels)
    spans = _Ranges([h for h in host if h[2].startswith(prefix)])
    ops = _Ranges([h for h in host if not h[2].startswith(prefix)])
    gaps, by_span, every, end, last = [], {}, 0.0, None, None
    for s, e, n in busy:
        if end is not None and s > end:
            every += s - end
            mid = (end + s) / 2
            span = spans.innermost(mid).removeprefix(prefix)
            rec = by_span.setdefault(span, {"gaps": 0, "s": 0.0, "long_gaps": 0, "long_s": 0.0})
            rec["gaps"] += 1
            rec["s"] += s - end
            if s - end >= min_gap_s:
                rec["long_gaps"] += 1
                rec["long_s"] += s - end
                gaps.append({"s": s - end, "at_s": end - busy[0][0], "span": span, "host_op": ops.innermost(mid),
                             "after": last, "before": n})
        if end is None or e > end:
            end, last = e, n
    return {"every_gap_s": every, "min_gap_s": min_gap_s, "total_s": sum(g["s"] for g in gaps), "gaps": len(gaps),
            "by_span": dict(sorted(by_span.items(), key=lambda kv: -kv[1]["s"])),
            "top": sorted(gaps, key=lambda g: -g["s"])[:top]}


class _Ranges:
    """Host ranges sorted by start, for 'which range was open at t' (the innermost: the one open
    at t that started last; a bounded scan back, so a profile of a whole iteration stays quick)."""

    def __init__(self, ranges, scan: int = 20000):
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]
        self.scan = scan

    def innermost(self, t: float) -> str:
        i = bisect.bisect_right(self.starts, t)
        for j in range(i - 1, max(-1, i - 1 - self.scan), -1):
            if self.ranges[j][1] >= t:
                return self.ranges[j][2]
        return "-"


def top_kernels(kernels, n: int = 30) -> list[dict]:
    """The `n` kernel names with the most device time: (name, seconds) pairs summed by name."""
    sums: dict = {}
    for name, s in kernels:
        rec = sums.setdefault(name, [0, 0.0])
        rec[0] += 1
        rec[1] += s
    total = sum(v[1] for v in sums.values())
    top = sorted(sums.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k, "calls": c, "s": s, "share": s / total if total > 0 else 0.0} for k, (c, s) in top]


def _timeline(prof) -> tuple[list, list]:
    """(kernels, host ranges) of a profile as (start_s, end_s, name), one clock. Kernels are every
    device-side event (kernels, memcpy, memset) but the launch queue's waits and named ranges."""
    from torch.autograd import DeviceType

    kernels, host = [], []
    for e in prof.events():
        rng = (e.time_range.start / 1e6, e.time_range.end / 1e6, e.name)
        if e.device_type == DeviceType.CUDA:
            if e.name not in NOT_KERNELS and not getattr(e, "is_user_annotation", False):
                kernels.append(rng)
        elif e.device_type == DeviceType.CPU and not e.name.startswith(RUNTIME_CALLS):
            host.append(rng)
    return kernels, host


def _top_cpu_ops(prof, n: int = TOP_OPS) -> tuple[float, list[dict]]:
    avgs = list(prof.key_averages())
    total = sum(a.self_cpu_time_total for a in avgs) / 1e6
    top = sorted(avgs, key=lambda a: a.self_cpu_time_total, reverse=True)[:n]
    return total, [{"name": a.key, "calls": a.count, "self_s": a.self_cpu_time_total / 1e6,
                    "share": a.self_cpu_time_total / 1e6 / total if total > 0 else 0.0} for a in top]


def _device_us(a) -> float:
    us = getattr(a, "device_time_total", None)
    return getattr(a, "cuda_time_total", 0.0) if us is None else us  # older torch: cuda_time_total


def spans(averages, prefix: str = "hpcnft/") -> dict:
    """Totals of each named range `hpcnft/...` (hpcnft.perf.mfu.span) in a profile's key_averages():
    calls, host seconds, and device seconds. On a GPU the profiler lists a range twice: on the
    host (whose device total also counts the launch queue's waits) and as drawn on the GPU's
    timeline (no host time), which gives device_s when present."""
    out, on_gpu_timeline = {}, set()
    for a in averages:
        if not a.key.startswith(prefix):
            continue
        name = a.key[len(prefix):]
        rec = out.setdefault(name, {"calls": 0, "cpu_s": 0.0, "device_s": 0.0})
        rec["calls"] = max(rec["calls"], a.count)
        if a.cpu_time_total > 0:
            rec["cpu_s"] = a.cpu_time_total / 1e6
            if name not in on_gpu_timeline:
                rec["device_s"] = _device_us(a) / 1e6
        else:
            rec["device_s"] = _device_us(a) / 1e6
            on_gpu_timeline.add(name)
    return out


def profile_call(fn, ctx, dev, path: str) -> dict:
    """Profile one call of `fn` under `ctx()` (after one more untimed call, so nothing compiles
    inside), write the op table to `path` and return the summary."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with ctx():
        fn()
        sync(dev)
        with profile(activities=activities, acc_events=True) as prof:  # one cycle: no warning about clearing
            t0 = time.perf_counter()
            fn()
            sync(dev)
            wall = time.perf_counter() - t0  # includes the profiler's own overhead
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(table + "\n")
    out = {"device": dev.type, "wall_s": wall, "table": path, "spans": spans(prof.key_averages())}
    if cuda:
        timeline, host = _timeline(prof)  # one pass: an iteration's profile has ~10^6 events
        kernels = [(name, end - start) for start, end, name in timeline]
        cat = categorize(kernels)
        # busy time = the sum of kernel durations: kernels that overlap (several streams) are
        # counted twice, so the idle share is approximate (and clamped at 0)
        out.update(device_time_s=cat["total_s"], kernels=len(kernels), categories=cat["categories"],
                   device_idle_share=max(0.0, 1.0 - cat["total_s"] / wall) if wall > 0 else None,
                   top_kernels=top_kernels(kernels), idle=idle_gaps(timeline, host))
    else:
        total, top = _top_cpu_ops(prof)
        out.update(cpu_self_time_s=total, top_ops=top)
    return out
