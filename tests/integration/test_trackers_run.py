"""Live trackers in real runs of the tiny job: after a start killed past its checkpoint, a
preemption and a final start, TensorBoard (read by its own EventAccumulator) and the wandb
offline run files show every step of run.h5 once, with run.h5's values, and the sample grids."""
from __future__ import annotations

import os
import re
import signal

import numpy as np
import psutil
import pytest

from jobs import hpcnft, kill_all_ranks, rank_pids, start, wait_for_line
from hpcnft.io.runfile import read_run
from tracker_files import tensorboard_reader, tensorboard_scalars, wandb_history, wandb_offline_runs

pytestmark = pytest.mark.slow

STEPS = "6"
BOTH = ["--set", 'logging.trackers=["tensorboard", "wandb"]', "--set", "logging.sample_grid_every=2"]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def _rows(run_dir: str) -> dict[str, np.ndarray]:
    return {k: v for k, v in read_run(run_dir).metrics.items() if len(v)}


def _assert_tensorboard_matches(run_dir: str, grid_steps: list[int]) -> None:
    rows, shown = _rows(run_dir), tensorboard_scalars(os.path.join(run_dir, "tensorboard"))
    assert set(shown) == set(rows)
    for key, series in rows.items():
        assert [s for s, _ in shown[key]] == [int(s) for s in series[:, 0]], key  # each step once
        assert np.array_equal(np.array([v for _, v in shown[key]], np.float32), series[:, 1].astype(np.float32),
                              equal_nan=True), key
    images = tensorboard_reader(os.path.join(run_dir, "tensorboard")).Images("samples")
    assert [i.step for i in images] == grid_steps


def _assert_wandb_rows_match(run_dir: str, history: list[dict], non_perf_only: bool = False) -> None:
    rows = _rows(run_dir)
    for row in history:
        step = row["_step"]
        for key, series in rows.items():
            if non_perf_only and key.startswith("perf/"):
                continue
            at = series[series[:, 0] == step]
            if len(at):
                assert row[key] == at[0, 1], (key, step)
            else:
                assert key not in row, (key, step)


def _kill_job(proc) -> None:
    """SIGKILL every rank; the helpers they started (wandb's service) are then waited for by pid."""
    helpers = [c for pid in rank_pids(proc.pid).values() for c in psutil.Process(pid).children(recursive=True)]
    kill_all_ranks(proc)
    _, alive = psutil.wait_procs(helpers, timeout=30)
    for p in alive:
        p.kill()


def test_killed_preempted_and_finished_starts_show_each_step_once(tmp_path):
    run_dir = str(tmp_path / "run")
    args = ["run", "tiny", "--steps", STEPS, "--run-dir", run_dir, "--set", "checkpoint.every=2", *BOTH]
    # start 1: killed outright while step 4 runs (steps 1-3 logged, checkpoint 2)
    proc = start(*args)
    wait_for_line(proc, f"step 3/{STEPS}")
    _kill_job(proc)
    # start 2: resumes after step 2, preempted by SIGUSR2 after step 4 or 5 (a clean close)
    proc = start(*args)
    wait_for_line(proc, f"step 4/{STEPS}")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, f"{out}\n{err}"
    stopped = int(re.search(r"preempted at step (\d+)", out).group(1))
    # start 3: to the end
    r = hpcnft(*args)
    assert "live tracker: tensorboard --logdir" in r.stdout and "(offline)" in r.stdout, r.stdout + r.stderr

    _assert_tensorboard_matches(run_dir, [1, 2, 4, 6])

    folders = wandb_offline_runs(run_dir)
    assert len(folders) == 3
    (id1, rows1), (id2, rows2), (id3, rows3) = (wandb_history(f) for f in folders)
    # one wandb run, resumed: every start's folder is named by its id (the killed start's file may
    # not hold its run record yet: wandb's service had not flushed it)
    assert len({os.path.basename(f).rsplit("-", 1)[1] for f in folders} | {id2, id3}) == 1
    assert id1 in ("", id2)
    # the killed start's rows may be lost (wandb's service buffers them): start 2 fills in from run.h5
    assert [r["_step"] for r in rows2] == list(range(1, stopped + 1))
    assert [r["_step"] for r in rows3] == list(range(stopped + 1, int(STEPS) + 1))  # nothing twice
    _assert_wandb_rows_match(run_dir, rows2 + rows3)
    _assert_wandb_rows_match(run_dir, rows1, non_perf_only=True)  # steps run again: same bits but wall clock
    assert [r["_step"] for r in rows2 + rows3 if "samples" in r] == [1, 2, 4, 6]
    assert all(r["samples"]["_type"] == "image-file" for r in rows2 + rows3 if "samples" in r)


def test_a_tracker_that_cannot_start_then_the_run_continued(tmp_path):
    """Start 1: wandb cannot start (its folder is a file): one warning, exit 0, TensorBoard goes on.
    Start 2 (more steps): run.h5 drops start 1's end-of-run eval at step 2, and so does
    TensorBoard; wandb, now able to start, gets steps 1-2 from run.h5 and 3-4 live."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("not a folder")
    r = hpcnft("run", "tiny", "--steps", "2", "--run-dir", str(run_dir), *BOTH)
    warned = [line for line in r.stderr.splitlines() if "tracker" in line]
    assert len(warned) == 1 and warned[0].startswith("hpcnft: warning: tracker wandb cannot start ("), r.stderr
    assert any(e["kind"] == "warning" and "tracker wandb" in e["text"] for e in read_run(str(run_dir)).events)
    assert [s for s, _ in tensorboard_scalars(str(run_dir / "tensorboard"))["eval/pickscore_mean"]] == [2]

    (run_dir / "wandb").unlink()
    hpcnft("run", "tiny", "--steps", "4", "--run-dir", str(run_dir), *BOTH)
    assert [int(s) for s in _rows(str(run_dir))["eval/pickscore_mean"][:, 0]] == [4]
    _assert_tensorboard_matches(str(run_dir), [1, 2, 4])
    (folder,) = wandb_offline_runs(str(run_dir))
    _, rows = wandb_history(folder)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    _assert_wandb_rows_match(str(run_dir), rows)
    assert [r["_step"] for r in rows if "samples" in r] == [1, 2, 4]
