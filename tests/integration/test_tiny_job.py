"""The embedded default job end to end: 3 ranks (2 train + 1 reward) through the local spawner."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from jobs import assert_same_metrics, assert_step_one_agrees, hpcnft
from hpcnft.algo.sampler import sigma_grid
from hpcnft.io.runfile import PER_STEP_KEYS, read_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("tiny") / "run")
    t0 = time.monotonic()
    r = hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir)
    return run_dir, time.monotonic() - t0, r


def test_three_steps_write_every_metric(three_steps):
    run_dir, seconds, r = three_steps
    assert seconds < 60, f"3 steps took {seconds:.1f} s"
    run = read_run(run_dir)
    for key in PER_STEP_KEYS:
        assert run.metrics[key][:, 0].tolist() == [1.0, 2.0, 3.0], key
    assert run.metrics["eval/pickscore_mean"][:, 0].tolist() == [3.0]  # the end-of-run eval
    assert run.topology["world_size"] == 3 and run.topology["launcher"] == "local"
    assert [line for line in r.stdout.splitlines() if line.startswith("step ")][-1].startswith("step 3/3 | reward")
    assert [e["kind"] for e in run.events][-1] == "done"
    grid = Image.open(os.path.join(run_dir, "samples", "step_000001.png"))
    width, height = grid.size  # both train ranks' 16 samples: a column per prompt under its caption
    assert width == 4 * 64 and 4 * 64 < height < 5 * 64, grid.size


def test_nft_invariants_hold(three_steps):
    m = read_run(three_steps[0]).metrics
    pos, neg = m["train/nft_pos_loss"][:, 1], m["train/nft_neg_loss"][:, 1]
    assert pos[0] == neg[0]  # step 1: old policy == policy, bit for bit
    assert pos[2] != neg[2]  # the policy has moved by step 3
    assert np.all(np.abs(m["train/nft_r_mean"][:, 1] - 0.5) <= 1e-6)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    trained = sigma_grid(sched, 10)[:9].double()  # the first 9 sigmas; sigma_9 is never trained
    assert np.allclose(m["train/nft_t_mean"][:, 1], trained.mean().item(), rtol=0, atol=1e-12)
    assert m["train/nft_num_timesteps"][:, 1].tolist() == [9.0] * 3
    assert m["rollout/reward/raw_num_samples"][:, 1].tolist() == [16.0] * 3


def test_same_command_twice_is_bit_identical(three_steps, tmp_path):
    again = str(tmp_path / "again")
    hpcnft("run", "tiny", "--steps", "3", "--run-dir", again)
    assert_same_metrics(three_steps[0], again)


def test_torchrun_gives_the_same_metrics(three_steps, tmp_path):
    import subprocess
    import sys

    run_dir = str(tmp_path / "torchrun")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        "-m", "hpcnft", "run", "tiny", "--steps", "3", "--run-dir", run_dir],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_run(run_dir).topology["launcher"] == "torchrun"
    assert_same_metrics(three_steps[0], run_dir)


# The CPU-capable speed levers of world 1 (hpcnft/perf/levers.py). At step 1 LoRA's B is zero, so the
# merged weights are the base weights exactly; the fused q/k/v GEMM may round differently.
WORLD1_LEVERS = ("perf.skip_single_rank_fsdp=true", "perf.merge_lora_nograd=true", "perf.fuse_qkv=true",
                 "perf.old_pass_batch=4", "perf.overlap_reward=true")


@pytest.mark.parametrize("train_ranks,reward_ranks,levers",
                         [(1, 0, ()), (1, 1, ()), (4, 1, ()), (2, 2, ()), (1, 0, WORLD1_LEVERS)],
                         ids=["1+0", "1+1", "4+1", "2+2", "1+0-levers"])
def test_layouts_agree_at_step_one(three_steps, tmp_path, train_ranks, reward_ranks, levers):
    run_dir = str(tmp_path / f"layout-{train_ranks}-{reward_ranks}")
    sets = [a for lever in levers for a in ("--set", lever)]
    hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, "--set", f"layout.train_ranks={train_ranks}",
           "--set", f"layout.reward_ranks={reward_ranks}", *sets)
    assert_step_one_agrees(three_steps[0], run_dir, rollout_rtol=1e-6 if levers else 0.0)


def test_fp16_path_skips_the_overflowing_first_step(tmp_path):
    run_dir = str(tmp_path / "fp16")
    hpcnft("run", "tiny_fp16", "--steps", "2", "--run-dir", run_dir, "--set", "layout.train_ranks=1",
           "--set", "layout.reward_ranks=0", "--set", "eval.at_end=false")
    m = read_run(run_dir).metrics
    assert np.isnan(m["train/grad_norm"][0, 1])
    assert m["train/step_skipped"][0, 1] == 1.0
    assert m["train/loss_scale"][:, 1].tolist()[:2] == [2.0**36, 2.0**35]
    # a skipped step leaves the policy where it was: step 2 still has old policy == policy
    assert m["train/nft_pos_loss"][1, 1] == m["train/nft_neg_loss"][1, 1]


def test_show_summarises_the_run(three_steps):
    r = hpcnft("show", three_steps[0])
    assert "topology" in r.stdout and "attempts (1)" in r.stdout and "train/nft_loss" in r.stdout


def test_fp8_rollout_moves_the_rollout_and_not_the_evaluation(tmp_path):
    """perf.rollout_fp8 multiplies the rollout's GEMMs in fp8: its rewards move (a little); the
    evaluation of the same policy keeps the full-precision forward."""
    runs = {}
    for fp8 in (False, True):
        run_dir = str(tmp_path / f"fp8-{fp8}")
        hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, "--set", "eval.at_start=true",
               "--set", "eval.at_end=false", "--set", f"perf.rollout_fp8={str(fp8).lower()}")
        runs[fp8] = read_run(run_dir).metrics
    for key in ("eval/pickscore_mean", "eval/pickscore_std"):
        assert runs[True][key][0, 0] == 0 and runs[True][key][0, 1] == runs[False][key][0, 1], key  # step 0
    fp8_reward, reward = runs[True]["rollout/reward/raw_mean"][-1, 1], runs[False]["rollout/reward/raw_mean"][-1, 1]
    assert fp8_reward != reward and abs(fp8_reward - reward) < 0.05
