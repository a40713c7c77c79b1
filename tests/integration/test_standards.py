"""Recorded standards: the tiny 3-rank job (fp32, and fp16 with its overflowing first step)
must reproduce the committed metric series, and a perturbed run must not.

The CPU's own kernels round by the machine: PyTorch's vectorized kernels follow the CPU's vector
ISA (`torch.backends.cpu.get_cpu_capability()`) and MKL its code path for the CPU's vendor, so a
tiny run's bits are the same on machines of one vendor and ISA, not across them. A machine whose
`<vendor>-<capability>` has a folder here (e.g. `AuthenticAMD-AVX2/`) is held to it exactly.

A machine of another kind cannot be held to anyone's bits. It is held instead to
  1. its own bits: the same command twice gives bit-identical metrics (every non-perf key), and
  2. the recorded standards (the top-level ones, recorded on the CI machines) within a tolerance
     derived from the measured spread between the recorded kinds: per key, SPREAD_FACTOR (10)
     times the largest difference between any two recorded kinds' values of that key, and at
     least FLOOR_ULPS (4) float32 ulps of the key's largest value (the metrics come out of float32
     arithmetic, so an unrecorded kind may move by rounding even a key the recorded kinds agree
     on). Measured between the top-level set and AuthenticAMD-AVX2, relative to each key's
     largest value: train/grad_norm 5.2e-4 (the largest: a small norm of nearly cancelling
     terms), the reward statistics and eval PickScore 3.5e-6 to 6.8e-5, the NFT losses 3.3e-8
     to 1.3e-6, everything else 0 or 1 ulp. So the tolerance is 5.2e-3 of its largest value
     for grad_norm, at most 6.8e-4 for every other key; a 1e-3 relative change of the standard
     fails on every key but grad_norm (test_a_standard_changed_by_1e-3_fails_the_tolerance).

HPCNFT_CPU_KIND=<vendor>-<capability> makes a machine take itself for that kind, e.g.
HPCNFT_CPU_KIND=GenuineIntel-AVX512 runs the second path on a machine that has standards.

Re-record (after a deliberate change of the numerics, or of the pinned libraries; writes this
machine's folder, which also makes it one of the kinds the tolerance is derived from):
    HPCNFT_RECORD_STANDARDS=1 python3 -m pytest tests/integration/test_standards.py
"""
from __future__ import annotations

import json
import os
import platform

import numpy as np
import pytest

from jobs import assert_same_metrics, hpcnft
from hpcnft.io.compare import compare_metrics
from hpcnft.cli.report import load_metrics

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
STANDARDS = os.path.join(HERE, "..", "standards")
RECORD = os.environ.get("HPCNFT_RECORD_STANDARDS") == "1"
SPREAD_FACTOR = 10.0
FLOOR_ULPS = 4
FLOAT32_ULP = float(np.finfo(np.float32).eps)


def cpu_kind() -> str:
    """<vendor>-<PyTorch CPU capability>, e.g. AuthenticAMD-AVX2: what the CPU kernels' rounding
    follows ($HPCNFT_CPU_KIND overrides it)."""
    if os.environ.get("HPCNFT_CPU_KIND"):
        return os.environ["HPCNFT_CPU_KIND"]
    import torch

    vendor = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def has_own_standards(name: str) -> bool:
    return os.path.exists(os.path.join(STANDARDS, cpu_kind(), name))


def standard_path(name: str) -> str:
    own = os.path.join(STANDARDS, cpu_kind(), name)
    return own if RECORD or os.path.exists(own) else os.path.join(STANDARDS, name)


def recorded_sets(name: str) -> dict[str, str]:
    """{kind: path} of every recorded copy of standard `name` ("" for the top-level one)."""
    found = {"": os.path.join(STANDARDS, name)}
    for kind in sorted(os.listdir(STANDARDS)):
        path = os.path.join(STANDARDS, kind, name)
        if os.path.isfile(path):
            found[kind] = path
    return found


