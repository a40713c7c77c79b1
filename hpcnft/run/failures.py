"""The job's first failure, said once. When one rank fails, the others fail after it (a peer
gone, an error relayed): each failing rank claims RUN_DIR/logs/first_failure as the first thing
it does, and only the rank that holds the claim prints its line; the others' lines go to their
logs. A rank whose error only says that a peer is gone waits a moment before claiming, so that
the cause claims first; the local spawner claims for a rank killed by a signal, which cannot.
Standard library only: the spawner reads it."""
from __future__ import annotations

import os
import time

FAILURE_CLAIM = os.path.join("logs", "first_failure")
CONSEQUENCE_WAIT_S = 3.0  # how long a rank that saw a peer go waits for the cause's claim


class FailureClaim:
    """The claim of one run dir. A claim is a symbolic link whose target is the rank: created
    atomically, and readable whole, even on a full disk (it needs no data block)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, FAILURE_CLAIM)

    def claim(self, rank: int) -> bool:
        """Claim the job's first failure for `rank`: True if it is (or already was) its own,
        or if no claim can be made at all (a lost mount): then the rank says it."""
        try:
            os.symlink(str(rank), self.path)
        except FileExistsError:
            return self.holder() == rank
        except OSError:
            return True
        return True

    def holder(self) -> int | None:
        """The rank holding the claim, or None."""
        try:
            return int(os.readlink(self.path))
        except (OSError, ValueError):
            return None

    def wait_for_holder(self, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while (holder := self.holder()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return holder

    def clear(self) -> None:
        """A new start's ranks claim afresh: called by the run dir's owner before any rank can fail."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
