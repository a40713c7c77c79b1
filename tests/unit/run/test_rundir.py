"""hpcnft.run.rundir: a run dir on a read-only file system is refused naming the path, and nothing
in it (run file, checkpoints) is changed."""
from __future__ import annotations

import os

import pytest

from hardening_tools import make_checkpoint, remount_read_only, small_tmpfs, writer_made_run
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.common.errors import UsageError
from hpcnft.io import checkpoint
from hpcnft.io import runfile
from hpcnft.io.run_writer import RunFileWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process


def test_a_read_only_run_dir_is_refused_naming_the_path(tmp_path):
    from hpcnft.run.rundir import check_run_dir

    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "4m"):
        run_dir = os.path.join(mnt, "run")
        good = make_checkpoint(run_dir, 1)
        h5 = os.path.join(run_dir, "run.h5")
        writer_made_run(h5, steps=2)
        remount_read_only(mnt)
        with pytest.raises(UsageError, match="is not writable"):
            check_run_dir(run_dir)
        with pytest.raises(runfile.RunFileError) as e:
            RunFileWriter(h5, "{}", "x", NFT_KEYS)
        assert str(e.value).startswith(h5) and len(str(e.value).splitlines()) == 1
        with pytest.raises(checkpoint.CheckpointError, match="Read-only file system") as e:
            make_checkpoint(run_dir, 2)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2))
        assert checkpoint.problems(good) is None
        assert len(runfile.read_run(h5).metrics["train/nft_loss"]) == 2


def test_the_resume_command_names_the_run_dir_and_repeats_the_overrides_quoted():
    import shlex

    from hpcnft.run.rundir import resume_command

    cmd = resume_command("tiny", ["optim.lr=1e-4", 'logging.trackers=["tensorboard"]'], "runs/tiny-20261205-0900",
                         50)
    assert cmd == ("hpcnft run tiny --run-dir runs/tiny-20261205-0900 --set optim.lr=1e-4 "
                   "--set 'logging.trackers=[\"tensorboard\"]' --steps 50")
    assert shlex.split(cmd)[1:] == ["run", "tiny", "--run-dir", "runs/tiny-20261205-0900", "--set", "optim.lr=1e-4",
                                    "--set", 'logging.trackers=["tensorboard"]', "--steps", "50"]


def test_every_start_checks_the_run_dir_with_its_input(tmp_path):
    """check_input (the spawner's and every launcher rank's preflight) refuses a run dir under a file."""
    from hpcnft.algo.root_config import load_config
    from hpcnft.run.rundir import check_input

    (tmp_path / "file").write_text("")
    cfg = load_config("tiny", run_dir=str(tmp_path / "file" / "run"))
    with pytest.raises(UsageError, match="is not a directory"):
        check_input(cfg, 3)


def test_after_a_failure_the_line_says_the_command_and_the_checkpoint_it_resumes_from(tmp_path):
    from hpcnft.run.rundir import last_checkpoint_step, resume_line

    run_dir = str(tmp_path / "run")
    command = f"hpcnft run tiny --run-dir {run_dir} --steps 20"
    assert last_checkpoint_step(run_dir) is None
    assert resume_line(run_dir, command) == f"no checkpoint was written: `{command}` starts the run over"
    for name, complete in (("step_000005", True), ("step_000010", True), ("step_000015", False),
                           ("step_000020.partial", True)):
        os.makedirs(os.path.join(run_dir, "checkpoints", name))
        if complete:
            open(os.path.join(run_dir, "checkpoints", name, "COMPLETE"), "w").close()
    assert last_checkpoint_step(run_dir) == 10  # committed ones only
    assert resume_line(run_dir, command) == f"`{command}` resumes it from checkpoint step 10"


def test_a_sample_grid_that_cannot_be_written_names_its_path(tmp_path, monkeypatch):
    import errno

    import torch
    from PIL import Image

    from hpcnft.run.output import save_grid

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Image.Image, "save", full)
    with pytest.raises(OSError) as e:
        save_grid(str(tmp_path), 5, torch.zeros(2, 8, 8, 3, dtype=torch.uint8), ["a cat", "a dog"])
    path = os.path.join(str(tmp_path), "samples", "step_000005.png")
    assert e.value.errno == errno.ENOSPC and str(e.value) == (f"[Errno 28] {path}: cannot write the sample grid "
                                                              "(No space left on device)")
