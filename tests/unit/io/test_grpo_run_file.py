"""A Flow-GRPO run's file: its keys beside the shared ones, its last step from its loss (the NFT
keys stay empty), `watch` following its loss column, and the progress line naming its loss."""
from __future__ import annotations

from hpcnft.io import run_state
from hpcnft.io.live_run import RunFollower
from hpcnft.io.run_writer import RunFileWriter
from hpcnft.io.runfile import ALL_KEYS, GRPO_TRAIN_KEYS, LOSS_KEYS, read_run
from hpcnft.run.output import progress_line

ROW = {"train/grpo_loss": 0.25, "train/grpo_approx_kl": 1e-3, "train/grpo_clipfrac": 0.5,
       "train/grpo_ratio_mean": 1.0, "train/grpo_num_timesteps": 9.0, "train/grad_norm": 0.125,
       "rollout/reward/raw_mean": -4.0, "rollout/reward/raw_std": 0.05, "perf/iteration_s": 1.5}


def grpo_run(path: str, steps: int) -> RunFileWriter:
    w = RunFileWriter(path, "{}", "x", tuple(GRPO_TRAIN_KEYS))
    w.add_attempt({"from_step": 0})
    w.event(0, "start", "go")
    for step in range(1, steps + 1):
        w.append_metrics(step, ROW)
    return w


def test_the_keys_and_the_last_step_of_a_flow_grpo_run(tmp_path):
    path = str(tmp_path / "run.h5")
    w = grpo_run(path, 3)
    assert w.last_step() == 3  # from train/grpo_loss: train/nft_loss has no rows
    w.close()
    run = read_run(path)
    assert run_state.last_step(run) == 3
    assert len(run.metrics["train/nft_loss"]) == 0 and run.metrics["train/grpo_loss"][:, 0].tolist() == [1, 2, 3]
    assert not set(GRPO_TRAIN_KEYS) & set(ALL_KEYS) and LOSS_KEYS == ("train/nft_loss", "train/grpo_loss")


def test_watch_follows_the_flow_grpo_loss(tmp_path):
    path = str(tmp_path / "run.h5")
    w = grpo_run(path, 2)
    w.event(2, "done", "finished")
    w.close()
    lines, end = RunFollower(path).poll()
    steps = [line for line in lines if line.startswith("step ")]
    assert end == "done" and steps == ["step 1  reward -4  grpo_loss 0.25  grad_norm 0.125",
                                       "step 2  reward -4  grpo_loss 0.25  grad_norm 0.125"]


def test_the_progress_line_names_the_algorithm_s_loss():
    line = progress_line(2, 4, ROW, 3.0, 1)
    assert "| grpo_loss 0.2500 | grad_norm 1.250e-01 |" in line and "nft_loss" not in line
    nft = {**{k: v for k, v in ROW.items() if "grpo" not in k}, "train/nft_loss": 61.0}
    assert "| nft_loss 61.0000 |" in progress_line(2, 4, nft, 3.0, 1)
