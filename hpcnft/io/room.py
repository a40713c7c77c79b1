"""Room for run.h5 to grow, made sure of before HDF5 writes to it. A write that meets a full disk,
a quota or a file-size limit partway can leave an HDF5 file unreadable (its superblock then names
an end of file beyond the file's own end), so rank 0's writer (io.run_writer) refuses a write
whole rather than letting it fail halfway:

- `check(nbytes)`: the file system's free space (ENOSPC), and the room the process's file-size
  limit leaves the file (`ulimit -f`, RLIMIT_FSIZE: a write past it fails with EFBIG), must both
  hold twice `nbytes` plus 256 KiB;
- a reserve file beside it (`.<name>.reserve`, RESERVE_BYTES allocated, not sparse) is given back
  just before each write (`release`) and taken again after it (`take`). A quota (EDQUOT: nothing
  reports the room it leaves in advance) or a disk that another process fills is found when the
  reserve cannot be taken again: the next write is then refused, the file as it was. A write
  that grows the file by less than the reserve cannot meet a quota halfway, unless another
  process of the user takes that room between the release and the write."""
from __future__ import annotations

import errno
import os
import resource

MARGIN_BYTES = 256 << 10
RESERVE_BYTES = MARGIN_BYTES  # an append grows run.h5 by a few KiB, a structural change is checked by its size
FULL = {errno.ENOSPC: "file system full", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file size limit"}


class NoRoom(Exception):
    """Why the file may not grow now (one line, without the path)."""


def _file_size_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


class Room:
    def __init__(self, path: str, reserve: bool = True):
        folder, name = os.path.split(os.path.abspath(path))
        self.path, self.folder = path, folder
        self.reserve_path = os.path.join(folder, f".{name}.reserve") if reserve else ""
        self.full = ""  # why the reserve could not be taken back: every later write is refused

    def check(self, nbytes: int = 0) -> None:
        """NoRoom unless the file may grow by twice `nbytes` plus the margin."""
        if self.full:
            raise NoRoom(self.full)
        need = 2 * nbytes + MARGIN_BYTES
        st = os.statvfs(self.folder)
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise NoRoom(f"only {free >> 10} KiB free on its file system")
        limit = _file_size_limit()
        if limit is not None:
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            if limit - size < need:
                raise NoRoom(f"only {max(limit - size, 0) >> 10} KiB left under the file size limit of "
                             f"{limit >> 10} KiB, ulimit -f")

    def _reserve_bytes(self) -> int:
        limit = _file_size_limit()  # the reserve is a file too: it must not meet the limit itself
        return RESERVE_BYTES if limit is None else min(RESERVE_BYTES, limit // 2)

    def take(self) -> None:
        """Allocate the reserve; NoRoom (remembered: later writes are refused) where the disk
        or the quota has no room for it."""
        if not self.reserve_path or self.full:
            return
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError:
            self.reserve_path = ""  # no reserve here (a read-only folder, say): the checks above remain
            return
        try:
            os.posix_fallocate(fd, 0, self._reserve_bytes())
        except OSError as e:
            if e.errno not in FULL:
                self.release()
                self.reserve_path = ""  # the file system cannot allocate ahead: the checks above remain
                return
            self.full = f"{FULL[e.errno]}: no room for the next write"
            raise NoRoom(self.full) from None
        finally:
            os.close(fd)
            if self.full:
                self.release()

    def release(self) -> None:
        if self.reserve_path:
            try:
                os.remove(self.reserve_path)
            except FileNotFoundError:
                pass
