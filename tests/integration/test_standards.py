"""Recorded standards: the tiny 3-rank job (fp32, and fp16 with its overflowing first step)
must reproduce the committed metric series exactly, and a perturbed run must not.

The CPU's own kernels round by the machine: PyTorch's vectorized kernels follow the CPU's vector
ISA (`torch.backends.cpu.get_cpu_capability()`) and MKL its code path for the CPU's vendor, so a
tiny run's bits are the same on machines of one vendor and ISA, not across them. A machine uses
the standards of its own `<vendor>-<capability>` folder (e.g. `AuthenticAMD-AVX2/`) where there
is one, else the top-level ones, recorded on the CI machines before the folders were.

Re-record (after a deliberate change of the numerics, or of the pinned libraries; writes this
machine's folder):
    HPCNFT_RECORD_STANDARDS=1 python3 -m pytest tests/integration/test_standards.py
"""
from __future__ import annotations

import json
import os
import platform

import pytest

from jobs import hpcnft

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
STANDARDS = os.path.join(HERE, "..", "standards")
RECORD = os.environ.get("HPCNFT_RECORD_STANDARDS") == "1"


def cpu_kind() -> str:
    """<vendor>-<PyTorch CPU capability>, e.g. AuthenticAMD-AVX2: what the CPU kernels' rounding follows."""
    import torch

    vendor = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def standard_path(name: str) -> str:
    own = os.path.join(STANDARDS, cpu_kind(), name)
    return own if RECORD or os.path.exists(own) else os.path.join(STANDARDS, name)

# What the test checks is this list, not whatever the standard holds (nft_spec.md §6's keys).
KEYS = ["rollout/reward/raw_num_samples", "rollout/reward/raw_mean", "rollout/reward/raw_median",
        "rollout/reward/raw_std", "train/grad_norm", "train/nft_loss", "train/nft_pos_loss",
        "train/nft_neg_loss", "train/nft_r_mean", "train/nft_t_mean", "train/step_skipped",
        "train/loss_scale", "eval/pickscore_mean"]


def run_and_check(tmp_path, recipe: str, standard: str, *extra: str) -> str:
    run_dir = str(tmp_path / recipe)
    hpcnft("run", recipe, "--steps", "3", "--run-dir", run_dir, *extra)
    path = standard_path(standard)
    if RECORD:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        hpcnft("compare", "--record", run_dir, path)
    r = hpcnft("compare", run_dir, path, "--keys", *KEYS, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def test_tiny_three_ranks_matches_its_standard(tmp_path):
    run_and_check(tmp_path, "tiny", "tiny_3rank.json")


def test_tiny_fp16_matches_its_standard_with_the_nan_step(tmp_path):
    run_and_check(tmp_path, "tiny_fp16", "tiny_fp16_3rank.json")
    with open(standard_path("tiny_fp16_3rank.json")) as f:
        grad_norm = json.load(f)["metrics"]["train/grad_norm"]
    assert grad_norm[0] == [1, "NaN"]  # the overflowing first step, kept as NaN in the standard


def test_a_perturbed_run_fails_its_standard_naming_where(tmp_path):
    run_dir = str(tmp_path / "perturbed")
    hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, "--set", "optim.lr=0.004")
    r = hpcnft("compare", run_dir, standard_path("tiny_3rank.json"), "--keys", *KEYS, check=False)
    assert r.returncode == 1
    # lr acts from the first update on: step 1 is identical, the step-2 rollout is not
    assert "rollout/reward/raw_mean: first differs at step 2" in r.stdout, r.stdout
    assert "train/nft_t_mean" not in r.stdout  # keys that do not diverge are not reported
