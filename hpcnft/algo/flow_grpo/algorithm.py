"""Flow-GRPO's part of an iteration (hpcnft.algo.protocol): the rollout samples with the SDE
(hpcnft.algo.flow_grpo.sampler) and keeps each sample's first K + 1 states and the
log-probabilities of its first K transitions, and CFG's empty-prompt conditioning; the advantages
are per prompt text (formulas.group_advantages; over the step's batch with one sample per prompt,
as the authors' train_sd3.py) and go to the clipped objective as they are (those of exactly 0 left
out under grpo.drop_zero_advantage); the
trainer (hpcnft.algo.flow_grpo.trainer) makes grpo.updates_per_step updates; and the rollout
policy is theta itself: pi_old is set to theta after every step (decay 0), so the rollout, the
evaluation of pi_old and `hpcnft export --policy old` see theta."""
from __future__ import annotations

import torch

from hpcnft.algo.flow_grpo import formulas as grpo
from hpcnft.algo.flow_grpo.sampler import SDE_NOISE, sde_sample
from hpcnft.algo.flow_grpo.spec import SPEC
from hpcnft.algo.flow_grpo.trainer import GRPOBatch, GRPOTrainer
from hpcnft.algo.protocol import RolloutModels, Sampled
from hpcnft.algo.sampler import NoiseAhead
from hpcnft.algo.transition_trainer import synthetic_batch


class FlowGRPO:
    spec = SPEC

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer: GRPOTrainer | None = None
        self.models: RolloutModels | None = None
        self.noise_ahead = NoiseAhead()
        self._sde_noise: list = []  # the transitions' noise of the rollout's chunks still to sample (futures)

    def make_trainer(self, policy, group, num_train_ranks: int) -> GRPOTrainer:
        self.trainer = GRPOTrainer(self.cfg, policy, group, num_train_ranks)
        return self.trainer

    def bind(self, models: RolloutModels) -> None:
        self.models = models

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair: the trained forward and backward (both CFG halves),
        and the KL reference's forward."""
        passes = 2 if self.cfg.rollout.guidance_scale > 1.0 else 1
        fwd_bwd = flops.train_pair - flops.rollout_forward
        return passes * (fwd_bwd + (flops.rollout_forward if self.cfg.grpo.kl_beta > 0 else 0.0))

    def begin_rollout(self, step: int, parts: list[list[int]]) -> None:
        """Every chunk's transition noise, drawn on the host by a worker thread while the GPU samples."""
        shape = (self.cfg.rollout.num_steps, *self.models.latent_shape)
        self._sde_noise = self.noise_ahead.draw(shape, self.cfg.rollout.seed, step, parts, SDE_NOISE,
                                                pin=self.models.device.type == "cuda")

    def sample(self, prompts: list[str], noise: torch.Tensor, step: int) -> Sampled:
        """The chunk's final latents and conditioning, and (states, log-probabilities, CFG's
        empty-prompt conditioning or None)."""
        cfg, m = self.cfg, self.models
        policy, dev = m.policy, m.device
        cond = m.encoder(prompts)
        sde = self._sde_noise.pop(0).result()
        k = cfg.trained_steps
        x0, states, log_probs = sde_sample(policy.transformer, noise.to(dev, non_blocking=noise.is_pinned()),
                                           sde.to(dev, non_blocking=sde.is_pinned()), m.sigmas, cond,
                                           cfg.rollout.guidance_scale, policy.compute_dtype, policy.autocast,
                                           cfg.grpo.noise_level, k)
        neg = None if cond.neg_prompt_embeds is None else (cond.neg_prompt_embeds[:1], cond.neg_pooled[:1])
        return Sampled(x0, cond, (states, log_probs[:, :k], neg))

    def train_batch(self, step: int, rollout, rewards: torch.Tensor, prompts: list[str], mine: range) -> GRPOBatch:
        cfg, g = self.cfg, self.cfg.grpo
        if cfg.rollout.samples_per_prompt == 1:  # no group to compare with: the step's batch is the group
            adv = grpo.batch_advantages(rewards)
        else:
            adv = grpo.group_advantages(rewards, prompts, g.global_std)
        kept = grpo.kept_per_update(adv, g.updates_per_step, cfg.train.seed, step) if g.drop_zero_advantage else None
        neg = rollout.kept[0][2]
        return GRPOBatch(torch.cat([k[0] for k in rollout.kept]), torch.cat([k[1] for k in rollout.kept]),
                         rollout.prompt_embeds, rollout.pooled, neg[0] if neg else None, neg[1] if neg else None,
                         adv[mine.start:mine.stop], list(mine), cfg.samples_per_step, kept)

    def old_policy_decay(self, step: int) -> float:
        return 0.0

    def synthetic_batch(self, n: int, k: int, cond, latent_shape, device) -> GRPOBatch:
        return synthetic_batch(n, k, cond, latent_shape, device)
