"""Who am I: launcher detection from the environment (pure: reads a mapping, imports no torch).

`detect(os.environ)` answers rank, world size, local rank, master address/port, Slurm job id and
restart count for every way hpcnft is started on a cluster. Detection order, first match wins
(hpc_notes.md §5.2 shows why; each row of its table is a unit test):

1. ``RANK``/``WORLD_SIZE``           torchrun, submitit's TorchDistributedEnvironment.export()
2. ``OMPI_COMM_WORLD_*``             Open MPI ``mpirun`` (also inside sbatch, where every rank
                                     inherits the batch step's SLURM_PROCID=0 / SLURM_LOCALID=0)
3. ``PMI_RANK``/``PMI_SIZE``         MPICH ``mpiexec`` (hydra), ``srun --mpi=pmi2``
4. ``PMIX_RANK``                     ``srun --mpi=pmix`` (size from MPI: ``mpi_size()``)
5. ``SLURM_PROCID``/``SLURM_NTASKS`` plain ``srun``, only inside a step (``SLURM_STEP_ID`` set):
                                     the batch script itself is not a rank
6. none                              rank 0 of 1 (hpcnft then spawns the layout's ranks locally)

Master address: ``MASTER_ADDR`` if set; for ranks that Slurm launched, the first host of
``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``); for ranks an ``mpirun`` launched,
127.0.0.1 when all ranks share this node, else rank 0's hostname broadcast over MPI
(``mpi_bcast_master()``, which also picks a free port on rank 0), falling back to the first
host of ``SLURM_JOB_NODELIST`` when MPI is not importable; 127.0.0.1 otherwise (also for the
local spawner of launcher "none", whose ranks are all children of this process).

Master port: ``MASTER_PORT`` if set; else ``job_port(SLURM_JOB_ID)`` under Slurm (every rank of
the job derives the same port; concurrent steps of one job need ``MASTER_PORT``); else, under
mpirun without Slurm, a hash of ``OMPI_MCA_orte_hnp_uri``/``PMIX_NAMESPACE``/``PMI_JOBID``
(unique per mpirun); else 29500.

World sizes are cross-checked where two sources describe the same launch (an MPI world that
Slurm's srun launched task by task must have SLURM_NTASKS ranks); a mismatch raises
`LaunchError` with a one-line message naming both numbers. This is what catches MPICH under
``srun --mpi=pmix`` silently running N singletons of size 1.
"""
from __future__ import annotations

import re
import socket
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["LaunchInfo", "LaunchError", "NodelistError", "detect", "parse_nodelist", "job_port",
           "LAUNCHERS", "DEFAULT_PORT"]

LAUNCHERS = ("torchrun", "openmpi", "pmi", "pmix", "slurm", "none")
DEFAULT_PORT = 29500
LOOPBACK = "127.0.0.1"


class LaunchError(Exception):
    """The environment describes an impossible or inconsistent launch (one-line message)."""


class NodelistError(LaunchError, ValueError):
    """A Slurm host list that cannot be parsed."""


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str        # one of LAUNCHERS
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job_id: str | None   # SLURM_JOB_ID when under Slurm
    restart_count: int   # SLURM_RESTART_COUNT (0 if absent)
    node_rank: int       # 0 if unknown

    @property
    def endpoint(self) -> str:
        """``addr:port`` of the rendezvous, an IPv6 address in brackets."""
        addr = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{addr}:{self.master_port}"

    @property
    def init_method(self) -> str:
        """``tcp://addr:port`` for torch.distributed.init_process_group."""
        return f"tcp://{self.endpoint}"

    def describe(self) -> str:
        job = ""
        if self.job_id:
            job = f" job {self.job_id}" + (f" restart {self.restart_count}" if self.restart_count else "")
        return (f"{self.launcher}: rank {self.rank}/{self.world_size} local {self.local_rank} "
                f"node {self.node_rank} master {self.master_addr}:{self.master_port}{job}")


# ------------------------------------------------------------------------------------ helpers

def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if (env.get(name) or "").strip() else None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


