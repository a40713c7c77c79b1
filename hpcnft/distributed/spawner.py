"""The local spawner: with no launcher in the environment, `hpcnft run` starts the layout's
ranks itself, as new interpreters running `python -m hpcnft.run.rank`, passes signals on to
them, and decides the job's exit code; and what its ranks do about it (their process name,
their end when the spawner dies). Standard library only: the spawner never imports torch."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from hpcnft.distributed import preempt

RANK_COMMAND = (sys.executable, "-m", "hpcnft.run.rank")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SPAWNER_PID_ENV = preempt.SPAWNER_PID_ENV  # set by spawn_local for its ranks
STOP_CODES = (75, 130)  # a rank's exit after a stop signal: preempted (checkpointed), interrupted
BAD_INPUT_CODE = 2
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def name_process(rank: int) -> None:
    """Name this process `hpcnft-rank-N` (Linux's comm: what ps, top and pgrep show)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, f"hpcnft-rank-{rank}".encode(), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is a convenience
        pass


def end_with_parent(parent_pid: int, signum: int = signal.SIGHUP) -> bool:
    """Have the kernel send SIGNUM to this rank when its spawner (PARENT_PID) dies, however it
    dies (the OOM killer's SIGKILL included): the rank then checkpoints and stops instead of
    training on unsupervised. A spawner already gone sends it now. False where the kernel
    cannot (not Linux)."""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # it died before the request above was in place
        os.kill(os.getpid(), signum)
    return True


def spawn_local(argv: list[str], world_size: int, role_of, grace_s: float = 15.0, preempted_code: int = 75,
                command: tuple[str, ...] = RANK_COMMAND,
                rank0_fd: tuple[str, int] | None = None, resume_hint: str = "",
                failure_claim=None) -> int:
    """Run `python -m hpcnft.run.rank <argv>` as `world_size` local ranks; forward signals; when a rank
    fails, give the others `grace_s` to notice and report, then stop them. Returns the exit
    code of the first rank that failed (128+signal for a signal), else 0; 130 after a Ctrl-C.
    `rank0_fd` (variable name, descriptor): an open file rank 0 inherits, its number in that
    variable. Each rank is a new interpreter running `command` `argv`.

    A first SIGINT (Ctrl-C) reaches every rank, which checkpoints at the end of its step and
    exits 130; a second one kills them at once, with `resume_hint` (how to resume) said.
    `failure_claim` (run.failures.FailureClaim of the run dir): the ranks' claim of the job's
    first failure; the spawner claims it for a rank killed by a signal (which cannot), and names
    its holder as the rank that failed rather than the first one it saw exit."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   HPCNFT_LAUNCHER="local", **{SPAWNER_PID_ENV: str(os.getpid())})
        fds = ()
        if rank0_fd:
            env.pop(rank0_fd[0], None)
        if rank == 0 and rank0_fd:
            env[rank0_fd[0]], fds = str(rank0_fd[1]), (rank0_fd[1],)
        procs.append(subprocess.Popen([*command, *argv], env=env, pass_fds=fds))

    received: list[int] = []  # in order; the loop below says what they did

    def forward(signum, _frame):
        received.append(signum)
        again = signum == signal.SIGINT and received.count(signal.SIGINT) > 1
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if again else signum)

    def stopped_by_what_we_forwarded(code: int) -> bool:
        # A rank killed by a stop signal this spawner passed on had nothing to save yet: a
        # preemption, not a failure of that rank; one killed after a second Ctrl-C was asked to die.
        if code == -signal.SIGKILL:
            return received.count(signal.SIGINT) > 1
        return code < 0 and -code in received

    def say(text: str) -> None:
        print(f"hpcnft: {text}", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    first_failure: tuple[int, int] | None = None
    interrupts_said = 0
    deadline = None
    try:
        while True:
            interrupts = received.count(signal.SIGINT)
            if interrupts > interrupts_said:
                interrupts_said = interrupts
                say("interrupted: the ranks checkpoint at the end of the step under way and stop "
                    "(Ctrl-C again stops them at once)" if interrupts == 1 else
                    "interrupted again: the ranks are stopped at once" +
                    (f"; {resume_hint} resumes from the last checkpoint" if resume_hint else ""))
            # Every exit code is read in the same pass that decides the job is over: ranks that
            # fail together (a full disk, a dead peer) may all end within one poll interval.
            codes = [p.poll() for p in procs]
            # Of the ranks found failed in one pass, one killed by a signal is the cause: the
            # others noticed its death and exited on their own.
            killed_first = sorted(enumerate(codes), key=lambda rank_code: (rank_code[1] or 0) >= 0)
            for rank, code in killed_first:
                if code in (None, 0) or first_failure is not None:
                    continue
                if stopped_by_what_we_forwarded(code):
                    if code != -signal.SIGKILL:
                        say(f"{signal.Signals(-code).name} reached rank {rank} ({role_of(rank)}) before it could "
                            "checkpoint: nothing to save")
                    code = preempted_code
                elif code in (*STOP_CODES, preempted_code):
                    pass  # checkpointed and stopped, as a stop signal asked
                elif code == BAD_INPUT_CODE:
                    pass  # refused on bad input, which every rank meets alike: one of them said it
                else:
                    if code < 0 and failure_claim is not None:
                        failure_claim.claim(rank)  # a rank killed by a signal says nothing itself
                    cause = failure_claim.holder() if failure_claim is not None else None
                    rank = rank if cause is None or not 0 <= cause < world_size else cause
                    ended = codes[rank]
                    say(f"rank {rank} ({role_of(rank)}) failed" + (f": {describe_exit(ended)}" if ended else "") +
                        "; stopping the other ranks")
                    code = ended or code
                first_failure = (rank, code)
                deadline = time.monotonic() + grace_s
            if all(code is not None for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if first_failure is None:
        return 0
    _, code = first_failure
    if signal.SIGINT in received and code in (*STOP_CODES, preempted_code):
        return 130
    return 128 - code if code < 0 else code
