"""What the iteration engine (hpcnft.algo.iteration's Learner) asks of an RL algorithm, and what it
hands it. The engine runs the rollout's chunks, decoding, rewards and their gather, the old
policy's EMA and the evaluation; the algorithm says how a chunk is sampled and what is kept of
it, the advantages, the training step and its metrics. The engine calls the algorithm; the
algorithm never calls the engine back: what it samples with is handed over once (bind)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from hpcnft.algo.policy import Policy
from hpcnft.algo.sampler import Conditioning, PromptEncoder
from hpcnft.algo.solvers import sample
from hpcnft.algo.spec import AlgorithmSpec
from hpcnft.algo.train_base import TrainerBase


@dataclass
class RolloutModels:
    """What a train rank samples with: the policy, the prompt encoder, the rollout's sigma grid,
    the latents' shape and the rollout's settings."""
    policy: Policy
    encoder: PromptEncoder
    sigmas: torch.Tensor
    latent_shape: tuple[int, ...]
    device: torch.device
    guidance_scale: float
    integer_timesteps: bool

    def generate(self, prompts: list[str], sigmas: torch.Tensor, noise: torch.Tensor,
                 solver: str) -> tuple[torch.Tensor, Conditioning]:
        """The final latents of the ODE solver `solver` from `noise`, and the prompts' conditioning."""
        cond = self.encoder(prompts)
        noise = noise.to(self.device, non_blocking=noise.is_pinned())
        x0 = sample(solver, self.policy.transformer, noise, sigmas, cond, self.guidance_scale,
                    self.policy.compute_dtype, self.policy.autocast, self.integer_timesteps)
        return x0, cond


class Sampled(NamedTuple):
    x0: torch.Tensor  # the chunk's final latents
    cond: Conditioning  # its prompts' conditioning
    kept: Any  # what the train step needs beside them (None: nothing)


class RolloutLike(Protocol):
    """The part of the engine's rollout (hpcnft.algo.iteration.Rollout) a train batch is made of."""
    x0: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    kept: list


class Algorithm(Protocol):
    spec: AlgorithmSpec
    trainer: TrainerBase  # made by make_trainer; the checkpoints keep its optimizer and scaler

    def make_trainer(self, policy: Policy, group, num_train_ranks: int) -> TrainerBase: ...

    def bind(self, models: RolloutModels) -> None:
        """What the rollout samples with, before the first begin_rollout."""

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair (hpcnft.algo.flops.DitFlops), for perf/mfu_train."""

    def begin_rollout(self, step: int, parts: list[list[int]]) -> None:
        """The rollout of `step` begins; `parts` are its chunks' global sample ids on this rank."""

    def sample(self, prompts: list[str], noise: torch.Tensor, step: int) -> Sampled:
        """One chunk of the rollout (the chunks come in begin_rollout's order)."""

    def train_batch(self, step: int, rollout: RolloutLike, rewards: torch.Tensor, prompts: list[str],
                    mine: range) -> Any:
        """The trainer's batch: `rewards` and `prompts` are every train rank's samples', in global
        order; `mine` the global ids of this rank's."""

    def old_policy_decay(self, step: int) -> float:
        """The decay of pi_old's EMA after `step` (0: pi_old becomes theta)."""

    def synthetic_batch(self, n: int, k: int, cond: Conditioning, latent_shape: tuple[int, ...],
                        device: torch.device) -> Any:
        """A seeded train batch of n samples trained at k sampler steps each, on `device`, with
        the conditioning `cond` (CFG's empty prompt where the rollout guides so): what
        `hpcnft bench` times a train step on."""