def _slurm_job(env: Mapping[str, str]) -> str | None:
    return _first(env, "SLURM_JOB_ID", "SLURM_JOBID")


def _in_step(env: Mapping[str, str]) -> bool:
    """True inside an srun step (srun sets SLURM_STEP_ID; the batch script has none)."""
    return _first(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None


def _slurm_ntasks(env: Mapping[str, str]) -> int | None:
    name = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
                 if (env.get(n) or "").strip()), None)
    return _int(env, name) if name else None


def _first_host(nodelist: str | None) -> str | None:
    if not nodelist:
        return None
    hosts = parse_nodelist(nodelist)
    return hosts[0] if hosts else None


def _default_mpi_size() -> int:
    from mpi4py import MPI  # lazy: initialises MPI

    return MPI.COMM_WORLD.Get_size()


def _default_mpi_bcast_master() -> tuple[str, int]:
    from mpi4py import MPI  # lazy: initialises MPI

    comm = MPI.COMM_WORLD
    value = None
    if comm.Get_rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        value = (socket.gethostname(), port)
    host, port = comm.bcast(value, root=0)
    return str(host), int(port)


_MPI_ERRORS = (ImportError, RuntimeError, OSError)


# ------------------------------------------------------------------------------- public API

def job_port(job_id: str | None, base: int = 20000, span: int = 20000) -> int:
    """A port in [base, base+span) that every rank of one job derives alike; 29500 without a job.

    Numeric job ids map to ``base + id % span`` so jobs that run at the same time (nearby ids)
    get distinct ports; other ids (``123_4``, a PMIx namespace, an HNP URI) are CRC32-hashed.
    """
    if span < 1 or base < 1 or base + span > 65536:
        raise ValueError(f"job_port: bad range base={base} span={span}")
    if job_id is None or str(job_id).strip() == "":
        return DEFAULT_PORT
    s = str(job_id).strip()
    n = int(s) if s.isdigit() else zlib.crc32(s.encode())
    return base + n % span


