"""The local spawner: with no launcher in the environment, `hpcnft run` starts the layout's
ranks itself, as new interpreters running `python -P -m hpcnft.run.rank` (or, where no rank can
use a GPU, forked by a fork server that imported their libraries once, and adopted), passes
signals on to them, and decides the job's exit code; and what its ranks do about it (their
process name, their end when the spawner dies). Standard library only: no torch."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

from hpcnft.common.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_UNAVAILABLE
from hpcnft.distributed import preempt
from hpcnft.distributed.interpreter import module_command, python_env
from hpcnft.distributed.launch import LOOPBACK, MASTER_LISTEN_FD_ENV

# never with the working directory on their path (distributed.interpreter)
RANK_COMMAND = module_command("hpcnft.run.rank")
FORK_SERVER_COMMAND = module_command("hpcnft.distributed.fork_server")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SPAWNER_PID_ENV = preempt.SPAWNER_PID_ENV  # set by spawn_local for its ranks
STOP_CODES = (EXIT_PREEMPTED, EXIT_INTERRUPTED)  # a rank's exit after a stop signal, checkpointed
PR_SET_NAME, PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 15, 1, 36


def free_port() -> int:
    """A port free now, for a process started later (the tests' ranks); a job's own rendezvous
    takes listening_socket instead."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def listening_socket() -> socket.socket:
    """A loopback socket the kernel gave a free port and that already listens: the local job's
    rendezvous, handed to rank 0. A port only chosen (free_port) can be taken by another process
    (another job's store, a client's ephemeral port) before rank 0 binds it."""
    s = socket.socket()
    s.bind((LOOPBACK, 0))
    s.listen(128)
    return s


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


def torch_is_cpu_only() -> bool:
    """Whether the installed torch is a CPU-only build ("+cpu" in its version), read from its
    metadata without importing it."""
    from importlib import metadata

    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def ranks_can_fork(device: str) -> bool:
    """Whether the ranks may be forked by a fork server (distributed.fork_server) that imported
    their libraries once, instead of each starting a new interpreter: only when no rank can use a
    GPU (CUDA does not survive a fork), known without importing torch: layout.device cpu, or a
    CPU-only torch; and on Linux, where this process can adopt them (a child subreaper)."""
    return sys.platform.startswith("linux") and (device == "cpu" or (device == "auto" and torch_is_cpu_only()))


def become_subreaper() -> bool:
    """Have the ranks a fork server forks become this process's children when the server exits
    (Linux's child subreaper), so that they are waited on and signalled as its own."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class AdoptedRank:
    """A rank forked by the fork server and adopted by this process. Polled and signalled as a
    Popen."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_ranks(fork: tuple[str, str], argv: list[str], envs: list[dict[str, str]],
               fds: list[tuple[int, ...]], close_fds: tuple[int, ...],
               server_env: dict[str, str] | None = None) -> list[AdoptedRank] | str:
    """Start the fork server (distributed.fork_server) with `fork` = (prepare, entry) specs, let
    it import the ranks' libraries, then have it fork one rank per env: the adopted ranks. A
    stop signal that came while it imported (preempt.catch_early kept it) forks nothing: its
    name is returned instead."""
    if not become_subreaper():
        raise RuntimeError("cannot adopt forked ranks (prctl PR_SET_CHILD_SUBREAPER failed)")
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    server = subprocess.Popen([*FORK_SERVER_COMMAND, "--request-fd", str(request_r), "--reply-fd", str(reply_w),
                               "--spawner-pid", str(os.getpid())],
                              pass_fds=(request_r, reply_w, *close_fds), env=dict(python_env(os.environ), **(server_env or {})))
    os.close(request_r)
    os.close(reply_w)
    with os.fdopen(request_w, "w") as requests, os.fdopen(reply_r, "r") as replies:
        requests.write(json.dumps({"prepare": fork[0], "entry": fork[1], "argv": argv, "close_fds": list(close_fds),
                                   "ranks": [{"env": env, "keep_fds": list(keep)} for env, keep in zip(envs, fds)]})
                       + "\n")
        requests.flush()
        ready = replies.readline()
        early = preempt.early_signal()
        if ready and not early:
            requests.write("go\n")
            requests.flush()
            pids = json.loads(replies.readline() or "{}").get("pids")
        else:
            pids = None
    code = server.wait()
    if early:
        return early
    if not pids:
        raise RuntimeError(f"the fork server failed ({describe_exit(code)}) before it started the ranks")
    return [AdoptedRank(pid) for pid in pids]


