"""The sections of the job's processes: `[layout]` (ranks, backend, device: hpcnft.distributed.groups)
and `[preempt]` (hpcnft.distributed.preempt), and the layout's checks against the world size."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting
from hpcnft.common.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")  # auto: nccl on GPUs, gloo on CPUs (groups.resolve_backend)
DEVICES = ("auto", "cpu", "cuda")  # auto: cuda where a GPU is (groups.pick_device)
MAX_TIMEOUT_S = 86400.0  # collectives wait at most a day
STAGGER = ("auto", "always", "never")
TRANSPORTS = ("auto", "gloo", "nccl")  # the reward traffic's images (groups.resolve_transport)


@dataclass
class LayoutConfig:
    train_ranks: int = setting(2, "train ranks the local spawner starts (under a launcher the world size decides)",
                               bound="> 0", on_resume="free")
    reward_ranks: int = setting(1, "reward ranks; 0: the reward is scored in the training process (colocated)",
                                bound=">= 0", on_resume="free")
    backend: str = setting("auto", "the collective backend: `auto` (nccl on GPUs, gloo on CPUs), `gloo` or `nccl`",
                           choices=BACKENDS)
    device: str = setting("auto", "where the ranks compute: `auto` (a GPU where there is one), `cpu` or `cuda`",
                          choices=DEVICES)
    timeout_s: float = setting(600.0, "seconds collectives and reward traffic wait", bound="> 0",
                               at_most=MAX_TIMEOUT_S, on_resume="free")
    emulate_hosts: bool = setting(
        False, "several NCCL ranks on one GPU, each claiming a host of its own (NCCL_HOSTID) so that NCCL accepts "
        "them: to try a layout's code paths on one GPU, for correctness, not speed (the ranks then talk over sockets)",
        on_resume="free")
    stagger_loads: str = setting(
        "auto", "the train ranks of one host load the base transformer one at a time (it sits in host memory until it "
        "moves: FLUX.1-dev's is 22 GiB in a LoRA run's bf16, 44 GiB in a full fine-tune's fp32): `auto` where all at "
        "once would take over 80 % of the memory available as they start, `always`, `never`", choices=STAGGER, on_resume="free")
    reward_transport: str = setting(
        "auto", "how the images reach the reward ranks: `gloo` (copied to the host, sent over gloo), `nccl` (from "
        "device to device on a communicator per train/reward pair; an NCCL job only), `auto` (gloo: "
        "docs/architecture.md says why); the requests, scores and messages travel over gloo either way",
        choices=TRANSPORTS, on_resume="free")

    def check(self) -> None:
        if self.emulate_hosts and (self.backend == "gloo" or self.device == "cpu"):
            raise ConfigError("layout.emulate_hosts: lets NCCL ranks share a GPU; it cannot apply with "
                              f"layout.backend={self.backend!r}, layout.device={self.device!r}")
        if self.reward_transport == "nccl" and (self.backend == "gloo" or self.device == "cpu"):
            raise ConfigError("layout.reward_transport: 'nccl' sends the images between GPUs; it cannot apply with "
                              f"layout.backend={self.backend!r}, layout.device={self.device!r}")


@dataclass
class PreemptConfig:
    signal: str = setting("SIGUSR2", "the signal that checkpoints and stops the run (`#SBATCH --signal=USR2@120`)",
                          on_resume="free")
    handle_sigterm: bool = setting(True, "SIGTERM checkpoints and stops the run too", on_resume="free")
    requeue: bool = setting(True, "under Slurm, rank 0 runs `scontrol requeue $SLURM_JOB_ID` after a preemption "
                                  "checkpoint", on_resume="free")


def local_world_size(cfg) -> int:
    """The ranks the local spawner starts: the layout's train and reward ranks; one process when
    a single train rank scores its own samples (colocated)."""
    layout = cfg.layout
    return 1 if layout.reward_ranks == 0 and layout.train_ranks == 1 else layout.train_ranks + layout.reward_ranks


def check_layout(cfg, world_size: int) -> None:
    """The checks that need the config (its layout and samples per step) and the world size only,
    made once before any rank loads a model (in the spawner, or by the ranks of a launcher, which
    every rank fails alike)."""
    reward_ranks = cfg.layout.reward_ranks if world_size > 1 else 0
    if reward_ranks >= world_size:
        raise ConfigError(f"layout.reward_ranks: {reward_ranks} leaves no train rank in a world of {world_size}")
    train_ranks = world_size - reward_ranks
    if cfg.samples_per_step % train_ranks:
        raise ConfigError(f"rollout: {cfg.samples_per_step} samples per step do not split evenly over "
                          f"{train_ranks} train ranks (prompts_per_step x samples_per_prompt must be a multiple "
                          f"of the train ranks)")
    shards = cfg.determinism.virtual_shards
    if cfg.determinism.layout_invariant and shards % train_ranks:
        raise ConfigError(f"determinism.virtual_shards: {shards} shards do not split evenly over {train_ranks} "
                          f"train ranks (layout_invariant: the train ranks must divide the shards)")
    parts = cfg.rank_sample_parts  # Flow-GRPO's updates: each train rank takes part in every one alike
    if (cfg.samples_per_step // train_ranks) % parts:
        raise ConfigError(f"grpo.updates_per_step: the {cfg.samples_per_step // train_ranks} samples of each of "
                          f"{train_ranks} train ranks do not split into {parts} equal updates")
