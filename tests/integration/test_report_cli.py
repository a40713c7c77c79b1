"""The run-file tools through the real command line: compare, show, plot, watch, export-metrics."""
import json
import math
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.io.run_writer import RunFileWriter

from hpcnft.io.runfile import ALL_KEYS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEXT_AFTER_ONE = float(np.nextafter(1.0, 2.0))
CONFIG = {"model": {"name": "tiny"}, "train": {"lr": 3e-4, "steps": 4}}


def hpcnft(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hpcnft", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def make_run(run_dir, nft_loss=(15.25, 16.5, 17.0, 19.0), done=True, config=CONFIG):
    """A finished run (4 steps by default): grad_norm NaN at step 1 (fp16 scaler overflow), eval
    at the last step only."""
    os.makedirs(run_dir, exist_ok=True)
    w = RunFileWriter(os.path.join(run_dir, "run.h5"), json.dumps(config), "0.1.0", NFT_KEYS)
    w.set_topology({"world_size": 3, "backend": "gloo", "roles": ["train", "train", "reward"]})
    w.add_attempt({"when": "2025-01-01T00:00:00", "from_step": 0, "slurm_job_id": "4242", "restart_count": 0})
    w.event(0, "start", "started")
    for step, loss in enumerate(nft_loss, start=1):
        w.append_metrics(step, {"rollout/reward/raw_mean": 0.7 + step / 100, "train/nft_loss": loss,
                                "train/grad_norm": math.nan if step == 1 else 0.02 * step,
                                "train/nft_pos_loss": 0.3, "perf/train_s": 1.0 + step})
    w.append_metrics(len(nft_loss), {"eval/pickscore_mean": 21.5})
    if done:
        w.event(len(nft_loss), "done", "finished")
    w.close()
    return str(run_dir)


@pytest.fixture
def run_a(tmp_path):
    return make_run(tmp_path / "run_a")


def assert_one_line_error(result):
    assert result.returncode == 2, result
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("hpcnft ")


# -- compare ------------------------------------------------------------------------------
def test_compare_run_with_itself_is_same(run_a):
    r = hpcnft("compare", run_a, os.path.join(run_a, "run.h5"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "same: 23 keys, 4 steps"


def test_compare_names_key_step_values_and_ulps_of_a_divergence(tmp_path, run_a):
    run_b = make_run(tmp_path / "run_b", nft_loss=(15.25, 16.5, NEXT_AFTER_ONE, 19.0))
    run_c = make_run(tmp_path / "run_c", nft_loss=(15.25, 16.5, 1.0, 19.0))
    r = hpcnft("compare", run_c, run_b)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"train/nft_loss: first differs at step 3: A=1.0 B={NEXT_AFTER_ONE!r} ulps=1",
        "differ: 1 of 23 keys, first at step 3 (train/nft_loss)",
    ]
    assert hpcnft("compare", run_c, run_b, "--rtol", "1e-12").returncode == 0


def test_compare_json_output(tmp_path, run_a):
    run_b = make_run(tmp_path / "run_b", nft_loss=(15.25, 16.5, 17.0))
    r = hpcnft("compare", run_a, run_b, "--keys", "train/nft_loss", "train/grad_norm", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["keys"] == ["train/grad_norm", "train/nft_loss"]
    short = "steps differ: A has [1, 2, 3, 4], B has [1, 2, 3]"
    assert doc["divergences"] == [
        {"key": "train/grad_norm", "step": 4, "a": 0.08, "b": None, "ulps": None, "reason": short},
        {"key": "train/nft_loss", "step": 4, "a": 19.0, "b": None, "ulps": None, "reason": short},
    ]


def test_compare_of_runs_of_different_lengths_says_so_and_prefix_compares_the_common_steps(tmp_path, run_a):
    short = make_run(tmp_path / "short", nft_loss=(15.25, 16.5))
    r = hpcnft("compare", run_a, short)
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1].endswith(
        "the runs' lengths differ (A runs to step 4, B to step 2): --prefix compares their common steps")
    r = hpcnft("compare", "--prefix", run_a, short)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "same: 23 keys, 2 common steps compared (A runs to step 4, B to step 2)"
    assert json.loads(hpcnft("compare", "--prefix", "--json", short, run_a).stdout)["steps"] == 2
    other = make_run(tmp_path / "other", nft_loss=(15.25, 16.0))
    r = hpcnft("compare", "--prefix", run_a, other)
    assert r.returncode == 1
    assert "train/nft_loss: first differs at step 2" in r.stdout and "2 common steps compared" in r.stdout


def test_compare_missing_requested_key_is_exit_2(run_a):
    r = hpcnft("compare", run_a, run_a, "--keys", "train/nft_loss", "train/no_such_key")
    assert_one_line_error(r)
    assert "train/no_such_key" in r.stderr


def write_text(path, text):
    path.write_text(text)
    return str(path)


def write_plain_hdf5(path):
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    return str(path)


@pytest.mark.parametrize("make_bad, message", [
    (lambda d: str(d / "missing.h5"), "no such run file"),
    (lambda d: str(d / "missing_dir"), "no such run file"),
    (lambda d: str(d / "missing.json"), "no such standard file"),
    (lambda d: write_text(d / "notes.txt", "not a run\n"), "not an HDF5 run file"),
    (lambda d: write_plain_hdf5(d / "other.h5"), "not an hpcnft run file"),
    (lambda d: write_text(d / "broken.json", "{"), "not a JSON standard"),
    (lambda d: write_text(d / "list.json", "[1, 2]"), "not a standard"),
])
def test_compare_unusable_input_is_one_line_exit_2(tmp_path, run_a, make_bad, message):
    r = hpcnft("compare", run_a, make_bad(tmp_path))
    assert_one_line_error(r)
    assert message in r.stderr


# -- standards ----------------------------------------------------------------------------
def test_recorded_standard_matches_its_run_and_catches_a_perturbed_value(tmp_path, run_a):
    standard = tmp_path / "standard.json"
    r = hpcnft("compare", "--record", run_a, standard)
    assert r.returncode == 0, r.stderr
    doc = json.loads(standard.read_text())
    assert doc["meta"]["config"] == CONFIG and doc["meta"]["commit"] and doc["meta"]["hpcnft_version"] == "0.1.0"
    assert list(doc["metrics"]) == sorted(doc["metrics"])
    assert not any(k.startswith("perf/") for k in doc["metrics"])
    assert doc["metrics"]["train/grad_norm"][0] == [1, "NaN"]

    assert hpcnft("compare", run_a, standard).returncode == 0

    doc["metrics"]["rollout/reward/raw_mean"][1][1] = 0.5
    standard.write_text(json.dumps(doc))
    r = hpcnft("compare", run_a, standard)
    assert r.returncode == 1
    assert r.stdout.splitlines()[0].startswith("rollout/reward/raw_mean: first differs at step 2: A=0.72 B=0.5")


def test_record_only_the_requested_keys(tmp_path, run_a):
    standard = tmp_path / "standard.json"
    assert hpcnft("compare", "--record", run_a, standard, "--keys", "train/nft_loss").returncode == 0
    assert list(json.loads(standard.read_text())["metrics"]) == ["train/nft_loss"]
    # A standard may hold fewer keys than the run: only the common ones are compared.
    assert hpcnft("compare", run_a, standard).stdout.splitlines()[-1] == "same: 1 keys, 4 steps"
    assert_one_line_error(hpcnft("compare", "--record", run_a, standard, "--keys", "train/nope"))


# -- show ---------------------------------------------------------------------------------
def test_show_summarises_config_topology_attempts_events_and_metrics(run_a):
    r = hpcnft("show", run_a)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert 'model.name="tiny"' in out and "train.lr=0.0003" in out
    assert "world_size=3" in out
    assert "slurm_job_id=4242" in out and "from_step=0" in out
    assert "done" in out and "finished" in out
    grad_norm = next(line.split() for line in out.splitlines() if line.strip().startswith("train/grad_norm"))
    assert grad_norm == ["train/grad_norm", "4", "0.08", "0.04", "0.08", "1"]  # rows last min max NaNs


def test_show_names_the_policy_the_eval_metrics_are_of(tmp_path, run_a):
    ema = make_run(tmp_path / "ema", config={**CONFIG, "eval": {"policy": "ema", "every": 30}})
    line = next(line for line in hpcnft("show", ema).stdout.splitlines() if line.startswith("eval metrics"))
    assert line.startswith("eval metrics (eval/*) are of the ema policy: the evaluation EMA of theta")
    assert "(eval.policy; `hpcnft export` exports it by default)" in line
    # a config from before eval.policy: those runs evaluated pi_old
    assert "eval metrics (eval/*) are of the old policy: pi_old, the EMA of theta the rollouts sample with " \
           "(the config predates eval.policy;" in hpcnft("show", run_a).stdout


def test_show_of_a_missing_run_is_exit_2(tmp_path):
    assert_one_line_error(hpcnft("show", tmp_path / "nope"))


# -- plot ---------------------------------------------------------------------------------
def read_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.imread(str(path))


def test_plot_writes_a_png_of_overlaid_runs(tmp_path, run_a):
    run_b = make_run(tmp_path / "run_b", nft_loss=(1.0, 2.0, 3.0, 4.0))
    out = tmp_path / "curves.png"
    r = hpcnft("plot", run_a, run_b, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "5 panels, 2 runs" in r.stdout  # the four default training keys and eval/pickscore_mean
    image = read_png(out)
    assert image.shape[0] > 0 and image.shape[1] > 0


def _figure(paths, keys=None):
    from hpcnft.cli import plots as report
    from hpcnft.io.runfile import read_run

    return report.curves_figure([read_run(p) for p in paths], keys)


def test_plot_panels_have_y_labels_and_legends_that_tell_runs_in_other_folders_apart(tmp_path):
    import matplotlib.pyplot as plt

    a = make_run(tmp_path / "sweep_a" / "run")
    b = make_run(tmp_path / "sweep_b" / "run", nft_loss=(1.0, 2.0, 3.0, 4.0))
    c = make_run(tmp_path / "solo")
    fig, keys = _figure([a, os.path.join(b, "run.h5"), c])
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == keys
    assert [ax.get_ylabel() for ax in axes] == [k.rsplit("/", 1)[-1] for k in keys]
    for ax in axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["sweep_a/run", "sweep_b/run", "solo"]
    plt.close(fig)
    fig, _ = _figure([a, a], ["train/nft_loss"])  # the same run twice is numbered, not merged
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["run #1", "run #2"]
    plt.close(fig)


def test_plot_of_a_single_step_centres_it_with_whole_step_ticks(tmp_path):
    import matplotlib.pyplot as plt

    one = make_run(tmp_path / "one", nft_loss=(15.25,))
    fig, keys = _figure([one], ["train/nft_loss", "eval/pickscore_mean"])
    for ax in fig.axes:
        assert ax.get_xlim() == (0.0, 2.0)
        assert list(ax.get_xticks()) == [1.0]
        lo, hi = ax.get_ylim()
        (value,) = ax.get_lines()[0].get_ydata()
        assert lo < value < hi and hi - lo <= abs(value) * 0.2
    fig.canvas.draw()
    assert all(ax.yaxis.get_offset_text().get_text() == "" for ax in fig.axes)  # no "+1.525e1" offsets
    plt.close(fig)
    out = tmp_path / "one.png"
    r = hpcnft("plot", one, "-o", out)
    assert r.returncode == 0, r.stderr
    assert read_png(out).size > 0


def test_plot_unknown_key_is_exit_2(tmp_path, run_a):
    assert_one_line_error(hpcnft("plot", run_a, "-o", tmp_path / "x.png", "--keys", "train/kl_loss"))


def test_plot_smoothed_by_steps_or_by_pass_over_the_prompts_writes_a_png(tmp_path, run_a):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    config = {**CONFIG, "data": {"train_prompts": str(prompts)}, "rollout": {"prompts_per_step": 2}}
    cycling = make_run(tmp_path / "cycling", nft_loss=(1.0, 3.0, 2.0, 6.0, 5.0, 7.0), config=config)
    for smooth in ("3", "epoch"):
        out = tmp_path / f"smooth_{smooth}.png"
        r = hpcnft("plot", cycling, "-o", out, "--smooth", smooth)
        assert r.returncode == 0, r.stderr
        assert "5 panels, 1 runs" in r.stdout
        assert read_png(out).size > 0
    # the rolling mean also reads runs without prompts; the pass needs them, one line if gone
    assert hpcnft("plot", run_a, cycling, "-o", tmp_path / "both.png", "--smooth", "2").returncode == 0
    assert_one_line_error(hpcnft("plot", run_a, "-o", tmp_path / "x.png", "--smooth", "epoch"))
    prompts.unlink()
    r = hpcnft("plot", cycling, "-o", tmp_path / "x.png", "--smooth", "epoch")
    assert_one_line_error(r)
    assert "data.train_prompts" in r.stderr and "prompts.txt" in r.stderr
    assert_one_line_error(hpcnft("plot", cycling, "-o", tmp_path / "x.png", "--smooth", "0"))


def test_plot_by_pass_of_a_run_shorter_than_one_pass_draws_it_raw_and_says_why(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(16)))
    config = {**CONFIG, "data": {"train_prompts": str(prompts)}, "rollout": {"prompts_per_step": 2}}
    short = make_run(tmp_path / "short", config=config)  # 4 steps of a pass of 8
    r = hpcnft("plot", short, "-o", tmp_path / "short.png", "--smooth", "epoch")
    assert r.returncode == 0 and r.stdout == f"wrote {tmp_path / 'short.png'}: 5 panels, 1 runs\n", r.stderr
    assert r.stderr == ("hpcnft plot: short: --smooth epoch draws the raw values: the run ends at step 4, before "
                        "one pass over its 16 training prompts (8 steps of 2) ends\n")
    assert read_png(tmp_path / "short.png").size > 0


def test_plot_samples_shows_the_saved_grids(tmp_path, run_a):
    import matplotlib.pyplot as plt

    assert_one_line_error(hpcnft("plot", "--samples", run_a, "-o", tmp_path / "none.png"))
    os.makedirs(os.path.join(run_a, "samples"))
    for step in (2, 4):
        plt.imsave(os.path.join(run_a, "samples", f"step_{step:06d}.png"), np.random.rand(16, 32, 3))
    out = tmp_path / "samples.png"
    r = hpcnft("plot", "--samples", run_a, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "2 sample grids" in r.stdout
    assert read_png(out).size > 0


# -- watch --------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    from hpcnft.io.run_writer import RunFileWriter
    from hpcnft.io.runfile import ALL_KEYS
    time.sleep(0.3)  # the watcher starts before the file exists
    w = RunFileWriter(sys.argv[1], "{}", "0.1.0", ("train/nft_loss",), loss_key="train/nft_loss")
    w.add_attempt({"from_step": 0})
    w.event(0, "start", "go")
    for step in range(1, 6):
        w.append_metrics(step, {"rollout/reward/raw_mean": 0.5 + step, "train/nft_loss": 10.0 * step})
        time.sleep(0.05)
        w.append_metrics(step, {"train/grad_norm": 0.25 * step})
        if step == 3:
            w.write_rng(3, {0: b"rng"})  # leaves SWMR mode briefly, with the watcher reading
            w.event(3, "checkpoint", "step 3")
        time.sleep(0.15)
    w.event(5, "done", "finished")
    w.close()
""")


def test_watch_follows_a_run_written_by_another_process(tmp_path):
    path = tmp_path / "live" / "run.h5"
    path.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        r = hpcnft("watch", path.parent, "--interval", "0.05", "--timeout", "30")
    finally:
        _, writer_err = writer.communicate(timeout=30)
    assert writer.returncode == 0, writer_err
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps == [f"step {k}  reward {0.5 + k:g}  nft_loss {10 * k}  grad_norm {0.25 * k:g}" for k in range(1, 6)]
    assert "event step 3: checkpoint: step 3" in r.stdout
    assert r.stdout.splitlines()[-1] == "event step 5: done: finished"


def test_watch_ends_with_1_when_the_run_reports_an_error(tmp_path):
    run = make_run(tmp_path / "run", done=False)
    w = RunFileWriter(os.path.join(run, "run.h5"), json.dumps(CONFIG), "0.1.0", NFT_KEYS)
    w.event(4, "error", "rank 1 died")
    w.close()
    r = hpcnft("watch", run, "--interval", "0.05", "--timeout", "10")
    assert r.returncode == 1
    assert len([line for line in r.stdout.splitlines() if line.startswith("step ")]) == 4
    assert r.stdout.splitlines()[-1] == "event step 4: error: rank 1 died"


def test_watch_times_out_on_a_run_that_does_not_end(tmp_path):
    run = make_run(tmp_path / "run", done=False)
    r = hpcnft("watch", run, "--interval", "0.05", "--timeout", "0.5")
    assert r.returncode == 124
    assert r.stdout.splitlines()[-1].startswith("step 4 ")
    assert r.stderr.strip() == "hpcnft watch: timed out after 0.5 s at step 4"


def test_watch_gives_up_on_a_file_that_never_appears(tmp_path):
    r = hpcnft("watch", tmp_path / "never.h5", "--interval", "0.05", "--timeout", "0.3")
    assert_one_line_error(r)
    assert "no run file after 0.3 s" in r.stderr


# -- export-metrics -----------------------------------------------------------------------
def test_export_csv_has_a_column_per_key_and_blanks_for_missing_rows(tmp_path, run_a):
    out = tmp_path / "m.csv"
    r = hpcnft("export-metrics", run_a, "--csv", out, "--keys", "train/grad_norm", "eval/pickscore_mean",
               "train/nft_loss")
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines() == [
        "step,train/nft_loss,train/grad_norm,eval/pickscore_mean",  # the run file's key order
        "1,15.25,nan,",
        "2,16.5,0.04,",
        "3,17.0,0.06,",
        "4,19.0,0.08,21.5",
    ]


def test_export_csv_defaults_to_every_key(tmp_path, run_a):
    out = tmp_path / "m.csv"
    assert hpcnft("export-metrics", run_a, "--csv", out).returncode == 0
    header = out.read_text().splitlines()[0].split(",")
    rollout = [k for k in ALL_KEYS if k.startswith("rollout/")]  # the run file's order: the algorithm's train keys
    assert header == ["step", *rollout, *NFT_KEYS, *(k for k in ALL_KEYS if k not in rollout)]  # before the shared


def test_export_needs_a_target_and_known_keys(tmp_path, run_a):
    assert_one_line_error(hpcnft("export-metrics", run_a))
    assert_one_line_error(hpcnft("export-metrics", run_a, "--csv", tmp_path / "m.csv", "--keys", "nope"))


def test_export_tensorboard_writes_scalar_events(tmp_path, run_a):
    """The event file as TensorBoard itself reads it back."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    r = hpcnft("export-metrics", run_a, "--tensorboard", tmp_path / "tb", "--keys", "train/nft_loss",
               "eval/pickscore_mean")
    assert r.returncode == 0, r.stderr
    (name,) = os.listdir(tmp_path / "tb")
    assert "tfevents" in name and r.stdout.strip() == f"wrote {tmp_path / 'tb' / name}"
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb" / name))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/pickscore_mean", "train/nft_loss"]
    scalars = [(e.step, tag, e.value) for tag in ("train/nft_loss", "eval/pickscore_mean") for e in acc.Scalars(tag)]
    assert scalars == [(1, "train/nft_loss", 15.25), (2, "train/nft_loss", 16.5), (3, "train/nft_loss", 17.0),
                       (4, "train/nft_loss", 19.0), (4, "eval/pickscore_mean", 21.5)]
