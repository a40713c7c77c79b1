"""The live trackers (hpcnft/io/trackers.py) on their real libraries, read back with
TensorBoard's EventAccumulator and from wandb's offline run files."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from hpcnft.io.trackers import (TensorBoardTracker, TrackerGroup, WandbTracker, missing_package, open_tracker,
                                wandb_mode)
from tracker_files import tensorboard_reader, tensorboard_scalars, wandb_history, wandb_offline_runs

ROWS = {step: {"train/nft_loss": 60.0 + step / 3, "eval/pickscore_mean": 0.1 * step} for step in range(1, 6)}
GRID = (np.arange(24 * 40 * 3) % 251).astype(np.uint8).reshape(24, 40, 3)


def _float32(x: float) -> float:
    return float(np.float32(x))


def test_tensorboard_rows_and_images_read_back_by_tensorboard(tmp_path):
    t = TensorBoardTracker(str(tmp_path), kept_through=-1)
    for step in (1, 2):
        t.log_row(step, ROWS[step])
    t.log_image(2, "samples", GRID)
    # live: flushed at every row, readable before close
    assert tensorboard_scalars(str(tmp_path / "tensorboard"))["train/nft_loss"] == \
        [(1, _float32(ROWS[1]["train/nft_loss"])), (2, _float32(ROWS[2]["train/nft_loss"]))]
    t.close()
    (image,) = tensorboard_reader(str(tmp_path / "tensorboard")).Images("samples")
    assert (image.step, image.width, image.height) == (2, 40, 24)


def test_tensorboard_image_from_a_png_file(tmp_path):
    from PIL import Image

    Image.fromarray(GRID).save(tmp_path / "grid.png")
    t = TensorBoardTracker(str(tmp_path), kept_through=-1)
    t.log_image(5, "samples", str(tmp_path / "grid.png"))
    t.close()
    (image,) = tensorboard_reader(str(tmp_path / "tensorboard")).Images("samples")
    assert np.array_equal(np.asarray(Image.open(__import__("io").BytesIO(image.encoded_image_string))), GRID)


def test_a_resumed_start_purges_the_steps_it_runs_again(tmp_path):
    """Start 1 logged steps 1-4 and died; the checkpoint was step 2: start 2 logs 3-5 (other
    values here, to tell them apart). TensorBoard's reader shows each step once, 3-5 from start 2."""
    first = TensorBoardTracker(str(tmp_path), kept_through=-1)
    for step in range(1, 5):
        first.log_row(step, ROWS[step])
    first.close()
    second = TensorBoardTracker(str(tmp_path), kept_through=2)
    assert second.shown_through == 2
    for step in range(3, 6):
        second.log_row(step, {k: -v for k, v in ROWS[step].items()})
    second.close()
    got = tensorboard_scalars(str(tmp_path / "tensorboard"))["train/nft_loss"]
    want = [(s, _float32(ROWS[s]["train/nft_loss"] * (1 if s <= 2 else -1))) for s in range(1, 6)]
    assert got == want


def _run_h5(after, through):
    return {s: r for s, r in ROWS.items() if after < s <= through}


def test_after_a_killed_start_the_log_dir_is_purged_and_filled_in_from_run_h5(tmp_path):
    """Start 1 logged steps 1-3 and was killed (never closed); start 2 resumes after step 2. Not
    knowing what start 1 flushed, it purges from step 0 and sends run.h5's rows again."""
    first = TensorBoardTracker(str(tmp_path), kept_through=-1)
    for step in range(1, 4):
        first.log_row(step, {k: -v for k, v in ROWS[step].items()})
    group = TrackerGroup.open(["tensorboard"], str(tmp_path), 2, {}, warn=pytest.fail)
    assert group.trackers[0].shown_through == -1
    group.backfill(2, _run_h5, lambda step: None)
    for step in (3, 4):
        group.log_row(step, ROWS[step])
    group.close()
    first._writer.close()  # the killed start's writer thread, without a clean close's state
    got = tensorboard_scalars(str(tmp_path / "tensorboard"))["train/nft_loss"]
    assert got == [(s, _float32(ROWS[s]["train/nft_loss"])) for s in range(1, 5)]


def test_steps_run_while_tensorboard_was_off_are_filled_in(tmp_path):
    first = TensorBoardTracker(str(tmp_path), kept_through=-1)
    for step in (1, 2):
        first.log_row(step, ROWS[step])
    first.close()
    # steps 3-4 ran without the tracker; this start resumes after step 4
    group = TrackerGroup.open(["tensorboard"], str(tmp_path), 4, {}, warn=pytest.fail)
    assert group.trackers[0].shown_through == 2
    group.backfill(4, _run_h5, lambda step: None)
    group.log_row(5, ROWS[5])
    group.close()
    got = tensorboard_scalars(str(tmp_path / "tensorboard"))["eval/pickscore_mean"]
    assert got == [(s, _float32(ROWS[s]["eval/pickscore_mean"])) for s in range(1, 6)]


