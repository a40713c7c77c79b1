"""One owner per run dir: RUN_DIR/.lock, held with flock(2) by the process that owns the run.

The kernel drops a flock when its holder dies, however it dies, so a crashed or killed run never
blocks the next start. The holder writes who it is into the file (pid, host, Slurm job id, start
time): a refused start names it, and a start that finds a line but no lock (its writer died
without a clean exit) takes the run dir over with a warning naming the former holder. A clean
exit clears the line.

File systems without flock (Lustre mounted without `-o flock`) leave only the holder line: the
start warns once and refuses only where it can tell that the holder lives, a live pid on its
own host.

The local spawner takes the lock in its own process and hands the open file to rank 0 (an
inherited descriptor shares the flock), so the run dir stays held while either of them lives.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
import stat
import time
from typing import Callable

from hpcnft.common.errors import UsageError

LOCK_NAME = ".lock"
# Set by the local spawner for rank 0: the descriptor of the lock it already holds.
INHERITED_FD_ENV = "HPCNFT_RUN_DIR_LOCK_FD"
# errno values of a file system that does not implement flock
FLOCK_UNSUPPORTED = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)
_warned_unsupported = False


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run dir."""

    pid: int
    host: str
    slurm_job_id: str = ""
    since: str = ""

    def describe(self) -> str:
        job = f" (Slurm job {self.slurm_job_id})" if self.slurm_job_id else ""
        since = f" since {self.since}" if self.since else ""
        return f"pid {self.pid} on host {self.host}{job}{since}"

    def to_text(self) -> str:
        return f"pid={self.pid}\nhost={self.host}\nslurm_job_id={self.slurm_job_id}\nsince={self.since}\n"


def this_process(env=os.environ) -> Holder:
    return Holder(pid=os.getpid(), host=socket.gethostname(), slurm_job_id=env.get("SLURM_JOB_ID", ""),
                  since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def parse_holder(text: str) -> Holder | None:
    """The holder a lock file names; None when it names none (empty, or not a holder line)."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        pid = int(fields["pid"])
    except (KeyError, ValueError):
        return None
    if pid <= 0 or not fields.get("host"):
        return None
    return Holder(pid, fields["host"], fields.get("slurm_job_id", ""), fields.get("since", ""))


def refusal_line(run_dir: str, holder: Holder | None) -> str:
    who = holder.describe() if holder else "another process (it has not written its name yet)"
    if holder and holder.host == socket.gethostname() and not _pid_alive(holder.pid):
        # the lock outlives its writer only in the ranks it started, which stop once it is gone
        return (f"run dir {run_dir} is still held by the ranks of {who}, which has ended: they stop after "
                f"their checkpoint; start again once they have, or choose another --run-dir")
    return f"run dir {run_dir} is in use by {who}; wait for it to end or choose another --run-dir"


def takeover_line(run_dir: str, former: Holder | None, unverified: bool = False) -> str:
    who = former.describe() if former else "an unknown process"
    why = "which cannot be checked from this host" if unverified else "which is gone"
    return f"warning: run dir {run_dir} was held by {who}, {why}; taking it over"


def unsupported_line(run_dir: str, err: OSError) -> str:
    return (f"warning: the file system of run dir {run_dir} does not support flock "
            f"({errno.errorcode.get(err.errno, err.errno)}): only the holder line in {LOCK_NAME} guards it "
            "(on Lustre, mount with -o flock)")


class RunDirInUse(UsageError):
    def __init__(self, run_dir: str, holder: Holder | None):
        super().__init__(refusal_line(run_dir, holder))
        self.holder = holder


class RunDirLock:
    """A held run dir. `release` clears the holder line (when this process wrote it) and closes
    the file, which drops the flock once no inherited copy of the descriptor is left."""

    def __init__(self, path: str, fd: int, holder: Holder, writes_holder: bool):
        self.path, self.fd, self.holder, self.writes_holder = path, fd, holder, writes_holder

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.writes_holder:
                os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)
            self.fd = -1


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def acquire(run_dir: str, warn: Callable[[str], None], *, flock=fcntl.flock, env=os.environ,
            wait_for_name_s: float = 2.0) -> RunDirLock:
    """Take RUN_DIR/.lock (creating the run dir) or raise RunDirInUse naming its holder.
    `warn` receives one line for a taken-over stale lock or a file system without flock."""
    global _warned_unsupported
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    fd = _open_regular(run_dir, path)
    try:
        me = this_process(env)
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            raise RunDirInUse(run_dir, _holder_once_named(fd, wait_for_name_s)) from None
        except OSError as e:
            if e.errno not in FLOCK_UNSUPPORTED:
                raise
            if not _warned_unsupported:
                _warned_unsupported = True
                warn(unsupported_line(run_dir, e))
            locked = False
        left = _read(fd)
        former = parse_holder(left)
        if not locked and former and former.host == me.host and former.pid != me.pid and _pid_alive(former.pid):
            raise RunDirInUse(run_dir, former)
        requeued = locked and former is not None and former.slurm_job_id != "" and \
            former.slurm_job_id == me.slurm_job_id  # this job's earlier start, ended by its requeue
        if left.strip() and not requeued:  # a line no clean exit cleared
            warn(takeover_line(run_dir, former, unverified=not locked and former is not None
                               and former.host != me.host))
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.to_text().encode(), 0)
        os.fsync(fd)
        return RunDirLock(path, fd, me, writes_holder=True)
    except BaseException:
        os.close(fd)
        raise


def _open_regular(run_dir: str, path: str) -> int:
    """The lock file, opened for reading and writing; a link, folder or FIFO in its place is
    refused rather than followed or written to."""
    not_a_file = UsageError(f"run dir {run_dir}: {LOCK_NAME} is not a regular file; remove it")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise not_a_file from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise not_a_file
    return fd


def _holder_once_named(fd: int, wait_s: float) -> Holder | None:
    """The holder of a lock just taken may not have written its line yet: give it a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = parse_holder(_read(fd))
        if holder or time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


def check_free(run_dir: str) -> None:
    """Raise RunDirInUse when a live process holds the run dir, without taking it: for a job
    submitted now and started later, whose rank 0 takes the lock then. A moment's shared lock
    is the probe; a file system without flock says nothing here."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no lock file (or none that acquire would accept, which it then reports)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(run_dir, _holder_once_named(fd, 2.0)) from None
        except OSError as e:
            if e.errno not in FLOCK_UNSUPPORTED:
                raise
    finally:
        os.close(fd)


def adopt_inherited(run_dir: str, env=os.environ) -> RunDirLock | None:
    """The lock the local spawner holds and passed down (INHERITED_FD_ENV), when the descriptor
    is RUN_DIR/.lock; None otherwise."""
    try:
        fd = int(env[INHERITED_FD_ENV])
        held, named = os.fstat(fd), os.stat(os.path.join(run_dir, LOCK_NAME))
    except (KeyError, ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
        return None
    os.set_inheritable(fd, False)
    holder = parse_holder(_read(fd)) or this_process(env)
    return RunDirLock(os.path.join(run_dir, LOCK_NAME), fd, holder, writes_holder=False)


def take(run_dir: str, warn: Callable[[str], None]) -> RunDirLock:
    """Rank 0's way in: the spawner's lock when it passed one down, else the lock itself."""
    return adopt_inherited(run_dir) or acquire(run_dir, warn)
