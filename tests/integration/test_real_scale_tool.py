"""tools/real_scale_job.py, the measurement of a whole job, tried on the tiny models on the CPU
(`--cpu`): the folders it is pointed at, an uninterrupted run, a run preempted and resumed, the
comparison, the export loaded into diffusers, the memory each rank held, and the bench's iteration
at the job's own settings beside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_tool_measures_a_run_its_preemption_resume_comparison_and_export(tiny_models, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    os.symlink(tiny_models[0], weights / "sd35m")
    os.symlink(tiny_models[1], weights / "pickscore")
    out = tmp_path / "out" / "job.json"
    # torchrun's variables, as an earlier in-process submitit job leaves them: the tool's job is the local
    # spawner's all the same
    launcher = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "real_scale_job.py"), "--model", "sd35m",
                        "--recipe", "tiny", "--weights", str(weights), "--runs", str(tmp_path / "runs"), "--out",
                        str(out), "--steps", "4", "--preempt-at", "3", "--cpu", "--phases", "make,run,resume,export,bench",
                        "--set", "checkpoint.every=2", "--bench", "auto --iteration-warm 0 --iteration-reps 1"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **launcher})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    full, cut, again = got["full"], got["preempted"], got["resumed"]
    assert full["rc"] == 0 and cut["rc"] == 75 and again["rc"] == 0
    assert 0 < full["loaded_s"] < full["first_step_s"] < full["step_4_s"] <= full["wall_s"]
    assert sorted(full["parts"]["perf/iteration_s"]) == ["1", "2", "3", "4"]
    assert [c["step"] for c in full["checkpoints"]] == [2, 4] and all(c["mib"] > 0 for c in full["checkpoints"])
    assert sorted(full["host_rss_gib"]) == ["rank0", "rank1", "rank2"]
    stopped = cut["preempted_at"]  # the step under way when the signal came, or the one before
    assert stopped in (2, 3) and f"step_{stopped}_s" not in again and again["first_step_s"] == again[f"step_{stopped + 1}_s"]
    assert got["compare"]["rc"] == 0 and got["compare"]["out"].startswith("same:")
    assert got["export"]["rc"] == 0 and got["export"]["diffusers_load_rc"] == 0
    assert os.path.exists(os.path.splitext(out)[0] + ".log")
    # the bench's one-process iteration at the job's own settings, and the job's efficiency against it
    bench = got["bench"]
    assert bench["rc"] == 0 and bench["settings_not_matched"] == {}, bench
    assert "determinism.enabled=true" in bench["args"] and "rollout.samples_per_prompt=4" in bench["args"]
    assert bench["args"][-4:] == ["--iteration-warm", "0", "--iteration-reps", "1"]  # what follows "auto"
    doc = json.loads(open(bench["json"]).read())
    assert doc["stacks"]["hpcnft_fast"]["phases"]["iteration"]["samples"] == 16
    eff = got["efficiency"]
    assert eff["bench_iteration_s"] == round(doc["stacks"]["hpcnft_fast"]["phases"]["iteration"]["s"], 3)
    assert eff["efficiency"] > 0 and abs(eff["efficiency"] - eff["bench_iteration_s"] / eff["job_iteration_s"]) < 0.01


def test_the_tool_stopped_by_its_time_limit_takes_its_job_with_it(tiny_models, tmp_path):
    """`timeout` (SIGTERM) ends the tool mid-run: no rank of the job may outlive it (they would hold
    the GPU for the next command), and the JSON keeps what the cut run measured."""
    import signal

    import psutil

    weights = tmp_path / "weights"
    weights.mkdir()
    os.symlink(tiny_models[0], weights / "sd35m")
    os.symlink(tiny_models[1], weights / "pickscore")
    tool = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "real_scale_job.py"), "--model", "sd35m",
                             "--recipe", "tiny", "--weights", str(weights), "--runs", str(tmp_path / "runs"), "--out",
                             str(tmp_path / "out" / "job.json"), "--steps", "50", "--cpu", "--phases", "run"],
                            stdout=subprocess.PIPE, text=True)
    for line in tool.stdout:
        if "step 1/50" in line:
            break
    run_dir = str(tmp_path / "runs" / "full")
    ranks = [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("hpcnft-rank-")
             and any(f.path.startswith(run_dir + os.sep) for f in p.open_files())]  # their logs
    assert len(ranks) == 3
    tool.send_signal(signal.SIGTERM)
    tool.wait(timeout=60)
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, alive
    cut = json.loads((tmp_path / "out" / "job.json").read_text())["full"]
    # (the tool is stopped as step 1's line arrives: its wall time may be that line's, to the tenth)
    assert cut["cut"] and 0 < cut["loaded_s"] < cut["step_1_s"] <= cut["wall_s"]
    assert sorted(cut["host_rss_gib"]) == ["rank0", "rank1", "rank2"]
