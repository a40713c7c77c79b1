"""Warnings a reward term gives while it scores: an image it scored without being able to read it
(the OCR term's recognition failed, so it scored 0, as the reference does), never a crash.

A term calls `warn(text)`. Whoever scores a chunk collects them with `collected()` and passes
them on: the reward service sends them to the train rank with the chunk's scores, rank 0 writes
them into run.h5 as warning events (and says them on the terminal), `hpcnft score` and
`hpcnft reward-server` print them. Outside `collected()` a warning goes to the `hpcnft` logger.
A collection belongs to the context (thread) that opened it: a scoring worker thread collects
its own chunk's warnings only."""
from __future__ import annotations

import contextlib
import contextvars
import logging

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
