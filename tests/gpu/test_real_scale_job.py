"""The whole job at the real shapes on one GPU: SD3.5-M and PickScore folders made with
`hpcnft make-weights` (random weights, the real layout, 15.2 GiB), the 24 GB recipe's 3-rank job
over NCCL with every rank a host of its own (`layout.emulate_hosts`), fewer prompts a step (2 x
8 samples), shorter evaluations and the base whole on each rank (`perf.replicate_frozen_base`: no
gathers of it over the emulated hosts' sockets) so that it fits the device's 10 minutes a
command: 3 steps whole, and the same preempted (SIGUSR2) as step 2 begins, then resumed, bit for
bit.

HPCNFT_REAL_WEIGHTS names a folder that holds (or receives) sd35m/ and pickscore/, so that a warm
machine makes them once; by default they go to a temporary folder."""
from __future__ import annotations

import os

import pytest

from jobs import assert_same_metrics, hpcnft, preempt_during
from hpcnft.io.runfile import read_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = "3"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = os.environ.get("HPCNFT_REAL_WEIGHTS") or str(tmp_path_factory.mktemp("weights"))
    for name in ("sd35m", "pickscore"):
        folder = os.path.join(root, name)
        if not (os.path.isdir(folder) and os.listdir(folder)):
            hpcnft("make-weights", name, folder, "--device", "cuda", timeout=900)
    return root


def job_sets(weights: str) -> list[str]:
    sets = [f"models.sd3_dir={weights}/sd35m", f"models.pickscore_dir={weights}/pickscore",
            "models.pickscore_processor_dir=", f"data.train_prompts={REPO}/hpcnft/data/tiny_train_prompts.txt",
            f"data.eval_prompts={REPO}/hpcnft/data/tiny_eval_prompts.txt", "layout.device=cuda",
            "layout.backend=nccl", "layout.emulate_hosts=true", "rollout.prompts_per_step=2", "eval.num_prompts=2",
            "eval.num_steps=10", "eval.every=3", "checkpoint.every=1", "logging.sample_grid_every=1",
            "perf.replicate_frozen_base=true"]
    return [w for s in sets for w in ("--set", s)]


RECIPE = "sd35m_pickscore_24gb"


@pytest.fixture(scope="module")
def whole(weights, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("real") / "whole")
    hpcnft("run", RECIPE, "--steps", STEPS, "--run-dir", run_dir, *job_sets(weights), timeout=600)
    return run_dir


def test_the_real_shape_job_runs_with_its_reward_rank_evaluation_grid_and_checkpoints(whole):
    run = read_run(whole)
    assert run.topology["backend"] == "nccl" and run.topology["world_size"] == 3
    assert run.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert "eval/pickscore_mean" in run.metrics
    assert sorted(os.listdir(os.path.join(whole, "samples"))) == [f"step_00000{i}.png" for i in (1, 2, 3)]
    assert [e["kind"] for e in run.events].count("checkpoint") == 3


def test_the_real_shape_job_preempted_resumes_bit_for_bit(weights, whole, tmp_path):
    run_dir = str(tmp_path / "preempted")
    stopped = preempt_during(RECIPE, STEPS, run_dir, 2, extra=job_sets(weights))
    assert stopped in (1, 2)  # checkpointed before the last step, which the resume runs
    hpcnft("run", RECIPE, "--steps", STEPS, "--run-dir", run_dir, *job_sets(weights), timeout=600)
    assert_same_metrics(whole, run_dir)
    assert len(read_run(run_dir).attempts) == 2
