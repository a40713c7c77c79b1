"""Who am I, read from the environment: `detect(os.environ)` finds the launcher through the
table of names in `launch` (first match wins) and applies its rules; launch's docstring gives
the order, the master address and port, and the cross-checks. Pure: reads a mapping, imports no
torch (MPI only where a launch needs it)."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Mapping

from hpcnft.distributed.launch import (DEFAULT_PORT, LAUNCHER_ENV, LOOPBACK, MASTER_ENV, MPIRUN_ID, SLURM_ENV, EnvNames,
                                LaunchError, LaunchInfo, job_port, parse_nodelist)


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


def _opt_int(env: Mapping[str, str], name: str | None) -> int | None:
    return _int(env, name) if name and (env.get(name) or "").strip() else None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


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
_SLURM = {n.launcher: n for n in LAUNCHER_ENV}["slurm"]


@dataclass(frozen=True)
class _Env:
    """The environment as detect() reads it: the launcher-independent facts, parsed once."""
    env: Mapping[str, str]
    job_id: str | None
    restart: int
    step: bool  # inside an srun step (the batch script itself is not a rank)
    master_addr: str | None
    master_port: int | None
    procid: int | None
    localid: int | None
    nodeid: int | None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> _Env:
        s = SLURM_ENV
        return cls(env, _first(env, *s["job_id"]), _int(env, s["restart_count"][0], 0),
                   _first(env, *s["step_id"]) is not None, _first(env, MASTER_ENV[0]), _opt_int(env, MASTER_ENV[1]),
                   _opt_int(env, _SLURM.rank), _opt_int(env, _SLURM.local_rank), _opt_int(env, _SLURM.node_rank))

    def ntasks(self) -> int | None:
        name = next((n for n in SLURM_ENV["ntasks"] if (self.env.get(n) or "").strip()), None)
        return _int(self.env, name) if name else None

    def step_local(self, default: int = 0) -> int:
        """Slurm's local id where srun started this very process (inside a step)."""
        return self.localid if (self.step and self.localid is not None) else default

    def slurm_port(self) -> int:
        return self.master_port if self.master_port is not None else job_port(self.job_id)

    def slurm_launched_addr(self) -> str:
        """Ranks are srun's tasks (or torchrun/submitit that did not say): first step host."""
        if self.master_addr:
            return self.master_addr
        if self.job_id:
            host = (_first_host(_first(self.env, *SLURM_ENV["step_nodelist"]) if self.step else None)
                    or _first_host(_first(self.env, *SLURM_ENV["job_nodelist"])))
            if host:
                return host
        return LOOPBACK

    def mpirun_master(self, all_local: bool | None, world: int, bcast) -> tuple[str, int]:
        """Ranks started by an mpirun (OMPI or hydra), inside Slurm or not."""
        if self.master_port is not None:
            port = self.master_port
        elif self.job_id:
            port = job_port(self.job_id)
        else:
            key = _first(self.env, *MPIRUN_ID)
            port = job_port(key) if key else DEFAULT_PORT
        if self.master_addr:
            return self.master_addr, port
        if world == 1 or all_local:
            return LOOPBACK, port
        try:
            host, bport = (bcast or _default_mpi_bcast_master)()
        except _MPI_ERRORS as e:
            # no mpi4py: under Slurm the batch host (first of the job's nodes) runs mpirun and rank 0
            host = _first_host(_first(self.env, *SLURM_ENV["job_nodelist"])) if self.job_id else None
            if not host:
                raise LaunchError(f"ranks span several nodes and rank 0's address is unknown "
                                  f"(set MASTER_ADDR, or install mpi4py: {e})") from None
            return host, port
        return host, (self.master_port if self.master_port is not None else int(bport))

    def cross_check(self, world: int, rank: int, what: str, hint: str = "") -> None:
        """The MPI world and srun's task set are the same launch: their sizes must agree."""
        ntasks = self.ntasks()
        if ntasks is not None and ntasks != world:
            raise LaunchError(f"{what} world size {world} != SLURM_NTASKS={ntasks} (rank {rank})"
                              + (f": {hint}" if hint else ""))

    def info(self, names: EnvNames, rank: int, world: int, local: int, addr: str, port: int, node: int) -> LaunchInfo:
        _check(rank, world, local, names)
        return LaunchInfo(names.launcher, rank, world, local, addr, port, self.job_id, self.restart, node)


_CHECK_LABEL = {"openmpi": "OMPI_COMM_WORLD", "slurm": "SLURM_PROCID/SLURM_NTASKS"}


def _check(rank: int, world: int, local: int, names: EnvNames) -> None:
    what = _CHECK_LABEL.get(names.launcher) or (names.rank if names.world is None else f"{names.rank}/{names.world}")
    if world < 1:
        raise LaunchError(f"{what}: world size {world} < 1")
    if not 0 <= rank < world:
        raise LaunchError(f"{what}: rank {rank} outside world size {world}")
    if local < 0:
        raise LaunchError(f"{what}: local rank {local} < 0")


# ------------------------------------------------------------------- one reader per launcher