_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(body: str, text: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = _RANGE_RE.match(part)
        if not m:
            raise NodelistError(f"bad range {part!r} in host list {text!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = int(hi_s) if hi_s is not None else lo
        if hi < lo:
            raise NodelistError(f"descending range {part!r} in host list {text!r}")
        if hi - lo > 100000:
            raise NodelistError(f"range {part!r} in host list {text!r} is too large")
        width = len(lo_s)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_host(item: str, text: str) -> list[str]:
    """Expand one host expression, which may hold several bracket groups (rack[1-2]-n[01-02])."""
    open_i = item.find("[")
    if open_i < 0:
        if "]" in item:
            raise NodelistError(f"unbalanced ']' in host list {text!r}")
        return [item]
    close_i = item.find("]", open_i)
    if close_i < 0 or "[" in item[open_i + 1:close_i]:
        raise NodelistError(f"unbalanced '[' in host list {text!r}")
    prefix, body, rest = item[:open_i], item[open_i + 1:close_i], item[close_i + 1:]
    if "]" in prefix:
        raise NodelistError(f"unbalanced ']' in host list {text!r}")
    tails = _expand_host(rest, text) if rest else [""]
    return [f"{prefix}{n}{t}" for n in _expand_ranges(body, text) for t in tails]


def parse_nodelist(s: str) -> list[str]:
    """Expand a Slurm host list: ``"gpu[001-004,010],cpu7"`` -> gpu001..gpu004, gpu010, cpu7.

    Commas inside brackets belong to the range; zero padding follows the range's first number;
    text after a bracket (``a[1-2]-ib``) and several bracket groups per host are supported.
    Raises NodelistError (a LaunchError and ValueError) on malformed input.
    """
    text = s
    s = (s or "").strip()
    if not s or s == "(null)":
        return []
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(s):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    if depth != 0:
        raise NodelistError(f"unbalanced '[' in host list {text!r}")
    items.append(s[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            raise NodelistError(f"empty host name in host list {text!r}")
        hosts.extend(_expand_host(item, text))
    return hosts


def detect(env: Mapping[str, str], *, mpi_size: Callable[[], int] | None = None,
           mpi_bcast_master: Callable[[], tuple[str, int]] | None = None) -> LaunchInfo:
    """Describe this process's place in the job from its environment (see the module doc).

    ``mpi_size`` (default: lazily ``mpi4py.MPI.COMM_WORLD.Get_size()``) is only called for
    ``PMIX_RANK`` launches; ``mpi_bcast_master`` (default: rank 0's hostname and a free port,
    broadcast with mpi4py) only for an mpirun spanning several nodes with no ``MASTER_ADDR``.
    Both are collective under MPI: every rank of the job must call detect().
    """
    job_id = _slurm_job(env)
    restart = _int(env, "SLURM_RESTART_COUNT", 0)
    step = _in_step(env)
    master_addr_env = _first(env, "MASTER_ADDR")
    master_port_env = _opt_int(env, "MASTER_PORT")
    slurm_procid = _opt_int(env, "SLURM_PROCID")
    slurm_localid = _opt_int(env, "SLURM_LOCALID")
    slurm_nodeid = _opt_int(env, "SLURM_NODEID")
    step_nodelist = _first(env, "SLURM_STEP_NODELIST")
    job_nodelist = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")

    def slurm_port() -> int:
        return master_port_env if master_port_env is not None else job_port(job_id)

    def slurm_launched_addr() -> str:
        """Ranks are srun's tasks (or torchrun/submitit that did not say): first step host."""
        if master_addr_env:
            return master_addr_env
        if job_id:
            host = _first_host(step_nodelist if step else None) or _first_host(job_nodelist)
            if host:
                return host
        return LOOPBACK

    def mpirun_master(all_local: bool | None, world: int) -> tuple[str, int]:
        """Ranks started by an mpirun (OMPI or hydra), inside Slurm or not."""
        port_keys = ("OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE", "PMI_JOBID")
        if master_port_env is not None:
            port = master_port_env
        elif job_id:
            port = job_port(job_id)
        else:
            key = _first(env, *port_keys)
            port = job_port(key) if key else DEFAULT_PORT
        if master_addr_env:
            return master_addr_env, port
        if world == 1 or all_local:
            return LOOPBACK, port
        try:
            host, bport = (mpi_bcast_master or _default_mpi_bcast_master)()
        except _MPI_ERRORS as e:
            # no mpi4py: under Slurm the batch host (first of the job's nodes) runs mpirun and rank 0
            host = _first_host(job_nodelist) if job_id else None
            if not host:
                raise LaunchError(f"ranks span several nodes and rank 0's address is unknown "
                                  f"(set MASTER_ADDR, or install mpi4py: {e})") from None
            return host, port
        return host, (master_port_env if master_port_env is not None else int(bport))

    def check(rank: int, world: int, local: int, what: str) -> None:
        if world < 1:
            raise LaunchError(f"{what}: world size {world} < 1")
        if not 0 <= rank < world:
            raise LaunchError(f"{what}: rank {rank} outside world size {world}")
        if local < 0:
            raise LaunchError(f"{what}: local rank {local} < 0")

    def cross_check_slurm(world: int, rank: int, what: str, hint: str = "") -> None:
        """The MPI world and srun's task set are the same launch: their sizes must agree."""
        ntasks = _slurm_ntasks(env)
        if ntasks is not None and ntasks != world:
            raise LaunchError(f"{what} world size {world} != SLURM_NTASKS={ntasks} (rank {rank})"
                              + (f": {hint}" if hint else ""))

    # 1. torchrun / submitit export
    if "RANK" in env or "WORLD_SIZE" in env:
        if not ("RANK" in env and "WORLD_SIZE" in env):
            have, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise LaunchError(f"{have} is set but {missing} is not")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _opt_int(env, "LOCAL_RANK")
        if local is None:
            local = slurm_localid if (step and slurm_localid is not None) else 0
        node = _opt_int(env, "GROUP_RANK")
        if node is None:
            node = slurm_nodeid if (step and slurm_nodeid is not None) else 0
        check(rank, world, local, "RANK/WORLD_SIZE")
        return LaunchInfo("torchrun", rank, world, local, slurm_launched_addr(), slurm_port(),
                          job_id, restart, node)

    # 2. Open MPI mpirun
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_size = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        check(rank, world, local, "OMPI_COMM_WORLD")
        # Slurm variables here normally belong to the enclosing allocation (mpirun in sbatch:
        # SLURM_PROCID=0 on every rank, SLURM_NTASKS of the allocation) or to the srun step
        # that mpirun used to start its orted daemons. They describe the same launch only if
        # srun started these very ranks: inside a step, no mpirun HNP, Slurm task id == rank.
        if step and "OMPI_MCA_orte_hnp_uri" not in env and slurm_procid in (None, rank):
            cross_check_slurm(world, rank, "OMPI_COMM_WORLD_SIZE")
        all_local = None if local_size is None else local_size == world
        addr, port = mpirun_master(all_local, world)
        return LaunchInfo("openmpi", rank, world, local, addr, port, job_id, restart, 0)

    # 3. PMI (MPICH hydra, srun --mpi=pmi2)
    if "PMI_RANK" in env:
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        hydra = "MPI_LOCALRANKID" in env          # set by MPICH's hydra, not by Slurm's pmi2
        if hydra:
            local = _int(env, "MPI_LOCALRANKID")
        else:
            local = slurm_localid if (step and slurm_localid is not None) else 0
        check(rank, world, local, "PMI_RANK/PMI_SIZE")
        if step and not hydra and slurm_procid in (None, rank):
            cross_check_slurm(world, rank, "PMI_SIZE")
            return LaunchInfo("pmi", rank, world, local, slurm_launched_addr(), slurm_port(),
                              job_id, restart, slurm_nodeid or 0)
        local_size = _opt_int(env, "MPI_LOCALNRANKS")
        all_local = None if local_size is None else local_size == world
        addr, port = mpirun_master(all_local, world)
        return LaunchInfo("pmi", rank, world, local, addr, port, job_id, restart, 0)

    # 4. PMIx without Open MPI's mpirun variables: srun --mpi=pmix
    if "PMIX_RANK" in env:
        rank = _int(env, "PMIX_RANK")
        ntasks = _slurm_ntasks(env) if step else None
        try:
            world = int((mpi_size or _default_mpi_size)())
        except _MPI_ERRORS as e:
            if ntasks is None:
                raise LaunchError(f"PMIX_RANK={rank} is set but the world size is unknown "
                                  f"(no Slurm step, MPI unavailable: {e})") from None
            world = ntasks
        local = slurm_localid if (step and slurm_localid is not None) else 0
        if step:
            cross_check_slurm(world, rank, "MPI", "the MPI library did not join srun's PMIx job "
                              "(MPICH? use srun --mpi=pmi2; Open MPI: srun --mpi=pmix)")
            if slurm_procid is not None and slurm_procid != rank:
                raise LaunchError(f"PMIX_RANK={rank} != SLURM_PROCID={slurm_procid}")
        check(rank, world, local, "PMIX_RANK")
        if step:
            return LaunchInfo("pmix", rank, world, local, slurm_launched_addr(), slurm_port(),
                              job_id, restart, slurm_nodeid or 0)
        addr, port = mpirun_master(None, world)
        return LaunchInfo("pmix", rank, world, local, addr, port, job_id, restart, 0)

    # 5. plain srun: only inside a step; the batch script (no SLURM_STEP_ID) is not a rank
    if step and slurm_procid is not None:
        world = _slurm_ntasks(env)
        if world is None:
            raise LaunchError(f"SLURM_PROCID={slurm_procid} is set but SLURM_NTASKS is not")
        local = slurm_localid if slurm_localid is not None else 0
        check(slurm_procid, world, local, "SLURM_PROCID/SLURM_NTASKS")
        return LaunchInfo("slurm", slurm_procid, world, local, slurm_launched_addr(), slurm_port(),
                          job_id, restart, slurm_nodeid or 0)

    # 6. no launcher: one process (which spawns local ranks, so the master is this host)
    return LaunchInfo("none", 0, 1, 0, master_addr_env or LOOPBACK, slurm_port(), job_id,
                      restart, 0)