def cross_kind_spread(name: str, keys: list[str]) -> dict[str, tuple[float, float]]:
    """{key: (largest |difference| between two recorded kinds, largest |value|)}, over the finite
    rows (a NaN is NaN on every kind: compare_metrics holds it exactly)."""
    sets = [load_metrics(p) for p in recorded_sets(name).values()]
    assert len(sets) >= 2, f"{name}: the spread needs standards of two CPU kinds"
    out = {}
    for key in keys:
        spread, scale = 0.0, 0.0
        for i, a in enumerate(sets):
            va = a[key][:, 1]
            finite = va[np.isfinite(va)]
            scale = max(scale, float(np.abs(finite).max()) if finite.size else 0.0)
            for b in sets[i + 1:]:
                assert np.array_equal(a[key][:, 0], b[key][:, 0]), key
                vb = b[key][:, 1]
                both = np.isfinite(va) & np.isfinite(vb)
                if both.any():
                    spread = max(spread, float(np.abs(va[both] - vb[both]).max()))
        out[key] = (spread, scale)
    return out


def tolerances(name: str, keys: list[str]) -> dict[str, float]:
    """{key: atol} for a machine of a kind without standards (see the module's docstring)."""
    return {k: max(SPREAD_FACTOR * spread, FLOOR_ULPS * FLOAT32_ULP * scale)
            for k, (spread, scale) in cross_kind_spread(name, keys).items()}


def outside_tolerance(run: dict, standard: dict, atols: dict[str, float]) -> list[str]:
    """One line per key whose series leaves its tolerance (compare's |a - b| <= atol), else []."""
    lines = []
    for key, atol in atols.items():
        result = compare_metrics(run, standard, [key], atol=atol)
        lines += [f"{d.key} at step {d.step:g}: {d.a!r} vs {d.b!r} (atol {atol:.3g}; {d.reason})"
                  for d in result.divergences]
    return lines


# What the test checks is this list, not whatever the standard holds (nft_spec.md §6's keys).
KEYS = ["rollout/reward/raw_num_samples", "rollout/reward/raw_mean", "rollout/reward/raw_median",
        "rollout/reward/raw_std", "train/grad_norm", "train/nft_loss", "train/nft_pos_loss",
        "train/nft_neg_loss", "train/nft_r_mean", "train/nft_t_mean", "train/step_skipped",
        "train/loss_scale", "eval/pickscore_mean"]


def check(run_dir: str, again: str | None, standard: str) -> None:
    """The finished run `run_dir` against its standard: exactly on a kind with its own, else
    `again` (the same command's second run, started only then) bit-identical to it and both
    within the cross-kind tolerance of the recorded ones."""
    path = standard_path(standard)
    if RECORD:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        hpcnft("compare", "--record", run_dir, path)
    if has_own_standards(standard):
        r = hpcnft("compare", run_dir, path, "--keys", *KEYS, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        return
    # A kind without standards: its own bits run to run, and the recorded ones within tolerance.
    assert_same_metrics(run_dir, again)
    off = outside_tolerance(load_metrics(run_dir), load_metrics(path), tolerances(standard, KEYS))
    assert off == [], f"{cpu_kind()} has no standards of its own; outside the cross-kind tolerance:\n" + "\n".join(off)


def test_tiny_three_ranks_matches_its_standard(tiny_run, request):
    """The shared tiny run is this standard's command (its checkpoint every step changes no metric)."""
    again = None if has_own_standards("tiny_3rank.json") else request.getfixturevalue("tiny_run_again").run_dir
    check(tiny_run.run_dir, again, "tiny_3rank.json")


def test_tiny_fp16_matches_its_standard_with_the_nan_step(tiny_fp16_run, tmp_path):
    again = None
    if not has_own_standards("tiny_fp16_3rank.json"):
        again = str(tmp_path / "again")
        hpcnft("run", "tiny_fp16", "--steps", "3", "--run-dir", again)
    check(tiny_fp16_run, again, "tiny_fp16_3rank.json")
    with open(standard_path("tiny_fp16_3rank.json")) as f:
        grad_norm = json.load(f)["metrics"]["train/grad_norm"]
    assert grad_norm[0] == [1, "NaN"]  # the overflowing first step, kept as NaN in the standard


def test_a_perturbed_run_fails_its_standard_naming_where(tmp_path):
    run_dir = str(tmp_path / "perturbed")
    hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, "--set", "optim.lr=0.004")
    if not has_own_standards("tiny_3rank.json"):
        off = outside_tolerance(load_metrics(run_dir), load_metrics(standard_path("tiny_3rank.json")),
                                tolerances("tiny_3rank.json", KEYS))
        # lr acts from the first update on: step 1 stays inside the tolerance, step 2 leaves it
        # (the NFT losses at once; the rollout's reward mean moves past its tolerance at step 3)
        assert any(" at step 2:" in line for line in off), off
        assert not any(" at step 1:" in line for line in off), off
        return
    r = hpcnft("compare", run_dir, standard_path("tiny_3rank.json"), "--keys", *KEYS, check=False)
    assert r.returncode == 1
    # lr acts from the first update on: step 1 is identical, the step-2 rollout is not
    assert "rollout/reward/raw_mean: first differs at step 2" in r.stdout, r.stdout
    assert "train/nft_t_mean" not in r.stdout  # keys that do not diverge are not reported


