"""Each registered algorithm's run file: its keys beside the shared ones, the last step from the
training rows, `watch` following the loss column the file names, the progress line naming the
algorithm's loss; a file that names no loss (older versions) is still followed."""
from __future__ import annotations

import pytest

from hpcnft.algo.registry import specs
from hpcnft.io import run_state
from hpcnft.io.live_run import RunFollower
from hpcnft.io.run_writer import RunFileWriter
from hpcnft.io.runfile import ALL_KEYS, LOSS_ATTR, read_run
from hpcnft.run.output import progress_line

SHARED = {"train/grad_norm": 0.125, "rollout/reward/raw_mean": -4.0, "rollout/reward/raw_std": 0.05,
          "perf/iteration_s": 1.5}


def row(spec) -> dict[str, float]:
    return {**SHARED, **{k: 0.25 + i for i, k in enumerate(spec.metric_keys)}}


def written(path: str, spec, steps: int, loss_key: str | None, keys=None) -> RunFileWriter:
    w = RunFileWriter(path, "{}", "x", tuple(spec.metric_keys if keys is None else keys), loss_key=loss_key)
    w.add_attempt({"from_step": 0})
    w.event(0, "start", "go")
    for step in range(1, steps + 1):
        w.append_metrics(step, row(spec))
    return w


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_the_keys_and_the_last_step_of_each_algorithm_s_run(tmp_path, spec):
    assert spec.metric_keys[0] == spec.loss_key and not set(spec.metric_keys) & set(ALL_KEYS)
    path = str(tmp_path / "run.h5")
    others = [k for s in specs() if s is not spec for k in s.metric_keys]
    w = written(path, spec, 3, spec.loss_key, (*spec.metric_keys, *others))  # another's keys empty, as in old files
    assert w.last_step() == 3
    w.close()
    run = read_run(path)
    assert run_state.last_step(run) == 3 and run.attrs[LOSS_ATTR] == spec.loss_key
    assert run.metrics[spec.loss_key][:, 0].tolist() == [1, 2, 3] and all(len(run.metrics[k]) == 0 for k in others)


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_watch_follows_the_loss_the_file_names(tmp_path, spec):
    path = str(tmp_path / "run.h5")
    w = written(path, spec, 2, spec.loss_key)
    w.event(2, "done", "finished")
    w.close()
    lines, end = RunFollower(path).poll()
    label = spec.loss_key.removeprefix("train/")
    assert end == "done" and [line for line in lines if line.startswith("step ")] == [
        f"step {s}  reward -4  {label} 0.25  grad_norm 0.125" for s in (1, 2)]


def test_a_file_that_names_no_loss_is_followed_by_its_gradient_norm(tmp_path):
    path = str(tmp_path / "run.h5")
    w = written(path, specs()[0], 2, None)
    w.event(2, "done", "finished")
    w.close()
    lines, end = RunFollower(path).poll()
    assert end == "done" and [line for line in lines if line.startswith("step ")] == [
        "step 1  reward -4  grad_norm 0.125", "step 2  reward -4  grad_norm 0.125"]


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_the_progress_line_names_the_algorithm_s_loss(spec):
    line = progress_line(2, 4, row(spec), 3.0, 1, spec.loss_key)
    label = spec.loss_key.removeprefix("train/")
    assert f"| {label} 0.2500 | grad_norm 1.250e-01 |" in line
    assert all(s.loss_key.removeprefix("train/") not in line for s in specs() if s is not spec)
