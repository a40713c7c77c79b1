"""Who am I: what a rank learns from its launcher's environment (pure: no torch), the names each
launcher's variables have, and Slurm host lists and ports.

`hpcnft.distributed.detect.detect(os.environ)` answers rank, world size, local rank, master
address/port, Slurm job id and restart count for every way hpcnft is started on a cluster. The
variables each launcher sets are a table here (LAUNCHER_ENV, SLURM_ENV), as in submitit; a small
reader per launcher in distributed.detect applies its rules.
Detection order, first match wins (each row is a unit test):

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
(unique per mpirun); else 29500. The local spawner sets MASTER_PORT to a socket it already listens
on and hands that socket to rank 0 (MASTER_LISTEN_FD_ENV), which serves the rendezvous on it.

World sizes are cross-checked where two sources describe the same launch (an MPI world that
Slurm's srun launched task by task must have SLURM_NTASKS ranks); a mismatch raises
`LaunchError` with a one-line message naming both numbers. This is what catches MPICH under
``srun --mpi=pmix`` silently running N singletons of size 1.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from hpcnft.common.errors import ConfigError

__all__ = ["LaunchInfo", "LaunchError", "NodelistError", "parse_nodelist", "job_port", "LAUNCHERS", "DEFAULT_PORT",
           "EnvNames", "LAUNCHER_ENV", "SLURM_ENV", "MASTER_LISTEN_FD_ENV"]

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


# -------------------------------------------------------------------- the environment's names

@dataclass(frozen=True)
class EnvNames:
    """Where one launcher puts a rank's facts, as submitit's JobEnvironment does (None: the
    launcher does not say)."""
    launcher: str
    rank: str
    world: str | None
    local_rank: str | None = None
    local_size: str | None = None
    node_rank: str | None = None


# Detection order, first match wins; a launcher is recognised by its `rank` variable.
LAUNCHER_ENV = (
    EnvNames("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", None, "GROUP_RANK"),
    EnvNames("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
    EnvNames("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # local: MPICH's hydra only
    EnvNames("pmix", "PMIX_RANK", None),  # the size comes from MPI
    EnvNames("slurm", "SLURM_PROCID", None, "SLURM_LOCALID", None, "SLURM_NODEID"),  # size: SLURM_ENV["ntasks"]
)

# Slurm's names; where several are given, the first one set wins.
SLURM_ENV = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),  # set inside an srun step only
    "restart_count": ("SLURM_RESTART_COUNT",),
    "ntasks": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
    "step_nodelist": ("SLURM_STEP_NODELIST",),
    "job_nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
}
# What tells one mpirun from another, for its port when no Slurm job id is there.
MPIRUN_ID = ("OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE", "PMI_JOBID")
MASTER_ENV = ("MASTER_ADDR", "MASTER_PORT")
# Set by the local spawner for rank 0 only: a socket already listening on MASTER_PORT, on which
# rank 0 serves the rendezvous store, so no other process can take the port in between.
MASTER_LISTEN_FD_ENV = "HPCNFT_MASTER_LISTEN_FD"


# ------------------------------------------------------------------------------- ports and hosts

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


def roles(world_size: int, reward_ranks: int) -> tuple[list[int], list[int]]:
    """(train ranks, reward ranks) of a world: the last `reward_ranks` serve rewards; world 1 is
    colocated (the one rank trains and scores)."""
    if world_size == 1:
        return [0], []
    if reward_ranks >= world_size:
        raise ConfigError(f"layout.reward_ranks: {reward_ranks} leaves no train rank in a world of {world_size}")
    n_train = world_size - reward_ranks
    return list(range(n_train)), list(range(n_train, world_size))
