"""The job's layouts over NCCL on one GPU. Every rank is a process of its own on the one device,
each claiming a host of its own (`layout.emulate_hosts`), so NCCL runs its real communicators
between them (FSDP2's collectives among the train ranks), as it does between GPUs and nodes
(over sockets: for correctness, not speed), beside the reward traffic on the host group.
Deterministic mode, the tiny recipe in fp32."""
from __future__ import annotations

import os
import signal

import pytest

from jobs import (assert_same_metrics, hpcnft, kill_all_ranks, non_perf, rank_pids, start,
                              wait_for_line)
from hpcnft.io.runfile import read_run

TIMEOUT_S = 60
NCCL = ["--set", "layout.device=cuda", "--set", "layout.backend=nccl", "--set", "layout.emulate_hosts=true",
        "--set", f"layout.timeout_s={TIMEOUT_S}"]
STEPS = "6"
EVERY_STEP = ["--set", "checkpoint.every=1"]
# What NCCL's watchdog and c10d print when a peer is lost: pages that belong in the rank's log.
NATIVE_NOISE = ("Watchdog", "ProcessGroupNCCL", "Exception raised from", "frame #", "NCCL WARN")


def layout(train: int, reward: int) -> list[str]:
    return ["--set", f"layout.train_ranks={train}", "--set", f"layout.reward_ranks={reward}"]


def run(run_dir: str, *args: str, steps: str = STEPS):
    return hpcnft("run", "tiny", "--steps", steps, "--run-dir", run_dir, *NCCL, *args, timeout=600)


@pytest.fixture(scope="module")
def two_plus_one(tmp_path_factory, hpcnft_cache):
    run_dir = str(tmp_path_factory.mktemp("nccl") / "2+1")
    run(run_dir)
    return run_dir


def test_two_plus_one_runs_to_the_end_bit_identically_twice(two_plus_one, tmp_path):
    again = str(tmp_path / "again")
    run(again)
    topo = read_run(again).topology
    assert topo["backend"] == "nccl" and topo["world_size"] == 3
    assert read_run(again).metrics["train/nft_loss"][:, 0].tolist() == [float(s) for s in range(1, int(STEPS) + 1)]
    assert_same_metrics(two_plus_one, again)


# 3 train ranks need a sample count divisible by 3: 3 prompts x 4 samples.
@pytest.mark.parametrize("train,reward", [(1, 1), (3, 1), (4, 1), (2, 2)], ids=["1+1", "3+1", "4+1", "2+2"])
def test_layout_runs_to_the_end(two_plus_one, tmp_path, train, reward):
    run_dir = str(tmp_path / f"{train}+{reward}")
    extra = ["--set", "rollout.prompts_per_step=3"] if train == 3 else []
    run(run_dir, *layout(train, reward), *extra, steps="2")
    got = read_run(run_dir)
    assert got.topology["world_size"] == train + reward and got.topology["backend"] == "nccl"
    assert got.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0]
    if extra:
        return
    # The same images and scores, whichever rank made them: samples are keyed by global index.
    ref = non_perf(read_run(two_plus_one).metrics)
    for key in (k for k in non_perf(got.metrics) if k.startswith("rollout/reward/")):
        assert got.metrics[key][0, 1] == ref[key][0, 1], key


# The images over NCCL (a communicator per train/reward pair) in the layouts where receives
# pre-posted per train rank once hung (3+1), and beside another reward rank (2+2).
@pytest.mark.parametrize("train,reward", [(2, 1), (3, 1), (2, 2)], ids=["2+1", "3+1", "2+2"])
def test_images_over_nccl_give_the_run_of_images_over_gloo(two_plus_one, tmp_path, train, reward):
    run_dir = str(tmp_path / f"nccl-{train}+{reward}")
    extra = ["--set", "rollout.prompts_per_step=3"] if train == 3 else []
    steps = STEPS if (train, reward) == (2, 1) else "2"
    run(run_dir, *layout(train, reward), *extra, "--set", "layout.reward_transport=nccl", steps=steps)
    got = read_run(run_dir)
    assert got.topology["reward_transport"] == "nccl"
    assert got.metrics["train/nft_loss"][:, 0].tolist() == [float(s) for s in range(1, int(steps) + 1)]
    assert any(k.startswith("eval/") for k in got.metrics)  # the evaluation's images came this way too
    if (train, reward) == (2, 1):
        assert_same_metrics(two_plus_one, run_dir)
    elif not extra:
        ref = non_perf(read_run(two_plus_one).metrics)
        for key in (k for k in non_perf(got.metrics) if k.startswith("rollout/reward/")):
            assert got.metrics[key][0, 1] == ref[key][0, 1], key


# determinism.layout_invariant over NCCL: the tiny recipe's 4 prompts x 4 samples in its 8 virtual
# shards of 2, which 1, 2 and 4 train ranks divide; the shards' gradients gathered over NCCL.
INVARIANT = ["--set", "determinism.layout_invariant=true", "--set", "checkpoint.every=1"]


def test_a_layout_invariant_run_resumed_as_4_plus_1_then_1_plus_1_then_2_plus_2_is_bit_identical(tmp_path):
    straight, moved = str(tmp_path / "straight"), str(tmp_path / "moved")
    run(straight, *INVARIANT, steps="4")
    for step, (train, reward) in enumerate([(2, 1), (4, 1), (1, 1), (2, 2)], start=1):
        run(moved, *INVARIANT, *layout(train, reward), steps=str(step))
    assert_same_metrics(straight, moved)
    assert [e["step"] for e in read_run(moved).events if e["kind"] == "layout"] == [1, 2, 3]


def test_preemption_signal_then_rerun_is_bit_identical(two_plus_one, tmp_path):
    run_dir = str(tmp_path / "usr2")
    proc = start("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *NCCL)
    wait_for_line(proc, f"step 2/{STEPS}")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, f"{out}\n{err}"
    run(run_dir)
    assert_same_metrics(two_plus_one, run_dir)
    assert len(read_run(run_dir).attempts) == 2


def test_sigkill_of_every_rank_then_rerun_is_bit_identical(two_plus_one, tmp_path):
    run_dir = str(tmp_path / "kill")
    proc = start("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *NCCL, *EVERY_STEP)
    wait_for_line(proc, f"step 3/{STEPS}")
    kill_all_ranks(proc)
    run(run_dir, *EVERY_STEP)
    assert_same_metrics(two_plus_one, run_dir)


@pytest.mark.parametrize("victim,role", [(0, "train"), (2, "reward")])
def test_a_killed_rank_ends_the_job_naming_it(tmp_path, hpcnft_cache, victim, role):
    run_dir = str(tmp_path / f"dead-{victim}")
    proc = start("run", "tiny", "--steps", "40", "--run-dir", run_dir, *NCCL)
    wait_for_line(proc, "step 2/40")
    os.kill(rank_pids(proc.pid)[victim], signal.SIGKILL)
    out, err = proc.communicate(timeout=TIMEOUT_S + 120)  # a job that outlives its dead rank is a hang
    assert proc.returncode != 0
    assert f"rank {victim} ({role}) failed: killed by SIGKILL" in err, err[-3000:]
    noise = [line for line in err.splitlines() if any(n in line for n in NATIVE_NOISE)]
    assert not noise, "\n".join(noise[:20])
