"""DiffusionNFT's part of an iteration (hpcnft.algo.protocol): the rollout samples with the ODE
solver of rollout.solver and keeps each sample's final latent; the advantages, grouped by position
or prompt text (nft.group_by), become the optimality probability r; the trainer
(hpcnft.algo.nft.trainer) learns from the (sample, sigma) pairs of those latents; the old policy
follows theta by the EMA of [ema]."""
from __future__ import annotations

import torch

from hpcnft.algo.nft import formulas as nft
from hpcnft.algo.nft.pairs import PairBatch
from hpcnft.algo.nft.spec import SPEC
from hpcnft.algo.nft.trainer import Trainer
from hpcnft.algo.protocol import RolloutModels, Sampled


class NFT:
    spec = SPEC

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer: Trainer | None = None
        self.models: RolloutModels | None = None

    def make_trainer(self, policy, group, num_train_ranks: int) -> Trainer:
        self.trainer = Trainer(self.cfg, policy, group, num_train_ranks)
        return self.trainer

    def bind(self, models: RolloutModels) -> None:
        self.models = models

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair: v_old, and the trained forward and backward."""
        return flops.train_pair

    def begin_rollout(self, step: int, parts: list[list[int]]) -> None:
        if self.models.device.type == "cuda":  # the host draws the pairs' noise while the GPU samples
            self.trainer.noise.prefetch(step, [i for p in parts for i in p], self.models.latent_shape, pin=True)

    def sample(self, prompts: list[str], noise: torch.Tensor, step: int) -> Sampled:
        x0, cond = self.models.generate(prompts, self.models.sigmas, noise, self.cfg.rollout.solver)
        return Sampled(x0, cond, None)

    def train_batch(self, step: int, rollout, rewards: torch.Tensor, prompts: list[str], mine: range) -> PairBatch:
        cfg = self.cfg
        groups = prompts if cfg.nft.group_by == "prompt" else None  # else G consecutive samples a group
        adv = nft.advantages(rewards, cfg.rollout.samples_per_prompt, cfg.nft.std_estimator, groups)
        r = nft.optimality_r(adv, cfg.nft.adv_clip_max, cfg.nft.adv_mode)
        return PairBatch(rollout.x0, rollout.prompt_embeds, rollout.pooled, adv[mine.start:mine.stop], r[mine.start:mine.stop],
                         list(mine), cfg.samples_per_step * cfg.trained_steps)

    def old_policy_decay(self, step: int) -> float:
        e = self.cfg.ema
        return nft.ema_decay(step, e.ramp, e.max, e.flat_steps, e.flat_decay)

    def synthetic_batch(self, n: int, k: int, cond, latent_shape, device) -> PairBatch:
        x0 = torch.randn(n, *latent_shape, generator=torch.Generator().manual_seed(7)).to(device)
        adv = torch.randn(n, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        return PairBatch(x0, cond.prompt_embeds.to(device), cond.pooled.to(device), adv,
                         nft.optimality_r(adv, self.cfg.nft.adv_clip_max), list(range(n)), n * k)