def _torchrun(e: _Env, n: EnvNames, mpi_size, bcast) -> LaunchInfo:
    env = e.env
    if not (n.rank in env and n.world in env):
        have, missing = (n.rank, n.world) if n.rank in env else (n.world, n.rank)
        raise LaunchError(f"{have} is set but {missing} is not")
    rank, world = _int(env, n.rank), _int(env, n.world)
    local = _opt_int(env, n.local_rank)
    local = e.step_local() if local is None else local
    node = _opt_int(env, n.node_rank)
    node = (e.nodeid if (e.step and e.nodeid is not None) else 0) if node is None else node
    return e.info(n, rank, world, local, e.slurm_launched_addr(), e.slurm_port(), node)


def _openmpi(e: _Env, n: EnvNames, mpi_size, bcast) -> LaunchInfo:
    env = e.env
    rank, world = _int(env, n.rank), _int(env, n.world)
    local = _int(env, n.local_rank, 0)
    local_size = _opt_int(env, n.local_size)
    _check(rank, world, local, n)
    # Slurm variables here normally belong to the enclosing allocation (mpirun in sbatch:
    # SLURM_PROCID=0 on every rank, SLURM_NTASKS of the allocation) or to the srun step
    # that mpirun used to start its orted daemons. They describe the same launch only if
    # srun started these very ranks: inside a step, no mpirun HNP, Slurm task id == rank.
    if e.step and MPIRUN_ID[0] not in env and e.procid in (None, rank):
        e.cross_check(world, rank, n.world)
    all_local = None if local_size is None else local_size == world
    addr, port = e.mpirun_master(all_local, world, bcast)
    return e.info(n, rank, world, local, addr, port, 0)


def _pmi(e: _Env, n: EnvNames, mpi_size, bcast) -> LaunchInfo:
    env = e.env
    rank, world = _int(env, n.rank), _int(env, n.world)
    hydra = n.local_rank in env  # set by MPICH's hydra, not by Slurm's pmi2
    local = _int(env, n.local_rank) if hydra else e.step_local()
    _check(rank, world, local, n)
    if e.step and not hydra and e.procid in (None, rank):
        e.cross_check(world, rank, n.world)
        return e.info(n, rank, world, local, e.slurm_launched_addr(), e.slurm_port(), e.nodeid or 0)
    local_size = _opt_int(env, n.local_size)
    all_local = None if local_size is None else local_size == world
    addr, port = e.mpirun_master(all_local, world, bcast)
    return e.info(n, rank, world, local, addr, port, 0)


def _pmix(e: _Env, n: EnvNames, mpi_size, bcast) -> LaunchInfo:
    rank = _int(e.env, n.rank)
    ntasks = e.ntasks() if e.step else None
    try:
        world = int((mpi_size or _default_mpi_size)())
    except _MPI_ERRORS as err:
        if ntasks is None:
            raise LaunchError(f"{n.rank}={rank} is set but the world size is unknown "
                              f"(no Slurm step, MPI unavailable: {err})") from None
        world = ntasks
    local = e.step_local()
    if e.step:
        e.cross_check(world, rank, "MPI", "the MPI library did not join srun's PMIx job "
                      "(MPICH? use srun --mpi=pmi2; Open MPI: srun --mpi=pmix)")
        if e.procid is not None and e.procid != rank:
            raise LaunchError(f"{n.rank}={rank} != {_SLURM.rank}={e.procid}")
    _check(rank, world, local, n)
    if e.step:
        return e.info(n, rank, world, local, e.slurm_launched_addr(), e.slurm_port(), e.nodeid or 0)
    addr, port = e.mpirun_master(None, world, bcast)
    return e.info(n, rank, world, local, addr, port, 0)


def _slurm(e: _Env, n: EnvNames, mpi_size, bcast) -> LaunchInfo:
    world = e.ntasks()
    if world is None:
        raise LaunchError(f"{n.rank}={e.procid} is set but SLURM_NTASKS is not")
    local = e.localid if e.localid is not None else 0
    return e.info(n, e.procid, world, local, e.slurm_launched_addr(), e.slurm_port(), e.nodeid or 0)


_READERS = {"torchrun": _torchrun, "openmpi": _openmpi, "pmi": _pmi, "pmix": _pmix, "slurm": _slurm}


def _launched_by(e: _Env, n: EnvNames) -> bool:
    if n.launcher == "torchrun":  # either variable: the other one missing is an error
        return n.rank in e.env or n.world in e.env
    if n.launcher == "slurm":  # plain srun: only inside a step
        return e.step and e.procid is not None
    return n.rank in e.env


def detect(env: Mapping[str, str], *, mpi_size: Callable[[], int] | None = None,
           mpi_bcast_master: Callable[[], tuple[str, int]] | None = None) -> LaunchInfo:
    """Describe this process's place in the job from its environment (see the module doc).

    ``mpi_size`` (default: lazily ``mpi4py.MPI.COMM_WORLD.Get_size()``) is only called for
    ``PMIX_RANK`` launches; ``mpi_bcast_master`` (default: rank 0's hostname and a free port,
    broadcast with mpi4py) only for an mpirun spanning several nodes with no ``MASTER_ADDR``.
    Both are collective under MPI: every rank of the job must call detect().
    """
    e = _Env.read(env)
    for names in LAUNCHER_ENV:
        if _launched_by(e, names):
            return _READERS[names.launcher](e, names, mpi_size, mpi_bcast_master)
    # no launcher: one process (which spawns local ranks, so the master is this host)
    return LaunchInfo("none", 0, 1, 0, e.master_addr or LOOPBACK, e.slurm_port(), e.job_id, e.restart, 0)
