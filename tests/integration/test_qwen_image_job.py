"""The tiny Qwen-Image job end to end in the 3-rank layout (2 train + 1 reward), true CFG on:
reproducible, the same rollouts on one train rank as on two, resumed bit for bit after a
preemption, its sample grid scored by `hpcnft score` as the run scored it; Flow-GRPO with a full
fine-tune on it resumed bit for bit too."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jobs import assert_same_metrics, assert_step_one_agrees, hpcnft, preempt_during
from hpcnft.io.runfile import read_rng, read_run

pytestmark = pytest.mark.slow

STEPS = "3"


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen_image_run):
    """`hpcnft run tiny_qwen_image --steps 3` (tests/integration/conftest.py)."""
    return tiny_qwen_image_run


def rng_states(run_dir: str, step: str = STEPS) -> dict[int, bytes]:
    """Every rank's RNG states after the last step, as the run file keeps them."""
    return read_rng(f"{run_dir}/run.h5", int(step))


def test_the_run_file_names_the_qwen_image_family(uninterrupted):
    run = read_run(uninterrupted)
    assert run.config["models"]["family"] == "qwen_image" and run.config["rollout"]["guidance_scale"] == 4.0
    assert run.topology["world_size"] == 3
    assert run.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]


def test_hpcnft_score_scores_the_runs_sample_grid_as_the_run_did(uninterrupted):
    grid = os.path.join(uninterrupted, "samples", "step_000001.png")
    rows = json.loads(hpcnft("score", "--json", grid).stdout)["images"]
    assert len(rows) == 16  # every sample of the step
    mean = np.mean([row["scores"]["pickscore"] for row in rows])
    assert mean == pytest.approx(read_run(uninterrupted).metrics["rollout/reward/raw_mean"][0, 1], rel=1e-5, abs=1e-6)


def test_one_unsharded_train_rank_samples_and_trains_as_two_fsdp2_shards(uninterrupted, tmp_path):
    """Step 1 of the 2+1 job against one train rank holding the plain DiT
    (perf.skip_single_rank_fsdp): the same rollouts bit for bit, the same training to rounding."""
    plain = str(tmp_path / "plain")
    hpcnft("run", "tiny_qwen_image", "--steps", "1", "--run-dir", plain, "--set", "layout.train_ranks=1",
           "--set", "perf.skip_single_rank_fsdp=true")
    assert_step_one_agrees(uninterrupted, plain)


def test_the_command_again_preempted_and_rerun_is_bit_identical(uninterrupted, tmp_path):
    """The uninterrupted run's command again, preempted as step 2 begins and rerun: its first start
    repeats the run's steps up to the checkpoint, its second the rest, and every step and the RNG
    states agree bit for bit (so a second run of the command and a resume both give the same bits)."""
    run_dir = str(tmp_path / "resumed")
    stopped = preempt_during("tiny_qwen_image", STEPS, run_dir, 2)
    hpcnft("run", "tiny_qwen_image", "--steps", STEPS, "--run-dir", run_dir)
    assert_same_metrics(uninterrupted, run_dir)
    assert rng_states(run_dir) == rng_states(uninterrupted)
    assert [a["from_step"] for a in read_run(run_dir).attempts] == [0, stopped]


def test_flow_grpo_with_a_full_fine_tune_resumes_bit_for_bit(tmp_path):
    """Flow-GRPO's SDE rollout and clipped objective through the same family, the whole DiT
    trained under FSDP2 (but the last block's text stream, which nothing reaches): two steps at
    once, and one step then a resumed second, agree bit for bit."""
    grpo = ("--set", "algo.name=flow_grpo", "--set", "train.finetune=full", "--set", "checkpoint.every=1",
            "--set", "rollout.num_steps=4", "--set", "eval.num_steps=4")
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    hpcnft("run", "tiny_qwen_image", "--steps", "2", "--run-dir", whole, *grpo)
    hpcnft("run", "tiny_qwen_image", "--steps", "1", "--run-dir", split, *grpo)
    hpcnft("run", "tiny_qwen_image", "--steps", "2", "--run-dir", split, *grpo)
    assert "train/grpo_loss" in read_run(whole).metrics
    assert_same_metrics(whole, split)
    assert rng_states(split, "2") == rng_states(whole, "2")
    assert [a["from_step"] for a in read_run(split).attempts] == [0, 1]
