"""hpcnft.run: the job's pieces that need no model. Which checkpoint a run resumes from (and
the refusal of one whose config differs), run file before requeue, failures as one line, the
default run dir, and what a reward service's outage keeps: the steps finished, an evaluation
owed to the next start."""
from __future__ import annotations

import os
import types

import pytest

from hardening_tools import tiny_policy
from hpcnft.algo.checkpoint_parts import checkpoint_parts
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.common import determinism
from hpcnft.io import checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process


def _checkpoint_of(cfg, run_dir: str, step: int) -> str:
    policy, opt = tiny_policy()
    checkpoint.save(run_dir, step, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
    return checkpoint.commit(run_dir, step, checkpoint.TrainState(step, {}), cfg.to_json(), keep=3)


def test_a_run_resumes_from_its_newest_checkpoint(tmp_path):
    from hpcnft.run.resume import check_resumable

    cfg = load_config("tiny", steps=4)
    run_dir = str(tmp_path / "run")
    assert check_resumable(cfg, run_dir, warn=print) is None  # nothing yet: a fresh start
    _checkpoint_of(cfg, run_dir, 1)
    newest = _checkpoint_of(cfg, run_dir, 2)
    assert check_resumable(cfg, run_dir, warn=print) == (2, newest)
    longer = load_config("tiny", ["checkpoint.every=5"], steps=9)  # run length and schedule may change
    assert check_resumable(longer, run_dir, warn=print) == (2, newest)


def test_a_checkpoint_of_another_config_is_refused_naming_the_keys(tmp_path):
    from hpcnft.run.resume import check_resumable

    run_dir = str(tmp_path / "run")
    _checkpoint_of(load_config("tiny"), run_dir, 1)
    other = load_config("tiny", ["optim.lr=0.5"])
    with pytest.raises(ConfigError, match=r"config differs from its checkpoint in optim\.lr \(.* -> 0\.5\)"):
        check_resumable(other, run_dir, warn=print)


def test_without_a_process_group_the_plan_is_rank_0s_own(tmp_path):
    from hpcnft.run.resume import agree_plan

    cfg = load_config("tiny")
    cfg.run_dir = str(tmp_path / "run")
    plan = agree_plan(cfg, 0)  # nothing to resume: a fresh start, decided without any broadcast
    assert plan.checkpoint is None and plan.rebuild_why == "" and plan.warnings == []


def test_a_failure_is_one_line_naming_the_rank():
    from hpcnft.run.output import fail_line

    topo = types.SimpleNamespace(rank=2, role="reward")
    assert fail_line(topo, ValueError("first\nsecond")) == "rank 2 (reward): ValueError: first"
    assert fail_line(topo, KeyError()) == "rank 2 (reward): KeyError: "


def test_the_default_run_dir_is_named_after_the_recipe():
    from hpcnft.run.rundir import default_run_dir

    path = default_run_dir(os.path.join("some", "where", "my_recipe.toml"))
    assert os.path.dirname(path) == "runs" and os.path.basename(path).startswith("my_recipe-")


def test_run_file_is_closed_before_the_job_is_requeued(monkeypatch, capsys):
    from hpcnft.run import job

    order = []
    writer = types.SimpleNamespace(close=lambda: order.append("close"))

    def fake_requeue(job, log):
        order.append(f"requeue {job}")
        return f"requeued Slurm job {job}" if job == "7" else f"scontrol requeue {job} failed: Invalid job id"
    monkeypatch.setattr(job, "requeue", fake_requeue)
    job.close_then_requeue(writer, "7")
    assert order == ["close", "requeue 7"]  # Slurm kills the job's processes right after a requeue
    assert "hpcnft: requeued Slurm job 7" in capsys.readouterr().out
    order.clear()
    job.close_then_requeue(writer, "")  # not under Slurm, or SIGTERM: close only
    assert order == ["close"]
    job.close_then_requeue(None, "8")
    assert capsys.readouterr().err.strip() == "hpcnft: scontrol requeue 8 failed: Invalid job id"


def test_the_reward_line_names_each_training_term_its_weight_and_what_it_scores():
    from hpcnft.rewards.config import RewardTermConfig as Term
    from hpcnft.rewards.registry import training_terms
    from hpcnft.run.output import reward_header

    assert reward_header(1.0, training_terms(load_config("tiny"))) == "reward = pickscore (PickScore)"
    jpeg = Term(kind="jpeg_compressibility", name="jpeg_compressibility")
    assert reward_header(1.0, [jpeg]) == "reward = jpeg_compressibility (-JPEG kB)"
    mix = [Term(kind="hpsv2", name="hps", weight=0.5), Term(kind="jpeg_compressibility", name="small", weight=-0.002)]
    assert reward_header(2.0, mix) == "reward = 2 x (0.5 x hps (HPS v2.1) - 0.002 x small (-JPEG kB))"


def test_the_terms_warnings_of_a_step_become_its_warning_events_each_text_once():
    from types import SimpleNamespace

    from hpcnft.run.job import TrainJob

    reported = []
    job = SimpleNamespace(tr=SimpleNamespace(client=SimpleNamespace(take_warnings=lambda: ["a", "b", "a"])),
                          group=None, topo=SimpleNamespace(rank=0, train_ranks=[0]),
                          _report_warning=lambda text, step: reported.append((step, text)))
    TrainJob.report_term_warnings(job, 4)
    assert reported == [(4, "a (x2)"), (4, "b")]
    job.topo.rank = 1  # another train rank hands them on and reports nothing itself
    TrainJob.report_term_warnings(job, 5)
    assert reported == [(4, "a (x2)"), (4, "b")]


def _outage_job(tmp_path, evaluate):
    """A TrainJob without models: a learner whose evaluation is `evaluate`, a checkpointer that
    records its saves, a real run.h5."""
    from hpcnft.io.run_writer import RunFileWriter
    from hpcnft.io.trackers import TrackerGroup
    from hpcnft.run.job import TrainJob

    job = TrainJob.__new__(TrainJob)
    job.cfg = load_config("tiny", ["eval.every=2"], steps=4)
    job.cfg.run_dir = str(tmp_path)
    job.topo = types.SimpleNamespace(rank=0, train_ranks=[0])
    job.group, job.saved_step, job.resume_command = None, 0, "hpcnft run tiny --run-dir R --steps 4"
    job.writer = RunFileWriter(str(tmp_path / "run.h5"), "{}", "test", NFT_KEYS)
    job.trackers = TrackerGroup([], print)
    saves, finished = [], []
    job.checkpointer = types.SimpleNamespace(save=lambda step, rng=None: saves.append((step, rng)))
    ro = types.SimpleNamespace(images=None)
    job.tr = types.SimpleNamespace(iteration=lambda step: ({"train/nft_loss": 1.0}, ro), evaluate=evaluate,
                                   client=types.SimpleNamespace(finish=lambda step, preempted: finished.append(step)))
    job.cfg.logging.sample_grid_every = 0
    return job, saves, finished


def test_an_outage_in_an_evaluation_keeps_the_trained_step_and_owes_the_evaluation(tmp_path, capsys):
    from hpcnft.distributed.reward_service import RewardOutage

    def down():
        raise RewardOutage("reward term 'ocr' (remote http://j/): connection refused after 9 attempts in 30 s")

    job, saves, finished = _outage_job(tmp_path, down)
    metrics, grid, lost = job.iterate(2)  # the step trained, its evaluation lost
    assert metrics == {"train/nft_loss": 1.0} and isinstance(lost, RewardOutage)
    job.log_row(2, metrics)
    assert job.outage(2, lost, note=" (its evaluation is made when the run resumes)") == 69
    assert saves == [(2, None)] and finished == [2] and job.saved_step == 2
    err = capsys.readouterr().err
    assert err.endswith("connection refused after 9 attempts in 30 s; checkpointed step 2 (its evaluation is made "
                        "when the run resumes); `hpcnft run tiny --run-dir R --steps 4` resumes it\n")
    assert job.evaluation_owed(2)  # run.h5 has step 2's training rows, not its evaluation's
    job.log_row(2, {"eval/pickscore_mean": 0.5, "eval/pickscore_std": 0.1})
    assert not job.evaluation_owed(2) and not job.evaluation_owed(3)  # made; no evaluation due at 3
    job.writer.close()


def test_an_outage_in_a_rollout_checkpoints_the_step_before_with_the_rng_it_ended_with(tmp_path, capsys):
    from hpcnft.distributed.reward_service import RewardOutage

    job, saves, finished = _outage_job(tmp_path, lambda: {})
    outage = RewardOutage("reward term 'ocr' (remote http://j/): HTTP 503 after 40 attempts in 300 s")
    assert job.outage(2, outage, b"rng of step 2") == 69 and saves == [(2, b"rng of step 2")]
    job.saved_step = 3
    assert job.outage(3, outage, b"x") == 69 and saves == [(2, b"rng of step 2")]  # checkpointed already
    assert job.outage(0, outage) == 69 and len(saves) == 1  # nothing finished: nothing to save
    assert capsys.readouterr().err.splitlines()[-1].endswith("; no step was finished: nothing to save")
    job.writer.close()
