"""The job's first failure, said once. When one rank fails, the others fail after it (a peer
gone, an error relayed): each failing rank claims RUN_DIR/logs/first_failure as the first thing
it does, and only the rank that holds the claim prints its line; the others' lines go to their
logs. The local spawner reads the claim to name the rank that caused the failure. Standard
library only: the spawner reads it."""
from __future__ import annotations

import os

FAILURE_CLAIM = os.path.join("logs", "first_failure")


def claim_failure(run_dir: str, rank: int) -> bool:
    """Claim the job's first failure for `rank`: True if it is (or already was) this rank's."""
    path = os.path.join(run_dir, FAILURE_CLAIM)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return failed_rank(run_dir) == rank
    except OSError:  # a full disk or a lost mount: no claim to be had, so say it
        return True
    with os.fdopen(fd, "w") as f:
        f.write(f"{rank}\n")
    return True


def failed_rank(run_dir: str) -> int | None:
    """The rank holding the failure claim, or None."""
    try:
        with open(os.path.join(run_dir, FAILURE_CLAIM)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def clear_failure_claim(run_dir: str) -> None:
    """A new start's ranks claim afresh: called by the run dir's owner before any rank can fail."""
    try:
        os.remove(os.path.join(run_dir, FAILURE_CLAIM))
    except FileNotFoundError:
        pass
