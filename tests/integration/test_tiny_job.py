"""The embedded default job end to end: 3 ranks (2 train + 1 reward) through the local spawner.

The tests of the default tier read the session's shared run (`tiny_run`, tests/conftest.py: `hpcnft
run tiny --steps 3`); the slow ones start their own runs of other layouts and launchers."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from jobs import assert_same_metrics, assert_step_one_agrees, hpcnft, start
from hpcnft.algo.sampler import sigma_grid
from hpcnft.io.runfile import PER_STEP_KEYS, read_run


def test_three_steps_write_every_metric(tiny_run):
    run = read_run(tiny_run.run_dir)
    for key in PER_STEP_KEYS:
        assert run.metrics[key][:, 0].tolist() == [1.0, 2.0, 3.0], key
    assert run.metrics["eval/pickscore_mean"][:, 0].tolist() == [3.0]  # the end-of-run eval
    assert run.topology["world_size"] == 3 and run.topology["launcher"] == "local"
    steps = [line for line in tiny_run.stdout.splitlines() if line.startswith("step ")]
    assert steps[-1].startswith("step 3/3 | reward")
    assert [e["kind"] for e in run.events][-1] == "done"
    grid = Image.open(os.path.join(tiny_run.run_dir, "samples", "step_000001.png"))
    width, height = grid.size  # both train ranks' 16 samples: a column per prompt under its caption
    assert width == 4 * 64 and 4 * 64 < height < 5 * 64, grid.size


def test_the_terminal_shows_loading_progress_and_a_closing_summary(tiny_run):
    """What a run tells the user: the models loading with their time, what the reward is, a line
    per step, and a closing summary naming the run file and the last checkpoint."""
    lines = tiny_run.stdout.splitlines()
    assert "hpcnft: loading the models" in lines
    assert lines.index("hpcnft: reward = pickscore (PickScore)") < lines.index(
        [x for x in lines if x.startswith("step 1/3")][0])
    assert any(re.fullmatch(r"hpcnft: models loaded in \d+\.\d s", line) for line in lines), tiny_run.stdout
    # its parts as they end: what was read (the DiT's size and dtype), then the DiT made ready
    read = [i for i, x in enumerate(lines) if re.fullmatch(
        r"hpcnft: pipeline read in \d+\.\d s \(its DiT \d+\.\d MiB in float32, in host memory\)", x)]
    ready = [i for i, x in enumerate(lines) if re.fullmatch(r"hpcnft: DiT made trainable and moved to cpu in \d+\.\d s", x)]
    assert len(read) == len(ready) == 1 and lines.index("hpcnft: loading the models") < read[0] < ready[0], tiny_run.stdout
    where = re.escape(tiny_run.run_dir)
    assert re.fullmatch(rf"hpcnft: finished 3 steps \(3 in this start, \d\d:\d\d:\d\d\); run file {where}/run\.h5; "
                        rf"last checkpoint {where}/checkpoints/step_000003", lines[-1]), tiny_run.stdout
    assert lines.index("hpcnft: loading the models") < lines.index([x for x in lines if x.startswith("step 1/3")][0])
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all(re.search(r"\| ETA \d\d:\d\d:\d\d$", line) for line in lines if line.startswith("step "))
    # the evaluation at the end says what run.h5 holds of it, after its step's line
    m = read_run(tiny_run.run_dir).metrics
    said = f"eval at step 3 | pickscore {m['eval/pickscore_mean'][-1, 1]:.4f} ± {m['eval/pickscore_std'][-1, 1]:.4f}"
    assert lines.index(said) == lines.index([x for x in lines if x.startswith("step 3/3")][0]) + 1, tiny_run.stdout


def test_nft_invariants_hold(tiny_run):
    m = read_run(tiny_run.run_dir).metrics
    pos, neg = m["train/nft_pos_loss"][:, 1], m["train/nft_neg_loss"][:, 1]
    assert pos[0] == neg[0]  # step 1: old policy == policy, bit for bit
    assert pos[2] != neg[2]  # the policy has moved by step 3
    assert np.all(np.abs(m["train/nft_r_mean"][:, 1] - 0.5) <= 1e-6)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    trained = sigma_grid(sched, 10)[:9].double()  # the first 9 sigmas; sigma_9 is never trained
    assert np.allclose(m["train/nft_t_mean"][:, 1], trained.mean().item(), rtol=0, atol=1e-12)
    assert m["train/nft_num_timesteps"][:, 1].tolist() == [9.0] * 3
    assert m["rollout/reward/raw_num_samples"][:, 1].tolist() == [16.0] * 3


def test_show_summarises_the_run(tiny_run):
    r = hpcnft("show", tiny_run.run_dir)
    assert "topology" in r.stdout and "attempts (1)" in r.stdout and "train/nft_loss" in r.stdout


@pytest.mark.slow
def test_a_checkpoint_holds_the_trained_weights_and_none_of_the_dits_buffers(tiny_run):
    """The LoRA weights alone: no frozen weight and no buffer, which the folder and the config give
    (SD3's position table: 0.9 GB of SD3.5-M's checkpoints before)."""
    from hpcnft.io.checkpoint import SafeReader

    meta = SafeReader(os.path.join(tiny_run.run_dir, "checkpoints", "step_000003")).read_metadata()
    saved = {k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")}
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)


def test_same_command_twice_is_bit_identical(tiny_run, tiny_run_again):
    assert_same_metrics(tiny_run.run_dir, tiny_run_again.run_dir)


@pytest.mark.slow
def test_train_ranks_loading_one_at_a_time_say_so_and_give_the_same_bits(tiny_run, tmp_path):
    from jobs import TINY_ARGS, TINY_STEPS

    run_dir = str(tmp_path / "staggered")
    r = hpcnft("run", "tiny", "--steps", str(TINY_STEPS), "--run-dir", run_dir, *TINY_ARGS,
               "--set", "layout.stagger_loads=always")
    said = [line for line in r.stdout.splitlines() if "one at a time" in line]
    assert len(said) == 1 and said[0].startswith("hpcnft: the train ranks of a host load the base transformer one "
                                                 "at a time (2 x "), r.stdout
    assert_same_metrics(tiny_run.run_dir, run_dir)


@pytest.mark.slow
def test_torchrun_gives_the_same_metrics_and_a_finished_run_again_loads_nothing(tiny_run, tmp_path):
    import subprocess
    import sys

    run_dir = str(tmp_path / "torchrun")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "-m", "hpcnft", "run", "tiny", "--steps", "3", "--run-dir", run_dir]
    r = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_run(run_dir).topology["launcher"] == "torchrun"
    assert_same_metrics(tiny_run.run_dir, run_dir)
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines().count(f"hpcnft: {run_dir} already finished at step 3; nothing to run "
                                            "(--steps N with N > 3 continues it)") == 1, again.stdout
    assert "loading the models" not in again.stdout


# The CPU-capable speed levers of world 1 (hpcnft/perf/levers.py). At step 1 LoRA's B is zero, so the
# merged weights are the base weights exactly; the fused q/k/v GEMM may round differently.
WORLD1_LEVERS = ("perf.skip_single_rank_fsdp=true", "perf.merge_lora_nograd=true", "perf.fuse_qkv=true",
                 "perf.old_pass_batch=4", "perf.overlap_reward=true")


@pytest.mark.slow
@pytest.mark.parametrize("train_ranks,reward_ranks", [(1, 1), (4, 1), (2, 2)], ids=["1+1", "4+1", "2+2"])
def test_layouts_agree_at_step_one(tiny_run, tmp_path, train_ranks, reward_ranks):
    run_dir = str(tmp_path / f"layout-{train_ranks}-{reward_ranks}")
    hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, "--set", f"layout.train_ranks={train_ranks}",
           "--set", f"layout.reward_ranks={reward_ranks}")
    assert_step_one_agrees(tiny_run.run_dir, run_dir)


@pytest.mark.slow
def test_one_rank_alone_agrees_at_step_one_with_and_without_the_world_1_levers(tiny_run, tmp_path):
    """1+0 (the rank scores its own samples), plain and with WORLD1_LEVERS, side by side: each
    run is one process on one thread."""
    procs = {}
    for name, levers in (("plain", ()), ("levers", WORLD1_LEVERS)):
        run_dir = str(tmp_path / f"layout-1-0-{name}")
        sets = [a for lever in levers for a in ("--set", lever)]
        procs[name] = run_dir, start("run", "tiny", "--steps", "1", "--run-dir", run_dir,
                                     "--set", "layout.train_ranks=1", "--set", "layout.reward_ranks=0", *sets)
    for name, (run_dir, proc) in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err
        assert read_run(run_dir).topology["world_size"] == 1
        assert_step_one_agrees(tiny_run.run_dir, run_dir, rollout_rtol=1e-6 if name == "levers" else 0.0)


@pytest.mark.slow
def test_fp16_path_skips_the_overflowing_first_step(tiny_fp16_run):
    m = read_run(tiny_fp16_run).metrics
    assert np.isnan(m["train/grad_norm"][0, 1])
    assert m["train/step_skipped"][0, 1] == 1.0
    assert m["train/loss_scale"][:, 1].tolist()[:2] == [2.0**36, 2.0**35]
    # a skipped step leaves the policy where it was: step 2 still has old policy == policy
    assert m["train/nft_pos_loss"][1, 1] == m["train/nft_neg_loss"][1, 1]


@pytest.mark.slow
def test_fp8_rollout_moves_the_rollout_and_not_the_evaluation(tmp_path):
    """perf.rollout_fp8 multiplies the rollout's GEMMs in fp8: its rewards move (a little); the
    evaluation of the same policy keeps the full-precision forward. Both runs single-rank and side
    by side (one process on one thread each)."""
    procs = {}
    for fp8 in (False, True):
        run_dir = str(tmp_path / f"fp8-{fp8}")
        procs[fp8] = run_dir, start("run", "tiny", "--steps", "1", "--run-dir", run_dir, "--set", "eval.at_start=true",
                                    "--set", "eval.at_end=false", "--set", "layout.train_ranks=1",
                                    "--set", "layout.reward_ranks=0", "--set", f"perf.rollout_fp8={str(fp8).lower()}")
    runs = {}
    for fp8, (run_dir, proc) in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err
        runs[fp8] = read_run(run_dir).metrics
    for key in ("eval/pickscore_mean", "eval/pickscore_std"):
        assert runs[True][key][0, 0] == 0 and runs[True][key][0, 1] == runs[False][key][0, 1], key  # step 0
    fp8_reward, reward = runs[True]["rollout/reward/raw_mean"][-1, 1], runs[False]["rollout/reward/raw_mean"][-1, 1]
    assert fp8_reward != reward and abs(fp8_reward - reward) < 0.05
