"""Preemption: a signal (default SIGUSR2, as `#SBATCH --signal=USR2@120` sends; SIGTERM too
when configured) sets a flag; at the end of the iteration the ranks agree, checkpoint, close
run.h5 and exit with EXIT_PREEMPTED; under Slurm rank 0 requeues the job."""
from __future__ import annotations

import signal
import subprocess


class PreemptFlag:
    def __init__(self, signal_name: str, handle_sigterm: bool, log):
        self.requested = False
        self.signal_name = ""
        self.log = log
        names = [signal_name] + (["SIGTERM"] if handle_sigterm and signal_name != "SIGTERM" else [])
        for name in names:
            try:
                signum = signal.Signals[name]
            except KeyError:
                raise ValueError(f"preempt.signal: unknown signal {name!r}") from None
            signal.signal(signum, self._handler)

    def _handler(self, signum, _frame) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            self.log.warning("received %s: will checkpoint and stop at the end of this iteration",
                             self.signal_name)
        self.requested = True


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
