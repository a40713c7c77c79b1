"""Process groups, roles and the local spawner.

Roles come from `layout`: the last `reward_ranks` ranks serve PickScore, the others train (one
FSDP2 mesh). World 1 is colocated: the one process trains and scores.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpcnft.common.errors import ConfigError, first_line
from hpcnft.distributed import netif, preempt
from hpcnft.distributed.launch import LaunchInfo


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a collective's tensors must live: NCCL takes only device tensors, gloo CPU ones."""
    return device if backend == "nccl" else torch.device("cpu")


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    train_ranks: list[int]
    reward_ranks: list[int]
    launcher: str
    backend: str
    device: torch.device
    job_id: str | None = None
    restart_count: int = 0
    hosts: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    # The reward traffic's group of every rank on the host (gloo); None when the world group is
    # gloo already (reward_service says why NCCL does not carry it).
    host_group: object = field(default=None, repr=False)

    @property
    def role(self) -> str:
        if not self.reward_ranks:
            return "colocated"
        return "reward" if self.rank in self.reward_ranks else "train"

    @property
    def comm_device(self) -> torch.device:
        return collective_device(self.backend, self.device)

    @property
    def train_index(self) -> int:
        return self.train_ranks.index(self.rank)

    def reward_rank_for(self, train_rank: int) -> int:
        return self.reward_ranks[self.train_ranks.index(train_rank) % len(self.reward_ranks)]

    def clients_of(self, reward_rank: int) -> list[int]:
        return [t for t in self.train_ranks if self.reward_rank_for(t) == reward_rank]

    def as_attrs(self) -> dict:
        return {"world_size": self.world_size, "train_ranks": self.train_ranks, "reward_ranks": self.reward_ranks,
                "roles": ["reward" if r in self.reward_ranks else ("colocated" if not self.reward_ranks else "train")
                          for r in range(self.world_size)],
                "hosts": self.hosts, "launcher": self.launcher, "devices": self.devices, "backend": self.backend,
                "slurm_job_id": self.job_id or "", "torch_version": torch.__version__}


def roles(world_size: int, reward_ranks: int) -> tuple[list[int], list[int]]:
    if world_size == 1:
        return [0], []
    if reward_ranks >= world_size:
        raise ConfigError(f"layout.reward_ranks: {reward_ranks} leaves no train rank in a world of {world_size}")
    n_train = world_size - reward_ranks
    return list(range(n_train)), list(range(n_train, world_size))


def pick_device(cfg, local_rank: int) -> torch.device:
    want = cfg.layout.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("layout.device: 'cuda' asked for, but no CUDA device is available")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class RendezvousError(RuntimeError):
    """The ranks could not meet at the master address and port."""


def rendezvous_error(e: BaseException, info: LaunchInfo, route: str = "") -> RendezvousError:
    """One line for a failed init_process_group: where, why, and the fix when the port is taken.
    ROUTE (netif.route_to) says how this rank tried to reach the master: address and interface."""
    first = first_line(e, type(e).__name__)
    where = info.endpoint
    if "EADDRINUSE" in first or "address already in use" in first.lower():
        return RendezvousError(f"rank {info.rank} cannot listen on {where}: the port is taken on this node; "
                               f"set MASTER_PORT to a free port for this job")
    via = f" ({route})" if route else ""
    return RendezvousError(f"rank {info.rank} cannot rendezvous at {where}{via}: {first}")


def resolve_backend(cfg, device: torch.device) -> str:
    """The collective backend: layout.backend, or NCCL on GPUs and gloo on CPUs. Refuses
    layout.emulate_hosts where it cannot apply (ConfigError)."""
    backend = cfg.layout.backend if cfg.layout.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if cfg.layout.emulate_hosts and backend != "nccl":
        raise ConfigError(f"layout.emulate_hosts: lets NCCL ranks share a GPU; this job's backend is {backend} "
                          f"on {device.type}")
    return backend


def emulate_host(rank: int, env=os.environ) -> None:
    """Make this rank look like a host of its own to NCCL, which otherwise refuses two ranks of
    one communicator on one GPU ("Duplicate GPU detected"); NCCL then joins them over sockets.
    Read by NCCL when its first communicator starts, so set before the process group."""
    env["NCCL_HOSTID"] = f"hpcnft-emulated-host-{rank}"


