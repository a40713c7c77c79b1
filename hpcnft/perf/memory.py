"""What fits a GPU: the settings `hpcnft bench --memory-cap-gib` measured for each real model
(random weights at the real shapes, the whole iteration under a per-process memory cap), and
the check of `perf.memory_budget_gib` against them, made before any model loads.

A rung is one set of memory settings (batch sizes, checkpointing, where the text encoders
live, the VAE's slices) with what it measured: its peak and its iteration time. The rungs of a
model run from the fastest to the smallest. The bench's iteration is one GPU doing everything
(world 1, PickScore beside the DiT): a train rank of the 2+1 layout holds less (no reward model;
FSDP2 shards the DiT over the train ranks), so a rung's peak bounds it from above.

Memory grows with every setting in one direction (bigger batches and slices, no checkpointing,
encoders resident, FSDP2's shards on the GPU, a half-precision base, a full fine-tune), so
settings that are at least a rung's in every one need at least that rung's measured peak: that
is what refuses a config. Settings that match no rung and exceed none over the budget are not
known to fit: a note says so and names the rung that does.
Pure functions; the measurements (memory_rungs.json) are the bench JSONs' under docs/bench/, test-checked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

MEMORY_KEYS = ("rollout.batch_size", "train.micro_batch", "perf.old_pass_batch", "perf.vae_decode_batch",
               "train.grad_checkpointing", "perf.text_encoders", "perf.fsdp_cpu_offload", "perf.base_fp8_storage",
               "train.finetune", "rollout.height", "rollout.width", "rollout.max_sequence_length")


@dataclass(frozen=True)
class Rung:
    model: str  # sd35m, sd35l, flux1dev (hpcnft bench --shapes)
    card_gib: int  # the card it is for: the cap it was measured under
    recipe: str  # the recipe that carries these settings
    settings: dict = field(hash=False)  # memory keys (MEMORY_KEYS) -> value; the rest is the recipe's
    peak_gib: float | None = None  # torch.cuda.max_memory_allocated over the measured iteration
    iteration_s: float | None = None
    source: str = ""  # docs/bench/<file>.json


_SHAPE = {"rollout.height": 512, "rollout.width": 512, "rollout.max_sequence_length": 256, "train.finetune": "lora"}
_FAST = {"perf.text_encoders": "device", "perf.vae_decode_batch": 0, "train.grad_checkpointing": False,
         "perf.fsdp_cpu_offload": False, "perf.base_fp8_storage": False}

# SD3.5-Medium + PickScore (the sd35m_pickscore recipe: 64 samples x 10 steps, 512², LoRA r32), with
# hpcnft.perf.levers.FAST's speed levers; fastest first. Measured values: see MEASURED below.
SD35M = (
    Rung("sd35m", 80, "sd35m_pickscore_80gb", {**_SHAPE, **_FAST, "rollout.batch_size": 32, "train.micro_batch": 32,
                                               "perf.old_pass_batch": 32}),
    Rung("sd35m", 48, "sd35m_pickscore_48gb", {**_SHAPE, **_FAST, "rollout.batch_size": 16, "train.micro_batch": 16,
                                               "perf.old_pass_batch": 16, "perf.text_encoders": "offload"}),
    Rung("sd35m", 40, "sd35m_pickscore_40gb", {**_SHAPE, **_FAST, "rollout.batch_size": 16, "train.micro_batch": 8,
                                               "perf.old_pass_batch": 16, "perf.text_encoders": "offload"}),
    Rung("sd35m", 24, "sd35m_pickscore_24gb", {**_SHAPE, **_FAST, "rollout.batch_size": 16, "train.micro_batch": 8,
                                               "perf.old_pass_batch": 8, "perf.text_encoders": "offload",
                                               "perf.vae_decode_batch": 8}),
)
CANDIDATES = {"sd35m": SD35M}
# {model: {card: {peak_gib, iteration_s, source}}}, from the bench's JSONs under docs/bench/
MEASURED = os.path.join(os.path.dirname(__file__), "memory_rungs.json")


def with_measurements(candidates: dict, measured: dict) -> dict[str, tuple[Rung, ...]]:
    """The candidate rungs with what was measured for each (by model and card)."""
    out = {}
    for model, rungs in candidates.items():
        got = measured.get(model, {})
        out[model] = tuple(Rung(r.model, r.card_gib, r.recipe, r.settings, **got[str(r.card_gib)])
                           if str(r.card_gib) in got else r for r in rungs)
    return out


def _measured() -> dict:
    try:
        with open(MEASURED) as f:
            return json.load(f)
    except OSError:
        return {}


def rungs(model: str) -> tuple[Rung, ...]:
    return with_measurements(CANDIDATES, _measured()).get(model, ())


def settings_of(cfg) -> dict:
    """The config's value of every memory key."""
    out = {}
    for key in MEMORY_KEYS:
        section, name = key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    return out


