"""The tiny Wan2.1 video job end to end in the 3-rank layout (2 train + 1 reward): frames through
rollout, loss, decode and the reward rank; reproducible, the same rollouts on one train rank, and
resumed bit for bit after a preemption; Flow-GRPO trains on video latents too."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from jobs import assert_same_metrics, assert_step_one_agrees, hpcnft, preempt_during
from hpcnft.io.runfile import read_rng, read_run

pytestmark = pytest.mark.slow

STEPS = "3"


@pytest.fixture(scope="module")
def uninterrupted(tiny_wan_run):
    """`hpcnft run tiny_wan --steps 3` (tests/integration/conftest.py)."""
    return tiny_wan_run


def rng_states(run_dir: str) -> dict[int, bytes]:
    return read_rng(f"{run_dir}/run.h5", int(STEPS))


def test_the_run_names_the_wan_family_and_its_grid_moves(uninterrupted):
    run = read_run(uninterrupted)
    assert run.config["models"]["family"] == "wan" and run.config["rollout"]["num_frames"] == 5
    assert run.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert np.isfinite(run.metrics["train/nft_loss"][:, 1]).all()
    gif = Image.open(os.path.join(uninterrupted, "samples", "step_000001.gif"))
    assert gif.n_frames == 5
    assert os.path.exists(os.path.join(uninterrupted, "samples", "step_000001.png"))


def test_one_train_rank_makes_the_same_rollouts(uninterrupted, tmp_path):
    plain = str(tmp_path / "plain")
    hpcnft("run", "tiny_wan", "--steps", "1", "--run-dir", plain, "--set", "layout.train_ranks=1",
           "--set", "perf.skip_single_rank_fsdp=true")
    assert_step_one_agrees(uninterrupted, plain)


def test_the_command_again_preempted_and_rerun_is_bit_identical(uninterrupted, tmp_path):
    """The uninterrupted run's command again, preempted as step 2 begins and rerun: its first start
    repeats the run's steps up to the checkpoint, its second the rest, and every step and the RNG
    states agree bit for bit (so a second run of the command and a resume both give the same bits)."""
    run_dir = str(tmp_path / "resumed")
    stopped = preempt_during("tiny_wan", STEPS, run_dir, 2)
    hpcnft("run", "tiny_wan", "--steps", STEPS, "--run-dir", run_dir)
    assert_same_metrics(uninterrupted, run_dir)
    assert rng_states(run_dir) == rng_states(uninterrupted)
    assert [a["from_step"] for a in read_run(run_dir).attempts] == [0, stopped]


def test_flow_grpo_trains_on_video_latents(tmp_path):
    run_dir = str(tmp_path / "grpo")
    hpcnft("run", "tiny_wan", "--steps", "1", "--run-dir", run_dir, "--set", "algo.name=flow_grpo")
    metrics = read_run(run_dir).metrics
    assert metrics["train/grad_norm"][0, 1] > 0 and np.isfinite(metrics["train/grpo_loss"][0, 1])


def test_score_reads_the_video_grid_frame_by_frame_and_pools_each_video(uninterrupted, capsys):
    """`hpcnft score RUN/samples/step_1.gif`: every cell's 5 frames against its prompt, then the
    cell's video with its frames' scores pooled by the recipe's reward.frame_pooling (mean)."""
    import json

    from hpcnft.cli.main import main

    gif = os.path.join(uninterrupted, "samples", "step_000001.gif")
    assert main(["score", gif, "--recipe", "tiny_wan", "--term", "jpeg_compressibility", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["images"]
    assert len(rows) == 16 * (5 + 1)
    first = rows[:6]
    assert [r["image"] for r in first] == [f"{gif}#0@{f}" for f in range(5)] + [f"{gif}#0"]
    frames = [r["scores"]["jpeg_compressibility"] for r in first[:5]]
    assert first[5]["frames"] == 5 and first[5]["scores"]["jpeg_compressibility"] == pytest.approx(np.mean(frames))
    assert len({r["prompt"] for r in first}) == 1 and len(set(frames)) > 1