def test_a_new_logdir_is_backfilled_with_the_whole_run(tmp_path):
    """A tracker added to a run under way (no event files yet) gets run.h5's rows up to the resume step."""
    grid = tmp_path / "step_000002.png"
    from PIL import Image

    Image.fromarray(GRID).save(grid)
    group = TrackerGroup.open(["tensorboard"], str(tmp_path), 3, {}, warn=pytest.fail)
    assert group.trackers[0].shown_through == -1
    group.backfill(3, _run_h5, lambda step: str(grid) if step == 2 else None)
    group.log_row(4, ROWS[4])
    group.close()
    got = tensorboard_scalars(str(tmp_path / "tensorboard"))
    assert [s for s, _ in got["eval/pickscore_mean"]] == [1, 2, 3, 4]
    assert [i.step for i in tensorboard_reader(str(tmp_path / "tensorboard")).Images("samples")] == [2]


@pytest.fixture
def offline(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_mode_is_offline_unless_the_user_configured_wandb():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_MODE": "online"}) is None
    assert wandb_mode({"WANDB_MODE": "disabled"}) is None
    assert wandb_mode({"WANDB_API_KEY": "x" * 40}) is None


def test_wandb_offline_run_holds_the_rows_and_the_image(tmp_path, offline):
    pytest.importorskip("wandb")
    t = WandbTracker(str(tmp_path), {"steps": 5})
    assert "(offline)" in t.where
    for step in (1, 2):
        t.log_row(step, ROWS[step])
    t.log_image(2, "samples", GRID)
    t.close()
    (folder,) = wandb_offline_runs(str(tmp_path))
    run_id, rows = wandb_history(folder)
    assert run_id == t.run_id
    assert [r["_step"] for r in rows] == [1, 2]
    for r in rows:
        assert {k: r[k] for k in ROWS[1]} == ROWS[r["_step"]]  # float64, exactly
    assert "samples" not in rows[0]
    assert rows[1]["samples"]["_type"] == "image-file"
    assert (rows[1]["samples"]["width"], rows[1]["samples"]["height"]) == (40, 24)
    assert os.path.isfile(os.path.join(folder, "files", rows[1]["samples"]["path"]))


def test_wandb_resumed_start_continues_the_same_run_without_repeating_steps(tmp_path, offline):
    pytest.importorskip("wandb")
    first = WandbTracker(str(tmp_path), {})
    for step in range(1, 5):
        first.log_row(step, ROWS[step])
    first.close()
    second = WandbTracker(str(tmp_path), {})
    assert (second.run_id, second.shown_through) == (first.run_id, 4)
    for step in range(3, 6):  # steps 3 and 4 run again after a resume from step 2
        second.log_row(step, ROWS[step])
        second.log_image(step, "samples", GRID)
    second.close()
    folders = wandb_offline_runs(str(tmp_path))
    assert len(folders) == 2
    (id1, rows1), (id2, rows2) = (wandb_history(f) for f in folders)
    assert id1 == id2 == first.run_id
    assert [r["_step"] for r in rows1] == [1, 2, 3, 4]
    assert [r["_step"] for r in rows2] == [5]
    assert rows2[0]["samples"]["_type"] == "image-file"


class _Recorder:
    name, where, shown_through = "recorder", "memory", -1

    def __init__(self):
        self.rows = []

    def log_row(self, step, metrics):
        self.rows.append(step)

    def log_image(self, step, tag, image):
        pass

    def close(self):
        pass


# TensorBoard's writer thread re-raises its OSError after handing it over (it lands in rank 0's log)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_tracker_failing_on_a_full_disk_is_warned_about_once_and_dropped(tmp_path, monkeypatch):
    """A real ENOSPC: TensorBoard's log dir on a small tmpfs that fills up. The group warns once,
    drops that tracker and goes on feeding the others; the failed writer's thread has ended by
    then (not left to raise during whatever runs next)."""
    import time

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from hardening_tools import small_tmpfs

    run = _AsyncWriterThread.run

    def dying_slowly(thread):  # the window between handing the error over and the thread's end, widened
        try:
            run(thread)
        except Exception:
            time.sleep(1.0)
            raise

    monkeypatch.setattr(_AsyncWriterThread, "run", dying_slowly)
    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "256k"):
        warnings, other = [], _Recorder()
        tensorboard = open_tracker("tensorboard", mnt, -1, {})
        worker = tensorboard._writer.file_writer.event_writer._async_writer._worker
        group = TrackerGroup([tensorboard, other], warnings.append)
        group.log_row(1, ROWS[1])
        with open(os.path.join(mnt, "filler"), "wb", buffering=0) as f:  # the disk fills up
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        for step in range(2, 6):
            group.log_row(step, ROWS[step])
            noise = np.random.default_rng(step).integers(0, 256, (128, 128, 3), dtype=np.uint8)  # PNG can't shrink it
            group.log_image(step, "samples", noise)
        group.close()
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("tracker tensorboard failed at step ")
    assert "No space left on device" in warnings[0] and "run.h5 keeps every row" in warnings[0]
    assert [t.name for t in group.trackers] == []
    assert other.rows == [1, 2, 3, 4, 5]
    assert not worker.is_alive()


