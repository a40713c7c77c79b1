"""Preemption: a signal (default SIGUSR2, as `#SBATCH --signal=USR2@120` sends; SIGTERM too
when configured) sets a flag; at the end of the iteration the ranks agree, checkpoint, close
run.h5 and exit with EXIT_PREEMPTED; under Slurm rank 0 then requeues the job (Slurm kills the
job's processes right after a requeue, so it comes last), unless the signal was Slurm's own
SIGTERM: then Slurm is ending the job already and has decided what follows.

SIGHUP stops the same way without a requeue: the local spawner's ranks receive it when the
spawner dies (groups.end_with_parent) or the terminal hangs up. SIGINT (Ctrl-C) is an
interrupt: the same checkpoint and stop, no requeue, exit 130; a second Ctrl-C makes the local
spawner stop its ranks at once. A stop signal that lands before a rank has its flag (while it
imports) is kept by `catch_early` and handed to the flag."""
from __future__ import annotations

import os
import signal
import subprocess

STOP_SIGNAL = "SIGHUP"  # the spawner died, or the terminal hung up: checkpoint and stop, no requeue
OUTPUT_CLOSED = "its output was closed"  # a write to a pipe with no reader (run.output_guard): the same
INTERRUPT_SIGNAL = "SIGINT"  # Ctrl-C: checkpoint and stop, no requeue, exit 130
EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SPAWNER_PID_ENV = "HPCNFT_SPAWNER_PID"  # set by the local spawner (groups.spawn_local) for its ranks
_early: list[int] = []  # the first stop signal received before a PreemptFlag existed


def _record_early(signum, _frame) -> None:
    if not _early:
        _early.append(signum)


def catch_early(interrupt: bool = False) -> None:
    """Keep a stop signal that arrives before the rank's PreemptFlag is made (the rank is still
    importing): the flag then acts on it, instead of the signal's default killing the rank
    with 128+N and nothing said. `interrupt`: SIGINT too, for a rank of the local spawner, which
    a Ctrl-C reaches with the spawner (elsewhere a Ctrl-C before the job began just stops it)."""
    if signal.getsignal(signal.SIGTERM) is not _record_early:  # a second call keeps what the first caught
        _early.clear()
    for signum in EARLY_SIGNALS + ((signal.SIGINT,) if interrupt else ()):
        signal.signal(signum, _record_early)


def early_signal() -> str:
    """The name of the signal catch_early kept, or ""."""
    return signal.Signals(_early[0]).name if _early else ""


class PreemptFlag:
    def __init__(self, signal_name: str, handle_sigterm: bool, log):
        self.requested = False
        self.signal_name, self.preempt_signal = "", signal_name
        self.log = log
        names = [signal_name] + (["SIGTERM"] if handle_sigterm and signal_name != "SIGTERM" else [])
        names += [name for name in (STOP_SIGNAL, INTERRUPT_SIGNAL) if name not in names]
        self.signals = []
        for name in names:
            try:
                signum = signal.Signals[name]
            except KeyError:
                raise ValueError(f"preempt.signal: unknown signal {name!r}") from None
            signal.signal(signum, self._handler)
            self.signals.append(signum)
        self._take_early()

    def _take_early(self) -> None:
        """Act on a signal catch_early kept: a flag's signal sets the flag; any other one gets
        its default action now, as it would have had without catch_early."""
        for signum in EARLY_SIGNALS + (signal.SIGINT,):
            if signum not in self.signals and signal.getsignal(signum) is _record_early:
                signal.signal(signum, signal.SIG_DFL)
        if not _early:
            return
        signum = _early.pop()
        if signum in self.signals:
            self._handler(signum, None)
        else:
            os.kill(os.getpid(), signum)

    @property
    def interrupted(self) -> bool:
        """The stop was the user's Ctrl-C (SIGINT), not a scheduler's signal."""
        return self.signal_name == INTERRUPT_SIGNAL != self.preempt_signal

    def retire(self) -> None:
        """Ignore the preempt signals from now on: the rank has finished (or failed) and its exit
        code is decided. Python puts a signal with a Python handler back to its default action
        when the interpreter shuts down, and SIGUSR2's default kills the process: a time-limit
        warning that lands while a finished rank tears down would turn exit 0 into a kill."""
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)

    def request(self, reason: str) -> None:
        """A stop asked for by the rank itself (`reason`, e.g. OUTPUT_CLOSED), as SIGHUP asks one."""
        if self.requested:
            return
        self.signal_name, self.requested = reason, True
        self.log.warning("%s: will checkpoint and stop at the end of this iteration", reason)

    def _handler(self, signum, _frame) -> None:
        if self.requested:
            return
        # The flag first: the log line below can fail (a handler runs between any two bytecodes,
        # possibly inside a write to the same log file) and must not lose the request.
        self.signal_name = signal.Signals(signum).name
        self.requested = True
        self.log.warning("received %s: will checkpoint and stop at the end of this iteration", self.signal_name)


def leave_requeue_to_slurm(received: str, preempt_signal: str) -> str | None:
    """Why a preempted rank 0 does not requeue the job itself, or None when it should.
    SIGTERM, unless it is the configured preempt signal, is how Slurm ends a job: scancel (the
    user wants it gone), an external `scontrol requeue` or a preemption with requeue (Slurm
    requeues it), the time limit (the job is over; a time-limited job asks for the warning
    signal, `--signal=USR2@120`, to be requeued)."""
    if received == INTERRUPT_SIGNAL and preempt_signal != INTERRUPT_SIGNAL:
        return f"{INTERRUPT_SIGNAL}: interrupted by the user; not requeued"
    if received == STOP_SIGNAL and preempt_signal != STOP_SIGNAL:
        return f"{STOP_SIGNAL}: the process that started the ranks, or their terminal, is gone; not requeued"
    if received == OUTPUT_CLOSED:
        return f"{OUTPUT_CLOSED} (nobody reads the job's output any more); not requeued"
    if received == "SIGTERM" and preempt_signal != "SIGTERM":
        return ("SIGTERM: Slurm is ending the job (scancel, scontrol requeue, time limit or preemption); "
                "not requeued by hpcnft")
    return None


def requeue(job_id: str, log) -> str:
    """`scontrol requeue JOB`; returns a one-line outcome. The job id is passed as one argument,
    never through a shell."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job_id} failed: {e}"
    if r.returncode != 0:
        return f"scontrol requeue {job_id} failed: {(r.stderr or r.stdout).strip()}"
    log.info("requeued Slurm job %s", job_id)
    return f"requeued Slurm job {job_id}"
