"""The guard and the best checkpoint in a real job, on a synthetic run: both reward terms are
remote terms of a scoring server in this process, the trained one scoring higher at every call
and the held-out judge (eval_only) lower, so the trained reward rises while the judge falls, as
in a hacked run. Started for one step (the best checkpoint), then resumed with the guard set to
stop: it stops at step 2 with a checkpoint and one line; the best checkpoint (step 1) survives the
resume and the pruning (checkpoint.keep = 1), and `hpcnft export --checkpoint best` exports it."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from jobs import assert_same_metrics, hpcnft
from hpcnft.io.checkpoint_dirs import list_checkpoints, read_best
from hpcnft.io.runfile import read_run
from hpcnft.rewards.http_server import ScoringServer, serve_in_thread

pytestmark = pytest.mark.slow


def counting(start: float, by: float):
    """A term whose every image scores start + by * (how many calls came before)."""
    calls = itertools.count()

    def score(prompts, images):
        return np.full(len(images), start + by * next(calls), dtype=np.float32)

    return score


@pytest.fixture
def judge_server():
    server = ScoringServer(("127.0.0.1", 0), {"rising": counting(0.0, 0.01), "judge": counting(1.0, -0.05)})
    serve_in_thread(server)
    yield server.port
    server.shutdown()
    server.server_close()


def terms(port: int) -> str:
    def remote(name: str, extra: str = "") -> str:
        return (f'{{kind="remote", name="{name}", url="http://127.0.0.1:{port}/v1/score/{name}", timeout_s=30.0, '
                f'retry_for_s=10.0, token_env=""{extra}}}')
    return f'reward.terms=[{remote("rising")}, {remote("judge", ", eval_only=true")}]'


def test_a_hacked_run_is_stopped_by_the_guard_and_its_best_checkpoint_is_kept(judge_server, tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "best")
    sets = ["--set", terms(judge_server), "--set", "eval.every=1", "--set", "checkpoint.every=0",
            "--set", "checkpoint.keep=1", "--set", "checkpoint.keep_best=eval/judge_mean",
            "--set", "watch.guard_metric=eval/judge_mean", "--set", "watch.guard_drop=0.05"]
    hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, *sets)
    assert read_best(run_dir)["step"] == 1
    r = hpcnft("run", "tiny", "--steps", "4", "--run-dir", run_dir, *sets, "--set", "watch.guard_action=stop")
    assert "hpcnft: stopped by the guard at step 2: checkpointed" in r.stdout, r.stdout
    guard_lines = [line for line in r.stderr.splitlines() if "guard:" in line]
    assert len(guard_lines) == 1 and guard_lines[0].startswith("hpcnft: guard: eval/judge_mean fell "), r.stderr
    run = read_run(run_dir)
    events = [(e["step"], e["kind"]) for e in run.events if e["kind"] in ("guard", "best", "done")]
    assert events == [(1, "best"), (1, "done"), (2, "guard"), (2, "done")], events
    judge, rising = run.metrics["eval/judge_mean"][:, 1], run.metrics["rollout/reward/raw_mean"][:, 1]
    assert judge[1] < judge[0] and rising[1] > rising[0]  # the hack the guard saw
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2]  # the best beside the newest (keep = 1)
    assert read_best(run_dir)["step"] == 1
    show = hpcnft("show", run_dir).stdout
    assert "guard on eval/judge_mean (drop 0.05, stop): fired 1 time(s), last at step 2" in show
    assert "best checkpoint by eval/judge_mean: step 1" in show
    exported = hpcnft("export", run_dir, out, "--checkpoint", "best").stdout
    assert "checkpoints/step_000001 (step 1)" in exported


def test_the_watchs_metrics_are_the_same_bits_in_two_runs(tmp_path):
    """Diversity every step, drift and the adapters' norm at every evaluation: nothing random
    drawn, no order that varies, so two runs of one config write the same rows."""
    sets = ["--set", "watch.diversity=true", "--set", "watch.drift_sigmas=[0.3,0.8]", "--set", "eval.every=1"]
    runs = [str(tmp_path / name) for name in ("a", "b")]
    for run_dir in runs:
        hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, *sets)
    assert_same_metrics(*runs)
    metrics = read_run(runs[0]).metrics
    assert [len(metrics[k]) for k in ("rollout/diversity", "eval/drift", "eval/lora_norm")] == [1, 1, 1]