def _effective(s: dict) -> dict:
    """0 means "as big as it goes": v_old per micro-batch, the VAE at the rollout batch."""
    s = dict(s)
    s["perf.old_pass_batch"] = s["perf.old_pass_batch"] or s["train.micro_batch"]
    s["perf.vae_decode_batch"] = min(s["perf.vae_decode_batch"] or s["rollout.batch_size"], s["rollout.batch_size"])
    return s


def needs_at_least(settings: dict, rung: Rung) -> bool:
    """Whether `settings` use at least as much memory as `rung`'s in every respect."""
    a, b = _effective(settings), _effective(rung.settings)
    numeric = ("rollout.batch_size", "train.micro_batch", "perf.old_pass_batch", "perf.vae_decode_batch",
               "rollout.height", "rollout.width", "rollout.max_sequence_length")
    return (all(a[k] >= b[k] for k in numeric)
            and (not a["train.grad_checkpointing"] or b["train.grad_checkpointing"])
            and (a["perf.text_encoders"] == "device" or b["perf.text_encoders"] == "offload")
            and (not a["perf.fsdp_cpu_offload"] or b["perf.fsdp_cpu_offload"])
            and (not a["perf.base_fp8_storage"] or b["perf.base_fp8_storage"])
            and (a["train.finetune"] == "full" or b["train.finetune"] == "lora"))


def fastest_within(ladder: tuple[Rung, ...], budget_gib: float) -> Rung | None:
    """The first (fastest) measured rung proven within the budget: one that ran under a cap no
    larger than it (a low peak under a larger cap does not show that the allocator manages in less)."""
    return next((r for r in ladder if r.peak_gib is not None and r.card_gib <= budget_gib), None)


def _describe(r: Rung) -> str:
    return f"recipe {r.recipe}: {r.peak_gib:.1f} GiB, {r.iteration_s:.1f} s per iteration"


def check_budget(settings: dict, model: str, budget_gib: float, ladder: tuple[Rung, ...]) -> tuple[str, str]:
    """(refusal, note) for perf.memory_budget_gib = budget_gib: a refusal (one line) where the
    settings cannot fit, else a note where the check cannot tell (""s where there is nothing to say)."""
    key = f"perf.memory_budget_gib = {budget_gib:g}"
    measured = [r for r in ladder if r.peak_gib is not None]
    if not measured:
        return "", f"{key}: no measured settings for {model}: the budget is not checked"
    fits = fastest_within(ladder, budget_gib)
    smallest = min(measured, key=lambda r: (r.card_gib, r.peak_gib))
    if fits is None:
        return (f"{key}: no {model} setting was measured within {budget_gib:g} GiB per GPU; the smallest measured "
                f"need is a {smallest.card_gib} GiB cap ({smallest.recipe}, peak {smallest.peak_gib:.1f} GiB)"), ""
    over = [r for r in measured if r.peak_gib > budget_gib and needs_at_least(settings, r)]
    if over:
        worst = max(over, key=lambda r: r.peak_gib)
        same = "these settings measured" if _effective(settings) == _effective(worst.settings) else \
            f"these settings need at least what {worst.recipe}'s measured,"
        return (f"{key}: {same} {worst.peak_gib:.1f} GiB per GPU; within {budget_gib:g} GiB: {_describe(fits)}"), ""
    if any(_effective(settings) == _effective(r.settings) for r in measured):
        return "", ""
    return "", (f"{key}: these {model} settings were not measured; the fastest measured within the budget is "
                f"{_describe(fits)}")