def spawn_local(argv: list[str], world_size: int, role_of, grace_s: float = 15.0, preempted_code: int = EXIT_PREEMPTED,
                command: tuple[str, ...] = RANK_COMMAND,
                rank0_fd: tuple[str, int] | None = None, fork: tuple[str, str] | None = None,
                resume_hint=None, failure_claim=None, env: dict[str, str] | None = None) -> int:
    """Run `python -P -m hpcnft.run.rank <argv>` as `world_size` local ranks; forward signals; when a rank
    fails, give the others `grace_s` to notice and report, then stop them. Returns the exit
    code of the first rank that failed (128+signal for a signal), else 0; 130 after a Ctrl-C.
    `rank0_fd` (variable name, descriptor): an open file rank 0 inherits, its number in that
    variable. With `fork` = ("module:prepare", "module:entry"), a fork server runs prepare(argv)
    once and forks the ranks, which run entry(argv) (see ranks_can_fork); else each rank is a new
    interpreter running `command` `argv`. A stop signal that came before the ranks started
    (preempt.catch_early kept it) starts none: `preempted_code`.

    A first SIGINT (Ctrl-C) reaches every rank, which checkpoints at the end of its step and
    exits 130; a second one kills them at once, with `resume_hint()` said (how to go on, as the
    run dir stands then: from which checkpoint, or from the start).
    `failure_claim` (run.failures.FailureClaim of the run dir): the ranks' claim of the job's
    first failure; the spawner claims it for a rank killed by a signal (which cannot), and names
    its holder as the rank that failed rather than the first one it saw exit. `env`: variables
    every rank (and the fork server, for its prepare) gets beside this process's."""

    def say(text: str) -> None:
        print(f"hpcnft: {text}", file=sys.stderr, flush=True)

    with listening_socket() as rendezvous:  # rank 0 keeps its copy; the spawner's closes once they started
        rank0_fds = {MASTER_LISTEN_FD_ENV: rendezvous.fileno()}
        if rank0_fd:
            rank0_fds[rank0_fd[0]] = rank0_fd[1]
        envs, fds = [], []
        for rank in range(world_size):
            rank_env = dict(python_env(os.environ), **(env or {}), RANK=str(rank), WORLD_SIZE=str(world_size),
                            LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=LOOPBACK,
                            MASTER_PORT=str(rendezvous.getsockname()[1]),
                            HPCNFT_LAUNCHER="local", **{SPAWNER_PID_ENV: str(os.getpid())})
            for name, fd in rank0_fds.items():
                rank_env.pop(name, None)
                if rank == 0:
                    rank_env[name] = str(fd)
            envs.append(rank_env)
            fds.append(tuple(rank0_fds.values()) if rank == 0 else ())
        early = preempt.early_signal()
        if fork is not None and not early:
            try:
                procs = fork_ranks(fork, argv, envs, fds, tuple(rank0_fds.values()), env)
            except (OSError, RuntimeError) as e:  # its traceback, if any, is above
                say(f"cannot start the ranks: {e}")
                return EXIT_FAILED
            early = procs if isinstance(procs, str) else ""
        elif not early:
            procs = [subprocess.Popen([*command, *argv], env=e, pass_fds=keep) for e, keep in zip(envs, fds)]
    if early:
        say(f"{early} before the ranks started: nothing to save")
        return preempted_code

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
                    "interrupted again: the ranks are stopped at once" + (f"; {resume_hint()}" if resume_hint else ""))
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
                elif code in (*STOP_CODES, preempted_code, EXIT_UNAVAILABLE):
                    pass  # checkpointed and stopped, as a stop signal asked or as rank 0 said
                elif code == EXIT_BAD_INPUT:
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
        return EXIT_INTERRUPTED
    return 128 - code if code < 0 else code
