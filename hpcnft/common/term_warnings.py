"""Warnings a reward term gives while it scores: an image it scored without being able to read it
(the OCR term's recognition failed, so it scored 0, as the reference does), never a crash.

A term calls `warn(text)`. Whoever scores a chunk collects them with `collected()` and passes
them on: the reward service sends them to the train rank with the chunk's scores, rank 0 writes
them into run.h5 as warning events (and says them on the terminal), `hpcnft score` and
`hpcnft reward-server` print them. Outside `collected()` a warning goes to the `hpcnft` logger.
A collection belongs to the context (thread) that opened it: a scoring worker thread collects
its own chunk's warnings only.

A term that must say something while it scores, not after (a remote term waiting for its
server), calls `announce(text)`: the line goes at once to where the process shows the user
its lines (`announce_to`: a rank's terminal and log), else to stderr."""
from __future__ import annotations

import contextlib
import contextvars
import logging
import sys

MAX_CHARS = 300  # of one warning: a few of them fit in one reply of the reward service

_found: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("hpcnft_term_warnings", default=None)


def warn(text: str) -> None:
    text = " ".join(text.split())  # one line
    if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS - 3] + "..."
    found = _found.get()
    if found is None:
        logging.getLogger("hpcnft").warning(text)
    else:
        found.append(text)


@contextlib.contextmanager
def collected():
    """The warnings given in this context while it is open, as a list that fills as they come."""
    found: list[str] = []
    token = _found.set(found)
    try:
        yield found
    finally:
        _found.reset(token)


_announced = None  # where announce() sends a line: set by the process (announce_to), else stderr


def announce_to(sink) -> None:
    """Send announce()'s lines to `sink(text)` from now on (None: stderr)."""
    global _announced
    _announced = sink


def announce(text: str) -> None:
    """A line the user should read now, not with the chunk's scores (one line)."""
    text = " ".join(text.split())
    if _announced is not None:
        _announced(text)
    else:
        print(f"hpcnft: {text}", file=sys.stderr, flush=True)
