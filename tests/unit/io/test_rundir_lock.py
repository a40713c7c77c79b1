"""hpcnft.io.rundir_lock: one owner per run dir. Real flock(2) on real files, with a second real
process as the other owner; only a file system without flock is simulated (none here lacks it)."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys

import pytest

from hpcnft.io import rundir_lock
from hpcnft.io.rundir_lock import Holder, RunDirInUse, acquire, parse_holder

HOLDER = Holder(pid=1234, host="n01", slurm_job_id="99", since="2026-12-03T21:00:00Z")


def owner_process(run_dir: str) -> subprocess.Popen:
    """Another process that takes the run dir and keeps it until killed."""
    script = ("import sys, time; from hpcnft.io.rundir_lock import acquire\n"
              f"lock = acquire({run_dir!r}, warn=print)\nprint('held', flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def lock_text(run_dir) -> str:
    with open(os.path.join(run_dir, ".lock")) as f:
        return f.read()


def test_the_holder_line_reads_back():
    assert parse_holder(HOLDER.to_text()) == HOLDER
    assert parse_holder("pid=7\nhost=a\n") == Holder(7, "a")


@pytest.mark.parametrize("text", ["", "\n", "garbage", "pid=x\nhost=a", "pid=7\n", "pid=0\nhost=a", "host=a"])
def test_what_names_no_holder_parses_to_none(text):
    assert parse_holder(text) is None


def test_the_refusal_names_the_holder_and_what_to_do():
    line = rundir_lock.refusal_line("runs/x", HOLDER)
    assert line == ("run dir runs/x is in use by pid 1234 on host n01 (Slurm job 99) since 2026-12-03T21:00:00Z; "
                    "wait for it to end or choose another --run-dir")
    assert "(Slurm job" not in rundir_lock.refusal_line("runs/x", Holder(5, "n02"))
    assert "\n" not in rundir_lock.refusal_line("runs/x", None)


def test_the_owner_writes_its_name_and_a_clean_release_clears_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "new" / "run")  # created by acquire
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    warnings = []
    lock = acquire(run_dir, warnings.append)
    named = parse_holder(lock_text(run_dir))
    assert (named.pid, named.host, named.slurm_job_id) == (os.getpid(), socket.gethostname(), "4242")
    assert named.since.endswith("Z") and warnings == []
    lock.release()
    assert lock_text(run_dir) == ""
    acquire(run_dir, warnings.append).release()  # free again, and nothing to warn about
    assert warnings == []


def test_a_second_owner_is_refused_naming_the_first(tmp_path):
    run_dir = str(tmp_path)
    proc = owner_process(run_dir)
    try:
        with pytest.raises(RunDirInUse) as refused:
            acquire(run_dir, pytest.fail)
        assert refused.value.holder.pid == proc.pid
        assert f"is in use by pid {proc.pid} on host {socket.gethostname()} since " in str(refused.value)
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_of_a_killed_owner_is_taken_over_with_a_warning(tmp_path):
    run_dir = str(tmp_path)
    proc = owner_process(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert parse_holder(lock_text(run_dir)).pid == proc.pid  # its line is left behind
    warnings = []
    lock = acquire(run_dir, warnings.append)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: run dir {run_dir} was held by pid {proc.pid} on host ")
    assert warnings[0].endswith("which is gone; taking it over")
    assert parse_holder(lock_text(run_dir)).pid == os.getpid()
    lock.release()


def test_a_requeued_slurm_job_takes_its_own_earlier_lock_over_quietly(tmp_path):
    # Slurm kills a requeued job's processes before they clear their line: no news to the user
    dead = Holder(pid=2 ** 22 + 1, host=socket.gethostname(), slurm_job_id="4242", since="2026-12-03T21:00:00Z")
    (tmp_path / ".lock").write_text(dead.to_text())
    warnings = []
    acquire(str(tmp_path), warnings.append, env={"SLURM_JOB_ID": "4242"}).release()
    assert warnings == []
    (tmp_path / ".lock").write_text(dead.to_text())
    acquire(str(tmp_path), warnings.append, env={"SLURM_JOB_ID": "4243"}).release()
    assert len(warnings) == 1 and "(Slurm job 4242)" in warnings[0] and warnings[0].endswith("taking it over")


def test_an_unreadable_leftover_is_taken_over_with_a_warning(tmp_path):
    (tmp_path / ".lock").write_text("\x00\x01 half a line")
    warnings = []
    acquire(str(tmp_path), warnings.append).release()
    assert warnings == [f"warning: run dir {tmp_path} was held by an unknown process, which is gone; taking it over"]


def test_a_lock_whose_owner_has_not_named_itself_yet_is_refused_without_a_name(tmp_path):
    import fcntl

    with open(tmp_path / ".lock", "w") as f:  # held, empty: the instant between flock and the write
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(RunDirInUse, match="in use by another process") as refused:
            acquire(str(tmp_path), pytest.fail, wait_for_name_s=0.2)
        assert refused.value.holder is None


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_untouched(tmp_path, kind):
    from hpcnft.common.errors import UsageError

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / ".lock"
    {"symlink": lambda: path.symlink_to(target), "folder": path.mkdir, "fifo": lambda: os.mkfifo(path)}[kind]()
    with pytest.raises(UsageError, match=r"^run dir .*: \.lock is not a regular file; remove it$"):
        acquire(str(tmp_path), pytest.fail)
    assert target.read_text() == "keep"


def no_flock(errno_):
    def flock(_fd, _op):
        raise OSError(errno_, os.strerror(errno_))
    return flock


def test_without_flock_the_holder_line_guards_against_a_live_owner_on_this_host(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir_lock, "_warned_unsupported", False)
    run_dir = str(tmp_path)
    warnings = []
    first = acquire(run_dir, warnings.append, flock=no_flock(errno.ENOLCK))
    assert len(warnings) == 1 and "does not support flock (ENOLCK)" in warnings[0] and "-o flock" in warnings[0]
    proc = owner_process(str(tmp_path / "elsewhere"))  # a live process of this host, named as holder
    try:
        os.pwrite(first.fd, Holder(proc.pid, socket.gethostname()).to_text().encode(), 0)
        with pytest.raises(RunDirInUse, match=f"in use by pid {proc.pid} "):
            acquire(run_dir, warnings.append, flock=no_flock(errno.EOPNOTSUPP))
    finally:
        proc.kill()
        proc.wait()
    assert len(warnings) == 1  # warned once per process
    # the holder is gone: taken over with the warning
    lock = acquire(run_dir, warnings.append, flock=no_flock(errno.ENOSYS))
    assert warnings[1].startswith(f"warning: run dir {run_dir} was held by pid {proc.pid} ")
    lock.release()
    # another host's holder cannot be checked: taken over, saying so
    with open(os.path.join(run_dir, ".lock"), "w") as f:
        f.write(HOLDER.to_text())
    acquire(run_dir, warnings.append, flock=no_flock(errno.ENOLCK)).release()
    assert warnings[2].endswith("which cannot be checked from this host; taking it over")


def test_other_flock_errors_are_not_taken_for_missing_support(tmp_path):
    with pytest.raises(OSError, match="Bad file"):
        acquire(str(tmp_path), pytest.fail, flock=no_flock(errno.EBADF))


def test_rank_0_adopts_the_lock_its_spawner_passed_down_only_when_it_is_the_run_dirs(tmp_path):
    run_dir, other = str(tmp_path / "run"), str(tmp_path / "other")
    held = acquire(run_dir, pytest.fail)
    acquire(other, pytest.fail).release()
    dup = os.dup(held.fd)
    try:
        assert rundir_lock.adopt_inherited(other, {rundir_lock.INHERITED_FD_ENV: str(dup)}) is None
        assert rundir_lock.adopt_inherited(run_dir, {}) is None
        assert rundir_lock.adopt_inherited(run_dir, {rundir_lock.INHERITED_FD_ENV: "999999"}) is None
        adopted = rundir_lock.adopt_inherited(run_dir, {rundir_lock.INHERITED_FD_ENV: str(dup)})
        assert adopted.holder == held.holder
        adopted.release()  # closes its copy; the spawner's line and lock stay
        assert parse_holder(lock_text(run_dir)) == held.holder
        with pytest.raises(RunDirInUse):
            subprocess_acquire(run_dir)
    finally:
        held.release()
    subprocess_acquire(run_dir)


def subprocess_acquire(run_dir: str) -> None:
    """acquire in another process; RunDirInUse when refused."""
    script = f"from hpcnft.io.rundir_lock import acquire\nacquire({run_dir!r}, warn=print).release()"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if "RunDirInUse" in r.stderr:
        raise RunDirInUse(run_dir, None)
    assert r.returncode == 0, r.stderr


def test_check_free_refuses_a_held_run_dir_and_leaves_a_free_one_as_it_is(tmp_path):
    run_dir = str(tmp_path)
    rundir_lock.check_free(str(tmp_path / "never-used"))  # no lock file: free
    proc = owner_process(run_dir)
    try:
        with pytest.raises(RunDirInUse, match=f"in use by pid {proc.pid} "):
            rundir_lock.check_free(run_dir)
    finally:
        proc.kill()
        proc.wait()
    left = lock_text(run_dir)
    rundir_lock.check_free(run_dir)  # the killed owner's line: free, and kept for the takeover warning
    assert lock_text(run_dir) == left and parse_holder(left).pid == proc.pid
    acquire(run_dir, [].append).release()  # the probe left no lock behind
