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
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
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
        RunFileWriter(str(fifo), "{}", "x", NFT_KEYS)


def test_run_file_write_failures_name_the_file_and_keep_the_rows(tmp_path, monkeypatch):
    path = str(tmp_path / "run.h5")
    w = RunFileWriter(path, "{}", "x", NFT_KEYS)
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


FILE_SIZE_LIMITED = """
import json, os, resource, sys
limit, path = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # ulimit -f: a write past it fails, EFBIG
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.io.run_writer import RunFileWriter
from hpcnft.io.runfile import RunFileError, PER_STEP_KEYS
done = 0
try:
    w = RunFileWriter(path, "{}", "x", NFT_KEYS)
    w.set_topology({"world_size": 3})
    w.add_attempt({"from_step": 0})
    for step in range(1, 100000):
        w.append_metrics(step, {k: float(step) for k in PER_STEP_KEYS})
        w.event(step, "warning", "x" * 200)
        if step % 5 == 0:
            w.write_rng(step, {r: bytes(6000) for r in range(3)})
        done = step
except RunFileError as e:
    print("ERROR", e)
try:
    w.close()
except (RunFileError, NameError) as e:
    print("CLOSE", e)
print("DONE", done, sorted(os.listdir(os.path.dirname(path))))
"""


@pytest.mark.parametrize("limit_kib", [150, 440, 1500])
def test_a_file_size_limit_refuses_the_write_whole_and_leaves_run_h5_readable(tmp_path, limit_kib):
    # Before, at two of three such limits HDF5 wrote past the limit halfway and run.h5 could not
    # be opened again (its superblock named an end beyond the file's). A limit too small for a
    # new run file refuses it before the file exists.
    path = str(tmp_path / "run.h5")
    r = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(limit_kib << 10), path], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"ERROR {path}: cannot ") and "KiB left under the file size limit of " \
        f"{limit_kib} KiB, ulimit -f)" in lines[0], lines
    done = int(lines[-1].split()[1])
    assert lines[-1].endswith("[]" if limit_kib == 150 else "['run.h5']")  # no reserve file is left behind
    if limit_kib == 150:
        assert done == 0 and not os.path.exists(path)
        return
    run = runfile.read_run(path)  # every step's rows, and the metrics of the step whose event was refused
    rows = run.metrics["train/grad_norm"][:, 0].tolist()
    assert done >= 1 and rows == [float(s) for s in range(1, len(rows) + 1)] and done <= len(rows) <= done + 1
    assert len(run.events) >= done


def test_a_quota_that_runs_out_is_found_by_the_reserve_and_the_next_write_refused_whole(tmp_path, monkeypatch):
    # EDQUOT, which nothing reports in advance: the reserve beside run.h5 cannot be taken back
    # after a write, so the write after it is refused before HDF5 touches the file
    path = str(tmp_path / "run.h5")
    w = RunFileWriter(path, "{}", "x", NFT_KEYS)
    w.append_metrics(1, {"train/nft_loss": 1.5})
    assert os.path.getsize(tmp_path / ".run.h5.reserve") == 256 << 10  # held between writes

    def over_quota(fd, offset, length):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "posix_fallocate", over_quota)
    w.append_metrics(2, {"train/nft_loss": 2.5})  # done; the reserve it gave back is gone
    with pytest.raises(runfile.RunFileError) as e:
        w.append_metrics(3, {"train/nft_loss": 3.5})
    assert str(e.value) == f"{path}: cannot write the run file (disk quota exceeded: no room for the next write)"
    w.close()
    assert sorted(os.listdir(tmp_path)) == ["run.h5"]
    assert runfile.read_run(path).metrics["train/nft_loss"].tolist() == [[1.0, 1.5], [2.0, 2.5]]


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
rows = run.metrics["train/grad_norm"]
print("DONE", done, len(rows), int(rows[done - 1, 0]), len(run.events))
"""
    with small_tmpfs(mnt, "1200k"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr  # no h5py release tracebacks
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"ERROR {mnt}/run.h5: cannot write the run file (")
    assert "No space left on device" in lines[0] or "KiB free" in lines[0] or "file system full" in lines[0]
    _, done, n_rows, last_step, n_events = lines[-1].split()
    assert int(done) > 10 and int(n_rows) >= int(done) and int(last_step) == int(done)
    assert int(n_events) >= int(done)
