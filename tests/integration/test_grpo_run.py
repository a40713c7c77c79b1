"""Flow-GRPO end to end (`tiny_learns_grpo`: the real 2 + 1 layout over gloo): the same command
twice gives bit-identical runs; a run dir through a shorter run, a preemption (SIGUSR2), a
SIGKILL of every rank and a last start ends with the uninterrupted run's bits; a killed train rank
ends the job, naming it. The run file holds Flow-GRPO's keys, and the progress line, `show` and
`watch` its loss."""
from __future__ import annotations

import os
import signal

import pytest

from jobs import assert_same_metrics, hpcnft, kill_all_ranks, rank_pids, start, wait_for_attempts, wait_for_line
from hpcnft.algo.flow_grpo.spec import TRAIN_KEYS as GRPO_TRAIN_KEYS
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_TRAIN_KEYS
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

RECIPE, STEPS = "tiny_learns_grpo", "3"
ARGS = ("--set", "checkpoint.every=1", "--set", f"checkpoint.keep={STEPS}")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[tuple[str, str]]:
    """`hpcnft run tiny_learns_grpo --steps 3` twice, side by side: [(run dir, stdout)] x 2."""
    root = tmp_path_factory.mktemp("grpo")
    dirs = [str(root / name) for name in ("a", "b")]
    procs = [start("run", RECIPE, "--steps", STEPS, "--run-dir", d, *ARGS) for d in dirs]
    outs = []
    for d, proc in zip(dirs, procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out + err
        outs.append((d, out))
    return outs


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """One run dir: `--steps 1`; `--steps 3` preempted as it resumes (checkpoint 2, exit 75);
    `--steps 3` with every rank SIGKILLed while step 3 runs; `--steps 3` to the end."""
    run_dir = str(tmp_path_factory.mktemp("grpo-interrupted") / "run")
    seen = {"run_dir": run_dir, "first": hpcnft("run", RECIPE, "--steps", "1", "--run-dir", run_dir, *ARGS)}
    proc = start("run", RECIPE, "--steps", STEPS, "--run-dir", run_dir, *ARGS)
    wait_for_line(proc, "hpcnft: resuming after step 1")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    seen["preempted"] = (proc.returncode, out, err)
    proc = start("run", RECIPE, "--steps", STEPS, "--run-dir", run_dir, *ARGS)
    wait_for_line(proc, "hpcnft: resuming after step 2")
    wait_for_attempts(run_dir, 3, proc)  # rank 0 is into step 3
    kill_all_ranks(proc)
    seen["last"] = hpcnft("run", RECIPE, "--steps", STEPS, "--run-dir", run_dir, *ARGS)
    return seen


def test_the_same_command_twice_is_bit_identical(straight):
    (a, out_a), (b, _) = straight
    r = hpcnft("compare", a, b, check=False)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("same: "), r.stdout
    assert_same_metrics(a, b)
    assert "| grpo_loss " in out_a and "nft_loss" not in out_a
    m = read_run(a).metrics
    for key in [*GRPO_TRAIN_KEYS, "train/grad_norm", "train/adv_abs_mean", "ema/decay"]:
        assert m[key][:, 0].tolist() == [1.0, 2.0, 3.0], key
    assert not set(NFT_TRAIN_KEYS) & set(m)  # a Flow-GRPO run file holds its own train keys alone
    assert m["ema/decay"][:, 1].tolist() == [0.0, 0.0, 0.0]  # pi_old is theta after every step
    assert (m["train/grpo_num_timesteps"][:, 1] == 9).all()
    assert 0 < m["train/grpo_clipfrac"][:, 1].max() < 1  # the second update of a step runs off-policy


def test_show_and_watch_give_flow_grpo_s_loss(straight):
    a, _ = straight[0]
    assert "train/grpo_loss" in hpcnft("show", a).stdout
    watched = hpcnft("watch", a, "--interval", "0.05", "--timeout", "30").stdout
    step_lines = [line for line in watched.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and all("grpo_loss " in line and "grad_norm " in line for line in step_lines)


def test_every_interrupted_start_resumes_and_the_run_ends_with_the_uninterrupted_bits(interrupted, straight):
    code, out, err = interrupted["preempted"]
    assert code == 75 and "hpcnft: preempted at step 2" in out, out + err
    assert "hpcnft: resuming after step 2 from checkpoint" in interrupted["last"].stdout
    run_dir = interrupted["run_dir"]
    assert [a["from_step"] for a in read_run(run_dir).attempts] == [0, 1, 2, 2]
    assert_same_metrics(straight[0][0], run_dir)


def test_a_shorter_run_resumed_equals_the_longer_run_at_its_step(interrupted, straight):
    """The first start's one step, before any resume, is step 1 of the uninterrupted run."""
    first = read_run(interrupted["run_dir"]).metrics["train/grpo_loss"][0]
    assert first.tolist() == read_run(straight[0][0]).metrics["train/grpo_loss"][0].tolist()
    assert "hpcnft: finished 1 step (1 in this start" in interrupted["first"].stdout


def test_killing_a_train_rank_ends_the_job_naming_it(tmp_path):
    run_dir = str(tmp_path / "kill")
    proc = start("run", RECIPE, "--steps", "20", "--run-dir", run_dir)
    wait_for_line(proc, "step 2/20")
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)  # a job that outlives its dead rank is a hang
    assert proc.returncode != 0, out + err
    assert "rank 1 (train) failed: killed by SIGKILL" in err
    assert read_run(run_dir).metrics["train/grpo_loss"][:2, 0].tolist() == [1.0, 2.0]