# -- the tolerance for kinds without standards (no run needed) -------------------------------
@pytest.mark.parametrize("name", ["tiny_3rank.json", "tiny_fp16_3rank.json"])
def test_the_recorded_kinds_agree_within_the_tolerance_and_not_exactly(name):
    sets = {kind: load_metrics(p) for kind, p in recorded_sets(name).items()}
    atols = tolerances(name, KEYS)
    (a, b) = list(sets.values())[:2]
    assert not compare_metrics(a, b, KEYS).same  # why the tolerance exists
    assert outside_tolerance(a, b, atols) == [] and outside_tolerance(b, a, atols) == []


def test_the_spread_is_the_documented_figure():
    spread = cross_kind_spread("tiny_3rank.json", KEYS)
    relative = {k: s / scale for k, (s, scale) in spread.items() if scale}
    worst = max(relative, key=relative.get)
    assert worst == "train/grad_norm" and f"{relative[worst]:.1e}" == "5.2e-04"
    fp16 = cross_kind_spread("tiny_fp16_3rank.json", KEYS)
    others = [s / scale for name_spread in (spread, fp16) for k, (s, scale) in name_spread.items()
              if scale and k != "train/grad_norm"]
    assert f"{max(others):.1e}" == "6.8e-05"


@pytest.mark.parametrize("name", ["tiny_3rank.json", "tiny_fp16_3rank.json"])
def test_a_standard_changed_by_1e_3_fails_the_tolerance(name):
    """A real change of numerics still fails: scaling a recorded kind's values by 1 + 1e-3 puts
    every key with non-zero values outside its tolerance, but grad_norm, which a 1e-2 change does."""
    sets = list(recorded_sets(name).values())
    reference, other = load_metrics(sets[0]), load_metrics(sets[1])
    atols = tolerances(name, KEYS)

    def changed(key: str, rel: float) -> dict:
        out = dict(other)
        out[key] = other[key].copy()
        out[key][:, 1] *= 1 + rel
        return out

    nonzero = [k for k in KEYS if np.nanmax(np.abs(other[k][:, 1]), initial=0) > 0 and
               not np.isnan(other[k][:, 1]).all()]
    assert len(nonzero) >= 10
    whole = other
    for key in nonzero:
        whole = {**whole, key: changed(key, 1e-3)[key]}
        caught = outside_tolerance(changed(key, 1e-3), reference, {key: atols[key]}) != []
        assert caught == (key != "train/grad_norm"), key
    assert outside_tolerance(changed("train/grad_norm", 1e-2), reference, atols) != [] or \
        "train/grad_norm" not in nonzero
    assert len(outside_tolerance(whole, reference, atols)) >= len(nonzero) - 1


def test_a_kind_can_be_forced_onto_the_path_without_standards(monkeypatch):
    monkeypatch.setenv("HPCNFT_CPU_KIND", "GenuineIntel-AVX512")
    assert cpu_kind() == "GenuineIntel-AVX512"
    assert not has_own_standards("tiny_3rank.json")
    assert standard_path("tiny_3rank.json") == os.path.join(STANDARDS, "tiny_3rank.json")
    monkeypatch.setenv("HPCNFT_CPU_KIND", "AuthenticAMD-AVX2")
    assert has_own_standards("tiny_3rank.json")
