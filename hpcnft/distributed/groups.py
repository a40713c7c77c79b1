"""Process groups and roles (the local spawner that starts ranks is distributed/spawner.py).

Roles come from `layout`: the last `reward_ranks` ranks serve PickScore, the others train (one
FSDP2 mesh). World 1 is colocated: the one process trains and scores.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpcnft.common.errors import ConfigError, first_line
from hpcnft.distributed import netif
from hpcnft.distributed.launch import MASTER_LISTEN_FD_ENV, LaunchInfo, roles  # noqa: F401 - roles: where they were


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
    # gloo already (reward_service says why NCCL does not carry the requests).
    host_group: object = field(default=None, repr=False)
    # layout.reward_transport resolved ("gloo" or "nccl"), and under "nccl" this rank's NCCL
    # communicators with its reward peers, by the peer's rank (a train rank: its reward rank;
    # a reward rank: each of its train ranks).
    reward_transport: str = "gloo"
    pair_groups: dict = field(default_factory=dict, repr=False)

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
                "slurm_job_id": self.job_id or "", "torch_version": torch.__version__,
                "reward_transport": self.reward_transport if self.reward_ranks else ""}


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


def local_store(info: LaunchInfo, timeout: datetime.timedelta, env=os.environ) -> dist.TCPStore:
    """The rendezvous store of ranks the local spawner started: rank 0 serves it on the socket the
    spawner already listens on (MASTER_LISTEN_FD_ENV), which no other process can take between
    the port's choice and its use, as it could a port merely named in MASTER_PORT."""
    listen_fd = env.get(MASTER_LISTEN_FD_ENV) if info.rank == 0 else None
    return dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=info.rank == 0,
                         timeout=timeout, multi_tenant=True,
                         master_listen_fd=int(listen_fd) if listen_fd else None)


def resolve_backend(cfg, device: torch.device) -> str:
    """The collective backend: layout.backend, or NCCL on GPUs and gloo on CPUs. Refuses
    layout.emulate_hosts where it cannot apply (ConfigError)."""
    backend = cfg.layout.backend if cfg.layout.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if cfg.layout.emulate_hosts and backend != "nccl":
        raise ConfigError(f"layout.emulate_hosts: lets NCCL ranks share a GPU; this job's backend is {backend} "
                          f"on {device.type}")
    return backend


def resolve_transport(cfg, backend: str) -> str:
    """layout.reward_transport: `nccl` only where the job's backend is NCCL (ConfigError
    otherwise); `auto` is gloo (docs/architecture.md, "The reward traffic", says why)."""
    want = cfg.layout.reward_transport
    if want == "nccl" and backend != "nccl":
        raise ConfigError(f"layout.reward_transport: 'nccl' sends the images between GPUs; this job's backend is "
                          f"{backend} on the {'GPU' if backend == 'nccl' else 'CPU'}")
    return "nccl" if want == "nccl" else "gloo"


def pair_groups(topo: Topology, timeout: datetime.timedelta, backend: str = "nccl") -> dict[int, object]:
    """One communicator per train/reward pair (NCCL in a job), made by every rank in the train
    ranks' order (new_group is collective); this rank keeps those it belongs to, by its peer's
    rank."""
    mine = {}
    for t in topo.train_ranks:
        r = topo.reward_rank_for(t)
        g = dist.new_group(sorted((t, r)), timeout=timeout, backend=backend)
        if topo.rank in (t, r):
            mine[r if topo.rank == t else t] = g
    return mine


def group_backends(backend: str, cfg) -> str:
    """The process groups' backend string: under perf.fsdp_cpu_offload an NCCL job also gets gloo,
    for collectives on CPU tensors (gradient clipping reduces the norms of CPU-resident shards)."""
    if backend == "nccl" and cfg.perf.fsdp_cpu_offload:
        return "cuda:nccl,cpu:gloo"
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
    transport = resolve_transport(cfg, backend)
    if cfg.layout.emulate_hosts:
        emulate_host(info.rank)
    train, reward = roles(info.world_size, cfg.layout.reward_ranks)
    timeout = datetime.timedelta(seconds=cfg.layout.timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    netif.bind_collectives(os.environ)  # before the group: gloo and NCCL read it when they start
    try:
        meet = {"store": local_store(info, timeout)} if info.launcher == "local" else {"init_method": info.init_method}
        dist.init_process_group(group_backends(backend, cfg), rank=info.rank, world_size=info.world_size,
                                timeout=timeout, **meet, **kwargs)
    except dist.DistError as e:  # DistNetworkError (the port), DistStoreError (a timeout)
        raise rendezvous_error(e, info, netif.route_to(info.master_addr)) from e
    topo = Topology(info.rank, info.world_size, info.local_rank, train, reward, info.launcher, backend, device,
                    info.job_id, info.restart_count, reward_transport=transport)
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, (socket.gethostname(), str(device)))
    topo.hosts = [h for h, _ in everyone]
    topo.devices = [d for _, d in everyone]
    # Always a group of the train ranks (even of one): collectives such as DCP's must never
    # include the reward ranks, which are busy serving.
    train_group = dist.new_group(train, timeout=timeout)
    if reward and backend != "gloo":
        topo.host_group = dist.new_group(backend="gloo", timeout=timeout)
    if reward and transport == "nccl":
        topo.pair_groups = pair_groups(topo, timeout)
    mesh = DeviceMesh(device.type, torch.tensor(train))
    return topo, train_group, mesh


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
