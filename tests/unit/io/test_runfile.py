"""hpcnft.io.runfile and run_writer: damaged or hostile run files and standards end in exit 0 or
one line with exit 2 (fuzzed, through hpcnft.cli.main in a worker), a FIFO is refused, and failed
writes name the file and keep every row already written."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from hardening_tools import fuzz, small_tmpfs, writer_made_run
from hpcnft.io import runfile
from hpcnft.io.run_writer import RunFileWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process


def test_fuzzed_run_files_and_standards_end_in_exit_0_or_one_line(tmp_path):
    src = str(tmp_path / "src" / "run.h5")
    os.makedirs(os.path.dirname(src))
    writer_made_run(src)
    work = tmp_path / "fuzz"
    work.mkdir()
    result = fuzz(src, str(work), n=80, seed=8)
    assert result["died"] is None, result["died"]
    assert len(result["cases"]) == 80
    assert not result["problems"], "\n\n".join(result["problems"][:5])


def test_a_fifo_is_refused_rather_than_read(tmp_path):
    """A FIFO named run.h5 or *.json would block an open() forever."""
    from hardening_tools import call_cli

    fifo = tmp_path / "run.h5"
    os.mkfifo(fifo)
    std = tmp_path / "std.json"
    os.mkfifo(std)
    for argv in (["show", str(fifo)], ["compare", str(std), str(fifo)], ["compare", str(fifo), str(fifo)]):
        rc, _, err, tb = call_cli(argv)
        assert tb is None and rc == 2 and "not a regular file" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(runfile.RunFileError, match="not a regular file"):
        RunFileWriter(str(fifo), "{}", "x")


def test_run_file_write_failures_name_the_file_and_keep_the_rows(tmp_path, monkeypatch):
    path = str(tmp_path / "run.h5")
    w = RunFileWriter(path, "{}", "x")
    w.append_metrics(1, {"train/nft_loss": 1.5})
    import h5py

    real_resize = h5py.Dataset.resize

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(h5py.Dataset, "resize", full)
    with pytest.raises(runfile.RunFileError) as e:
        w.append_metrics(2, {"train/nft_loss": 2.5})
    assert str(e.value).startswith(f"{path}: cannot write the run file") and "No space left" in str(e.value)
    monkeypatch.setattr(h5py.Dataset, "resize", real_resize)
    w.close()
    assert runfile.read_run(path).metrics["train/nft_loss"].tolist() == [[1.0, 1.5]]


def test_a_full_tmpfs_fails_run_file_appends_cleanly(tmp_path):
    """Real ENOSPC from a 1200 KiB tmpfs, in a subprocess (an HDF5 crash must not take pytest)."""
    mnt = str(tmp_path / "mnt")
    code = f"""
import sys
from hpcnft.io.run_writer import RunFileWriter
from hpcnft.io.runfile import RunFileError, PER_STEP_KEYS, read_run
p = {mnt + '/run.h5'!r}
w = RunFileWriter(p, "{{}}", "x")
done = 0
try:
    for step in range(1, 100000):
        w.append_metrics(step, {{k: float(step) for k in PER_STEP_KEYS}})
        w.event(step, "checkpoint", "x" * 900)
        if step % 50 == 0:
            w.write_rng(step, {{0: bytes(12000)}})
        done = step
except RunFileError as e:
    print("ERROR", e)
try:
    w.close()
except RunFileError as e:
    print("CLOSE", e)
run = read_run(p)
rows = run.metrics["train/nft_loss"]
print("DONE", done, len(rows), int(rows[done - 1, 0]), len(run.events))
"""
    with small_tmpfs(mnt, "1200k"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr  # no h5py release tracebacks
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"ERROR {mnt}/run.h5: cannot write the run file (")
    assert "No space left on device" in lines[0] or "KiB free" in lines[0]
    _, done, n_rows, last_step, n_events = lines[-1].split()
    assert int(done) > 10 and int(n_rows) >= int(done) and int(last_step) == int(done)
    assert int(n_events) >= int(done)
