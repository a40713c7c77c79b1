"""Errors every layer shares, the process exit codes, and errors as one line."""
from __future__ import annotations

# A rank's and the command's exit codes; 75 (EX_TEMPFAIL) tells Slurm and submitit to requeue;
# 130 (128 + SIGINT, as shells report Ctrl-C): interrupted by the user, checkpointed, not requeued;
# 69 (EX_UNAVAILABLE): a service the job needs (a remote reward term's server) stayed unreachable
# past its wait, the steps done checkpointed, not requeued.
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
EXIT_UNAVAILABLE = 69


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


class ConfigError(ValueError):
    """A config problem, phrased for the user in one line."""


class OutageError(RuntimeError):
    """A service the job needs stayed unreachable for as long as it was configured to wait (one
    line): the job stops with a checkpoint of the steps it finished, rather than failing."""


def first_line(e: BaseException, default: str = "") -> str:
    """The first line of an error's message: library errors often carry a traceback or a stack
    of causes, and a failure is reported as one line."""
    text = str(e).strip().splitlines()
    return text[0] if text else default


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`."""
    return f"{type(e).__name__}: {first_line(e)}"
