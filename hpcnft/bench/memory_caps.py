"""`hpcnft bench --memory-cap-gib N[,N...]`: after the uncapped fast stack, the same phases and
whole iteration with the process capped at N GiB (torch.cuda.set_per_process_memory_fraction:
past it the caching allocator raises out-of-memory, as a card of N GiB would), once per cap.

The settings are the cap's rung in hpcnft.perf.memory (the fastest candidate for a card of at
most N GiB; a rung that runs out of memory gives way to the next smaller one, each attempt
recorded), on top of the fast stack's levers; a model with no rungs keeps the fast settings
(--set changes them); its DiT is built in host memory and cast (and stored) there before it
moves, as a run loads it. Each attempt's record carries `memory_cap_gib`, the settings, whether it
fitted, the cap applied (a cap up to 2 GiB over the device runs at all of it: an "80 GB" card),
its peak over the whole attempt (models built, warm-up and timed iterations) and its
iteration time; doc["memory_caps"] sums them up per cap."""
from __future__ import annotations

from hpcnft.bench.shapes import _torch
from hpcnft.bench.stack import HpcnftStack
from hpcnft.bench.timing import high_water_gib, start_high_water
from hpcnft.common.errors import UsageError


def parse_caps(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--memory-cap-gib {text!r}: expected GiB numbers such as 24 or 24,40,80") from None
    if not caps or any(c <= 0 for c in caps):
        raise UsageError(f"--memory-cap-gib {text!r}: expected positive GiB numbers such as 24 or 24,40,80")
    return caps


def attempts_for(model: str, cap: float) -> list:
    """The rungs to try under `cap`, fastest first: those for a card no bigger than it; [None]
    (the fast settings) for a model without rungs."""
    from hpcnft.perf import memory

    ladder = [r for r in memory.CANDIDATES.get(model, ()) if r.card_gib <= cap]
    return ladder or ([None] if model not in memory.CANDIDATES else [])


def _fitted(rec: dict, wanted: list[str]) -> bool:
    phases = rec["phases"]
    return all(name in phases and "error" not in phases[name] for name in wanted)


def run_caps(bench, caps: list[float], fast_over: dict, real_text: bool) -> None:
    torch = _torch()
    S, dev = bench.S, bench.dev
    if dev.type != "cuda":
        raise UsageError("--memory-cap-gib caps GPU memory and needs a CUDA device")
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30
    summary = bench.doc.setdefault("memory_caps", [])
    for cap in caps:
        # A card sold as N GB holds about N GiB less the driver's share (an 80 GB H100: 79.1 GiB):
        # a cap within 2 GiB over the device is that card, run at all of it; past that it is skipped.
        if cap > total + 2:
            bench.doc["skipped"].append(f"memory cap {cap:g} GiB (the device has {total:.1f} GiB)")
            continue
        applied = min(cap, total)
        tried = attempts_for(S.name, cap)
        if not tried:
            bench.doc["skipped"].append(f"memory cap {cap:g} GiB: no {S.name} rung for a card this small")
        for rung in tried:
            if bench.over_budget():
                bench.doc["skipped"].append(f"memory cap {cap:g} GiB (budget)")
                break
            settings = dict(rung.settings) if rung else {}
            over = {**fast_over, **{k: v for k, v in settings.items() if not k.startswith("rollout.")
                                    or k == "rollout.batch_size"}}
            b, mb = int(over.get("rollout.batch_size", max(S.rollout_batches))), int(over.get("train.micro_batch",
                                                                                                max(S.micro_batches)))
            name = f"cap{cap:g}" + (f":{rung.recipe}" if rung else "")
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(applied / total, dev)
            start_high_water(dev)
            stack = HpcnftStack(name, f"hpcnft fast under a {cap:g} GiB cap", S, dev, over, real_text=real_text,
                                host_build=True)
            # what a card needs, not what counting FLOPs needs (an eager pass: Bench.flops_of); the
            # uncapped fast stack's counts are those of the same phases
            stack.count_flops = False
            phases = bench.phases_for(stack, [b], [mb])
            iteration = bench.iteration_for("fast")
            rec = bench.run_stack(stack, phases, iteration, {"rollout_batch": b, "micro_batch": mb})
            wanted = [p[0] for p in phases] + (["iteration"] if iteration else [])
            fits = _fitted(rec, wanted)
            whole = high_water_gib(dev)
            it = rec["phases"].get("iteration", {})
            entry = {"memory_cap_gib": cap, "cap_applied_gib": round(applied, 3), "stack": name,
                     "recipe": rung.recipe if rung else "", "settings": settings, "overrides": over, "fits": fits,
                     "peak_gib": round(whole, 3),
                     "iteration_s": it.get("s"), "real_text_encoders": real_text}
            rec.update({k: v for k, v in entry.items() if k not in ("stack", "overrides")})
            summary.append(entry)
            bench.log(f"cap {cap:g} GiB, {name}: {'fits' if fits else 'does not fit'}, peak {whole:.1f} GiB"
                      + (f", iteration {it['s']:.2f} s" if it.get("s") else ""))
            bench.free(stack)
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
            bench.save()
            if fits:
                break