def setup(cfg, info: LaunchInfo):
    """Initialise torch.distributed; returns (topology, train group, train mesh). A rendezvous
    that fails (the port taken, the master unreachable) raises RendezvousError with one line."""
    from torch.distributed.device_mesh import DeviceMesh

    device = pick_device(cfg, info.local_rank)
    backend = resolve_backend(cfg, device)
    if cfg.layout.emulate_hosts:
        emulate_host(info.rank)
    train, reward = roles(info.world_size, cfg.layout.reward_ranks)
    timeout = datetime.timedelta(seconds=cfg.layout.timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    netif.bind_collectives(os.environ)  # before the group: gloo and NCCL read it when they start
    try:
        dist.init_process_group(backend, init_method=info.init_method,
                                rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    except dist.DistError as e:  # DistNetworkError (the port), DistStoreError (a timeout)
        raise rendezvous_error(e, info, netif.route_to(info.master_addr)) from e
    topo = Topology(info.rank, info.world_size, info.local_rank, train, reward, info.launcher, backend, device,
                    info.job_id, info.restart_count)
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, (socket.gethostname(), str(device)))
    topo.hosts = [h for h, _ in everyone]
    topo.devices = [d for _, d in everyone]
    # Always a group of the train ranks (even of one): collectives such as DCP's must never
    # include the reward ranks, which are busy serving.
    train_group = dist.new_group(train, timeout=timeout)
    if reward and backend != "gloo":
        topo.host_group = dist.new_group(backend="gloo", timeout=timeout)
    mesh = DeviceMesh(device.type, torch.tensor(train))
    return topo, train_group, mesh


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the local spawner (no launcher in the environment) ---------------------------------
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SPAWNER_PID_ENV = preempt.SPAWNER_PID_ENV  # set by spawn_local for its ranks
STOP_CODES = (75, 130)  # a rank's exit after a stop signal: preempted (checkpointed), interrupted
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


def ranks_can_fork(cfg) -> bool:
    """Whether the local spawner may fork its ranks from itself instead of starting new
    interpreters: only when no rank can use a GPU (asking whether CUDA is there initialises it,
    and CUDA does not survive a fork) and nothing has run a torch operation in the spawner yet
    (the caller's part: a GNU OpenMP pool started before a fork hangs the children)."""
    return cfg.layout.device == "cpu" or not (torch.version.cuda or torch.version.hip)


class ForkedRank:
    """A rank forked from the spawner, which has imported what a rank imports, so the rank
    starts without importing torch, diffusers and transformers again; `entry(argv)` is the
    rank's command line as `python -m hpcnft` would run it. Polled and signalled as a Popen."""

    def __init__(self, entry, argv: list[str], env: dict[str, str], keep_fds: tuple[int, ...],
                 close_fds: tuple[int, ...]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the spawner's frames
            self._run_rank(entry, argv, env, keep_fds, close_fds)
        self.pid, self.returncode = pid, None

    @staticmethod
    def _run_rank(entry, argv, env, keep_fds, close_fds) -> None:
        code = 1
        try:
            for fd in close_fds:
                if fd not in keep_fds:
                    os.close(fd)
            for s in FORWARDED_SIGNALS:  # the spawner's handlers are not the rank's
                signal.signal(s, signal.SIG_DFL)
            preempt.catch_early(interrupt=True)  # until the rank's PreemptFlag takes over
            os.environ.clear()
            os.environ.update(env)
            code = entry(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit 1
            import traceback

            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()  # what an interpreter's exit runs: libraries' handlers, logging
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

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


def spawn_local(argv: list[str], world_size: int, role_of, grace_s: float = 15.0, preempted_code: int = 75,
                command: tuple[str, ...] = (sys.executable, "-m", "hpcnft"),
                rank0_fd: tuple[str, int] | None = None, entry=None, resume_hint: str = "",
                failure_claim=None) -> int:
    """Run `python -m hpcnft <argv>` as `world_size` local ranks; forward signals; when a rank
    fails, give the others `grace_s` to notice and report, then stop them. Returns the exit
    code of the first rank that failed (128+signal for a signal), else 0; 130 after a Ctrl-C.
    `rank0_fd` (variable name, descriptor): an open file rank 0 inherits, its number in that
    variable. With `entry` (the command line's main), the ranks are forked from this process and
    run `entry(argv)` (see ranks_can_fork), else they are new interpreters running `command`.

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
        if entry is not None:
            procs.append(ForkedRank(entry, argv, env, fds, (rank0_fd[1],) if rank0_fd else ()))
        else:
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
