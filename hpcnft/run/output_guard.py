"""A process's printing never kills it. Python ignores SIGPIPE, so a write to a pipe whose reader
has gone (`hpcnft run ... | tee` or a pager killed, a terminal that hung up under `| cat`) raises
BrokenPipeError, and a rank would die of its progress line before it could checkpoint. `guard`
wraps stdout and stderr (and the rank's copy of the terminal) so that such a write stops the
printing instead: the file descriptor then points to /dev/null (what native libraries write goes
nowhere too, and the interpreter's last flush cannot fail), the stream goes on accepting writes,
and `on_closed()` runs once: a rank asks for a stop (preempt.OUTPUT_CLOSED), checkpoints at the
end of the step under way and exits as a preempted rank does; the spawner just stops printing."""
from __future__ import annotations

import errno
import io
import os
import sys

CLOSED = (errno.EPIPE, errno.ECONNRESET)


class GuardedStream(io.TextIOBase):
    """`stream`, whose writes and flushes to a closed reader turn its descriptor to /dev/null."""

    def __init__(self, stream, on_closed):
        super().__init__()
        self.stream, self.on_closed, self.closed_reader = stream, on_closed, False

    def _reader_gone(self) -> None:
        if self.closed_reader:
            return
        self.closed_reader = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
        self.on_closed()

    def _guarded(self, action, *args):
        try:
            return action(*args)
        except OSError as e:
            if e.errno not in CLOSED:
                raise
            self._reader_gone()
            try:  # what was buffered goes to /dev/null now
                return action(*args)
            except OSError:
                return None

    def write(self, text: str) -> int:
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        if not self.stream.closed:
            self._guarded(self.stream.flush)

    def fileno(self) -> int:
        return self.stream.fileno()

    def close(self) -> None:
        try:
            self.stream.close()
        except OSError:  # its last flush, to a closed reader
            pass
        super().close()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return self.stream.encoding

    @property
    def errors(self):
        return self.stream.errors

    @property
    def buffer(self):
        return self.stream.buffer


def guard(stream, on_closed=lambda: None):
    """`stream` guarded (once: a guarded stream is returned as it is)."""
    if stream is None or isinstance(stream, GuardedStream):
        return stream
    return GuardedStream(stream, on_closed)


def guard_std_streams(on_closed=lambda: None) -> None:
    """Guard sys.stdout and sys.stderr; `on_closed()` runs once, on the first closed one."""
    said = []

    def once() -> None:
        if not said:
            said.append(True)
            on_closed()

    sys.stdout = guard(sys.stdout, once)
    sys.stderr = guard(sys.stderr, once)