def test_a_tracker_that_cannot_start_is_warned_about_and_left_out(tmp_path, offline):
    pytest.importorskip("wandb")
    (tmp_path / "wandb").write_text("a file where wandb's folder goes")
    warnings = []
    group = TrackerGroup.open(["wandb", "tensorboard"], str(tmp_path), -1, {}, warnings.append)
    assert [t.name for t in group.trackers] == ["tensorboard"]
    (line,) = warnings
    assert line.startswith("tracker wandb cannot start (") and "\n" not in line
    group.close()


def test_a_damaged_wandb_state_is_a_tracker_that_cannot_start(tmp_path, offline):
    pytest.importorskip("wandb")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "hpcnft-wandb.json").write_text('{"id": "../../x", "last_step": 3}')
    warnings = []
    group = TrackerGroup.open(["wandb"], str(tmp_path), 3, {}, warnings.append)
    assert group.trackers == [] and "not a wandb run id" in warnings[0]


def test_missing_package_names_the_pip_extra(monkeypatch):
    assert missing_package("tensorboard") is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module as not importable
    assert missing_package("wandb") == ("logging.trackers: 'wandb' needs the wandb package, which is not "
                                        "installed (pip install 'hpcnft[wandb]')")


def test_a_closed_wandb_run_is_whole_on_disk_at_once(tmp_path, offline):
    """In a fresh interpreter (where wandb's service writes its file after finish() returns), the
    run's file holds every row the moment close() returns: a job that exits then loses nothing."""
    pytest.importorskip("wandb")
    import subprocess

    script = ("import sys\n"
              "import numpy as np\n"
              "from PIL import Image  # noqa: F401 - as a job has it imported\n"
              "from hpcnft.io.trackers import WandbTracker\n"
              "t = WandbTracker(sys.argv[1], {})\n"
              "for step in (1, 2):\n"
              "    t.log_row(step, {'train/nft_loss': float(step)})\n"
              "t.log_image(2, 'samples', np.zeros((8, 8, 3), np.uint8))\n"
              "t.close()\n"
              "from tracker_files import wandb_history, wandb_offline_runs\n"
              "(folder,) = wandb_offline_runs(sys.argv[1])\n"
              "print([row['_step'] for row in wandb_history(folder)[1]])\n")
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "[1, 2]"


def video_grid(folder) -> tuple[str, str]:
    """A video step's grid as run/output.py's save_grid leaves it: the PNG of the first frames
    beside the GIF."""
    from PIL import Image

    frames = [Image.fromarray(np.roll(GRID, k, axis=1)) for k in range(3)]
    png, gif = str(folder / "step_000002.png"), str(folder / "step_000002.gif")
    frames[0].save(png)
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=62, loop=0)
    return png, gif


def test_tensorboard_shows_a_video_steps_grid_as_its_gif(tmp_path):
    png, gif = video_grid(tmp_path)
    t = TensorBoardTracker(str(tmp_path), kept_through=-1)
    t.log_image(2, "samples", png)
    t.close()
    (image,) = tensorboard_reader(str(tmp_path / "tensorboard")).Images("samples")
    with open(gif, "rb") as f:
        assert image.encoded_image_string == f.read() and (image.step, image.width, image.height) == (2, 40, 24)


def test_wandb_plays_a_video_steps_grid_as_its_gif(tmp_path, offline):
    """wandb gets a video grid's animation; an image grid stays an image."""
    pytest.importorskip("wandb")
    png, _ = video_grid(tmp_path)
    t = WandbTracker(str(tmp_path), {})
    t.log_row(2, ROWS[2])
    t.log_image(2, "samples", png)
    t.close()
    (folder,) = wandb_offline_runs(str(tmp_path))
    _, rows = wandb_history(folder)
    assert rows[0]["samples"]["_type"] == "video-file" and rows[0]["samples"]["path"].endswith(".gif")
    assert os.path.isfile(os.path.join(folder, "files", rows[0]["samples"]["path"]))
