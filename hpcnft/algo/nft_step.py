"""DiffusionNFT's part of an iteration; hpcnft.algo.iteration's Learner runs the rest (the rollout's
chunks, decoding and rewards, the gather, the EMA update, the evaluation). What is NFT's: the
rollout samples with the ODE solver of rollout.solver and keeps each sample's final latent; the
advantages, grouped by position or prompt text (nft.group_by), become the optimality probability
r; the trainer (hpcnft.algo.trainer) learns from the (sample, sigma) pairs of those latents; the
old policy follows theta by the EMA of [ema]."""
from __future__ import annotations

import torch

from hpcnft.algo import nft
from hpcnft.algo.pairs import PairBatch
from hpcnft.algo.trainer import Trainer


class NFTStep:
    name = "nft"
    metric_keys: list[str] = []  # run.h5 keys beyond hpcnft.io.runfile.ALL_KEYS (which hold NFT's)

    def __init__(self, cfg):
        self.cfg = cfg

    def make_trainer(self, policy, group, num_train_ranks: int) -> Trainer:
        return Trainer(self.cfg, policy, group, num_train_ranks)

    def trained_steps(self) -> int:
        return nft.num_trained_sigmas(self.cfg.rollout.num_steps, self.cfg.nft.timestep_fraction)

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair: v_old, and the trained forward and backward."""
        return flops.train_pair

    def begin_rollout(self, learner, step: int, parts: list[list[int]]) -> None:
        if learner.topo.device.type == "cuda":  # the host draws the pairs' noise while the GPU samples
            learner.trainer.noise.prefetch(step, [i for p in parts for i in p], learner.latent_shape, pin=True)

    def sample(self, learner, prompts: list[str], noise: torch.Tensor, chunk: list[int], step: int):
        """(final latents, conditioning, what the train step keeps beside them: nothing)."""
        x0, cond = learner.generate(prompts, learner.sigmas, noise, self.cfg.rollout.solver)
        return x0, cond, None

    def group_keys(self, learner, step: int) -> list[str] | None:
        """Each of the step's samples' prompt text under nft.group_by="prompt" (the advantages then
        group by text); None groups by position."""
        if self.cfg.nft.group_by != "prompt":
            return None
        return learner.step_prompts(step)

    def train_batch(self, learner, step: int, ro, rewards: torch.Tensor, mine: range) -> PairBatch:
        cfg = self.cfg
        adv = nft.advantages(rewards, cfg.rollout.samples_per_prompt, cfg.nft.std_estimator,
                             self.group_keys(learner, step))
        r = nft.optimality_r(adv, cfg.nft.adv_clip_max, cfg.nft.adv_mode)
        return PairBatch(ro.x0, ro.prompt_embeds, ro.pooled, adv[mine.start:mine.stop], r[mine.start:mine.stop],
                         list(mine), cfg.samples_per_step * self.trained_steps())

    def old_policy_decay(self, step: int) -> float:
        e = self.cfg.ema
        return nft.ema_decay(step, e.ramp, e.max, e.flat_steps, e.flat_decay)
