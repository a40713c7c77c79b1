"""`hpcnft plot --smooth`: the rolling mean and the per-pass mean against direct computations
(loops over the rows and over the prompt positions of each step), and the figure drawing them."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcnft.cli import plots
from hpcnft.common.errors import UsageError
from hpcnft.io.runfile import RunData

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def direct_rolling(steps, values, window):
    out = []
    for k in steps:
        inside = [v for s, v in zip(steps, values) if k - window < s <= k and math.isfinite(v)]
        out.append(sum(inside) / len(inside) if inside else math.nan)
    return out


def direct_passes(steps, values, per_step, n):
    """Each step's pass from the position of its first prompt in the endless stream over the n
    prompts; a pass counts once the rows reach the last step that starts in it."""
    def pass_of(k):
        position = (k - 1) * per_step
        return math.floor(position / n)

    groups: dict[int, list[tuple[int, float]]] = {}
    for s, v in zip(steps, values):
        groups.setdefault(pass_of(int(s)), []).append((s, v))
    centres, means = [], []
    for p in sorted(groups):
        last = max(k for k in range(0, int(steps[-1]) + 10 * n) if pass_of(k) == p)
        if steps[-1] < last:
            continue
        rows = groups[p]
        finite = [v for _, v in rows if math.isfinite(v)]
        centres.append(sum(s for s, _ in rows) / len(rows))
        means.append(sum(finite) / len(finite) if finite else math.nan)
    return centres, means


STEPS = np.array([1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14], dtype=float)  # step 5 missing
VALUES = np.array([0.5, 0.25, math.nan, 1.0, 2.0, -1.0, 0.75, 3.0, math.nan, math.nan, 0.125, 4.0, 1.5])


@pytest.mark.parametrize("window", [1, 2, 3, 5, 20])
def test_rolling_mean_is_the_mean_of_the_finite_values_of_the_last_n_steps(window):
    got = plots.rolling_mean(STEPS, VALUES, window)
    np.testing.assert_allclose(got, direct_rolling(STEPS, VALUES, window), rtol=1e-12, equal_nan=True)


def test_rolling_mean_of_one_step_is_the_values_and_a_window_of_nans_is_nan():
    np.testing.assert_array_equal(plots.rolling_mean(STEPS, VALUES, 1), VALUES)
    assert math.isnan(plots.rolling_mean(STEPS, VALUES, 2)[STEPS.tolist().index(11)])  # steps 10, 11: NaN
    assert len(plots.rolling_mean(np.zeros(0), np.zeros(0), 3)) == 0


@pytest.mark.parametrize("per_step,n", [(4, 8), (4, 10), (3, 3), (2, 32), (5, 7)])
def test_pass_means_match_the_passes_of_the_prompt_positions(per_step, n):
    rng = np.random.default_rng(per_step * 100 + n)
    steps = np.arange(1, 30, dtype=float)
    values = rng.normal(size=len(steps))
    values[3] = math.nan
    x, y = plots.pass_means(steps, values, per_step, n)
    want_x, want_y = direct_passes(steps, values, per_step, n)
    assert len(want_x) > 0
    np.testing.assert_allclose(x, want_x, rtol=1e-12)
    np.testing.assert_allclose(y, want_y, rtol=1e-12, equal_nan=True)


def test_the_unfinished_last_pass_is_left_out_and_step_0_is_a_pass_of_its_own():
    # 8 prompts, 4 a step: passes are steps 1-2, 3-4, 5-6; the run stopped at step 5
    steps = np.array([0, 1, 2, 3, 4, 5], dtype=float)
    values = np.array([9.0, 1.0, 3.0, 5.0, 7.0, 100.0])
    x, y = plots.pass_means(steps, values, 4, 8)
    np.testing.assert_array_equal(x, [0.0, 1.5, 3.5])
    np.testing.assert_array_equal(y, [9.0, 2.0, 6.0])


def run_with(config) -> RunData:
    rows = np.array([[1, 0.0], [2, 1.0], [3, 2.0], [4, 3.0]], dtype=float)
    return RunData(path="/runs/a/run.h5", attrs={}, config=config, metrics={"rollout/reward/raw_mean": rows},
                   topology={}, attempts=[], events=[])


def test_pass_length_comes_from_the_runs_prompt_file_and_prompts_per_step(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n\nc\n")
    run = run_with({"data": {"train_prompts": str(prompts)}, "rollout": {"prompts_per_step": 2}})
    assert plots.run_pass_length(run) == (2, 3)
    builtin = run_with({"data": {"train_prompts": "builtin:tiny_train_prompts.txt"},
                        "rollout": {"prompts_per_step": 4}})
    assert plots.run_pass_length(builtin) == (4, 32)


def test_pass_length_of_a_run_without_its_prompts_is_one_line_naming_the_key(tmp_path):
    gone = run_with({"data": {"train_prompts": str(tmp_path / "gone.txt")}, "rollout": {"prompts_per_step": 2}})
    with pytest.raises(UsageError) as e:
        plots.run_pass_length(gone)
    assert "data.train_prompts" in str(e.value) and "gone.txt" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="rollout.prompts_per_step"):
        plots.run_pass_length(run_with({"train": {}}))


@pytest.mark.parametrize("text,want", [(None, None), ("epoch", "epoch"), ("1", 1), ("12", 12)])
def test_smooth_option_values(text, want):
    assert plots.parse_smooth(text) == want


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "pass"])
def test_smooth_option_refuses_other_values(text):
    with pytest.raises(UsageError, match="--smooth"):
        plots.parse_smooth(text)


@pytest.mark.parametrize("smooth", [2, "epoch"])
def test_smoothed_figure_draws_the_raw_values_faint_behind_the_smoothed_curve(tmp_path, smooth):
    import matplotlib.pyplot as plt

    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\nd\n")
    run = run_with({"data": {"train_prompts": str(prompts)}, "rollout": {"prompts_per_step": 2}})
    fig, keys = plots.curves_figure([run], ["rollout/reward/raw_mean"], smooth=smooth)
    raw, smoothed = fig.axes[0].get_lines()
    rows = run.metrics["rollout/reward/raw_mean"]
    np.testing.assert_array_equal(raw.get_ydata(), rows[:, 1])
    assert raw.get_alpha() < 0.5 and smoothed.get_alpha() in (None, 1.0)
    assert raw.get_color() == smoothed.get_color()
    if smooth == "epoch":  # 4 prompts, 2 a step: steps 1-2 and 3-4
        np.testing.assert_array_equal(smoothed.get_ydata(), [0.5, 2.5])
        assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a, pass of 2 steps"]
    else:
        np.testing.assert_array_equal(smoothed.get_ydata(), [0.0, 0.5, 1.5, 2.5])
    plt.close(fig)


def test_counting_a_runs_prompts_leaves_torch_unimported():
    # the run-file tools start fast: reading the prompt file must not pull the job's modules in
    code = ("import sys; from hpcnft.cli import report, plots; "
            "from hpcnft.io.runfile import RunData; "
            "run = RunData('r', {}, {'data': {'train_prompts': 'builtin:tiny_train_prompts.txt'}, "
            "'rollout': {'prompts_per_step': 4}}, {}, {}, [], []); "
            "assert plots.run_pass_length(run) == (4, 32); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.stdout.strip() == "False"


def curves(fig) -> dict[str, list[tuple[str, list[float]]]]:
    """Panel title -> (legend label, plotted values) of each curve drawn opaque (not faint)."""
    return {ax.get_title(): [(line.get_label(), line.get_ydata().tolist()) for line in ax.get_lines()
                             if line.get_alpha() in (None, 1.0)]
            for ax in fig.axes if ax.get_visible()}


def test_a_run_shorter_than_one_pass_is_drawn_raw_and_says_why():
    """32 prompts, 4 a step: the first pass ends at step 8, the run at step 4. A pass mean would
    leave every panel empty (legends without points); the raw values are drawn instead."""
    import matplotlib.pyplot as plt

    run = run_with({"data": {"train_prompts": "builtin:tiny_train_prompts.txt"}, "rollout": {"prompts_per_step": 4}})
    run.metrics["eval/pickscore_mean"] = np.array([[0, 0.5], [4, 0.75]])
    fig, keys = plots.curves_figure([run], smooth="epoch")
    assert curves(fig) == {"rollout/reward/raw_mean": [("a, raw: no finished pass", [0.0, 1.0, 2.0, 3.0])],
                           "eval/pickscore_mean": [("a, raw: no finished pass", [0.5, 0.75])]}
    assert "raw values" in fig._suptitle.get_text()
    plt.close(fig)
    assert plots.epoch_notes([run], keys) == [
        "a: --smooth epoch draws the raw values: the run ends at step 4, before one pass over its 32 training "
        "prompts (8 steps of 4) ends"]


def test_an_evaluation_only_in_the_unfinished_last_pass_is_drawn_raw_beside_the_pass_means(tmp_path):
    import matplotlib.pyplot as plt

    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\nd\n")
    run = run_with({"data": {"train_prompts": str(prompts)}, "rollout": {"prompts_per_step": 2}})
    run.metrics["rollout/reward/raw_mean"] = np.array([[1, 0.0], [2, 1.0], [3, 2.0], [4, 3.0], [5, 4.0]])
    run.metrics["eval/pickscore_mean"] = np.array([[5, 0.25]])  # in pass 3 (steps 5-6), unfinished
    fig, keys = plots.curves_figure([run], smooth="epoch")
    assert curves(fig) == {"rollout/reward/raw_mean": [("a, pass of 2 steps", [0.5, 2.5])],
                           "eval/pickscore_mean": [("a, raw: no finished pass", [0.25])]}
    assert fig._suptitle.get_text().endswith("; raw where no pass is finished)")
    plt.close(fig)
    (note,) = plots.epoch_notes([run], keys)
    assert note.startswith("a: --smooth epoch draws eval/pickscore_mean raw: no finished pass")


def test_the_default_panels_put_each_evaluation_mean_beside_the_rollout_reward():
    import matplotlib.pyplot as plt

    run = run_with({})
    rows = run.metrics["rollout/reward/raw_mean"]
    for key in ("train/nft_loss", "train/grad_norm", "eval/aesthetic_mean", "eval/aesthetic_std",
                "eval/pickscore_mean"):
        run.metrics[key] = rows
    fig, keys = plots.curves_figure([run])
    assert keys == ["rollout/reward/raw_mean", "eval/pickscore_mean", "eval/aesthetic_mean", "train/nft_loss",
                    "train/grad_norm"]
    first_row = [ax.get_title() for ax in fig.axes[:2]]  # two panels a row
    assert first_row == ["rollout/reward/raw_mean", "eval/pickscore_mean"]
    plt.close(fig)
    assert plots.default_keys({"rollout/reward/raw_mean", "train/nft_loss"}) == ["rollout/reward/raw_mean",
                                                                                  "train/nft_loss"]
    # [watch]'s measures after the judges, where the run has them
    assert plots.default_keys({"rollout/reward/raw_mean", "eval/judge_mean", "rollout/diversity", "eval/drift",
                               "eval/lora_norm", "train/nft_loss"}) == [
        "rollout/reward/raw_mean", "eval/judge_mean", "eval/drift", "rollout/diversity", "train/nft_loss"]


# -- --x time|both: against seconds of training ------------------------------------------------
def timed_run(path: str, seconds: list[float]) -> RunData:
    """Four steps of reward 0, 1, 2, 3 whose iterations took `seconds`, and an evaluation at step 0."""
    run = run_with({"data": {"train_prompts": "builtin:tiny_train_prompts.txt"}, "rollout": {"prompts_per_step": 4}})
    run.path = path
    run.metrics["perf/iteration_s"] = np.array([[k + 1, s] for k, s in enumerate(seconds)])
    run.metrics["eval/pickscore_mean"] = np.array([[0, 0.5], [4, 0.75]])
    return run


def test_time_axis_puts_each_row_at_the_sum_of_the_iterations_through_its_step():
    import matplotlib.pyplot as plt

    fast = timed_run("/runs/fast/run.h5", [1.0, 1.0, 1.0, 1.0])
    slow = timed_run("/runs/slow/run.h5", [2.0, 3.0, 2.0, 1.0])
    fig, _ = plots.curves_figure([fast, slow], ["rollout/reward/raw_mean", "eval/pickscore_mean"], x_axis="time")
    reward, evals = fig.axes[0], fig.axes[1]
    assert [line.get_xdata().tolist() for line in reward.get_lines()] == [[1, 2, 3, 4], [2, 5, 7, 8]]
    assert [line.get_xdata().tolist() for line in evals.get_lines()] == [[0, 4], [0, 8]]  # before step 1: 0 s
    assert reward.get_xlabel() == "seconds of training (the sum of perf/iteration_s)"
    plt.close(fig)


def test_time_axis_with_epoch_means_puts_a_pass_at_its_middle_step_s_time():
    import matplotlib.pyplot as plt

    run = timed_run("/runs/a/run.h5", [1.0, 2.0, 4.0, 8.0])
    run.config = {"data": {"train_prompts": "builtin:tiny_train_prompts.txt"}, "rollout": {"prompts_per_step": 16}}
    fig, _ = plots.curves_figure([run], ["rollout/reward/raw_mean"], smooth="epoch", x_axis="time")
    raw, means = fig.axes[0].get_lines()  # 32 prompts, 16 a step: passes of steps 1-2 and 3-4
    assert raw.get_xdata().tolist() == [1, 3, 7, 15] and means.get_ydata().tolist() == [0.5, 2.5]
    assert means.get_xdata().tolist() == [2.0, 11.0]  # steps 1.5 and 3.5: halfway between the steps' times
    plt.close(fig)


def test_both_axes_draw_each_key_against_steps_then_seconds():
    import matplotlib.pyplot as plt

    fig, keys = plots.curves_figure([timed_run("/runs/a/run.h5", [1.0, 2.0, 1.0, 2.0])],
                                    ["rollout/reward/raw_mean", "eval/pickscore_mean"], x_axis="both")
    shown = [(ax.get_title(), ax.get_xlabel().split()[0]) for ax in fig.axes if ax.get_visible()]
    assert shown == [("rollout/reward/raw_mean", "step"), ("rollout/reward/raw_mean", "seconds"),
                     ("eval/pickscore_mean", "step"), ("eval/pickscore_mean", "seconds")]
    assert keys == ["rollout/reward/raw_mean", "eval/pickscore_mean"]
    plt.close(fig)


def test_time_axis_of_a_run_without_iteration_times_is_one_line():
    with pytest.raises(UsageError, match=r"^/runs/a/run.h5: --x time needs the run's perf/iteration_s"):
        plots.curves_figure([run_with({})], ["rollout/reward/raw_mean"], x_axis="time")


def test_flow_grpo_s_loss_is_a_default_panel():
    assert plots.default_keys({"rollout/reward/raw_mean", "train/grpo_loss", "train/grad_norm"}) == [
        "rollout/reward/raw_mean", "train/grpo_loss", "train/grad_norm"]
