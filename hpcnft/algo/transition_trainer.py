"""The train step of the algorithms that train on their rollouts' recorded SDE transitions
(Flow-GRPO, MixGRPO): `updates_per_step` optimizer updates, each over its share of the samples
(sde_policy.update_of) and the transitions the batch holds (Flow-GRPO: the first K; MixGRPO: its
window). Per micro-batch of (sample, transition) pairs: the KL reference (frozen base, no grad)
where the algorithm's kl_beta > 0, the trained forward (CFG as the rollout's, its unconditional
half detached), the transition's log-probability under pi_theta, the clipped loss and backward;
then clipping and AdamW (hpcnft.algo.train_base). The algorithm's section gives noise_level,
clip_range, adv_clip_max, updates_per_step and (where it has one) kl_beta; its metrics are
named train/<prefix>_*."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcnft.algo import sde_policy as sde
from hpcnft.algo.sampler import Conditioning, guided_velocity
from hpcnft.algo.train_base import TrainerBase
from hpcnft.algo.virtual_shards import ShardGradients, shard_size, sum_over_shards
from hpcnft.perf.mfu import span


@dataclass
class SDEBatch:
    """What the train step keeps of a rank's rollout samples."""
    states: torch.Tensor  # [n, K + 1, C, h, w] the SDE states x_first .. x_first+K, float32
    old_log_probs: torch.Tensor  # [n, K] log pi_old of those K transitions, as the rollout recorded them
    prompt_embeds: torch.Tensor  # [n, L, D]
    pooled: torch.Tensor  # [n, D]
    neg_prompt_embeds: torch.Tensor | None  # [1, L, D] CFG's empty prompt (None: no CFG)
    neg_pooled: torch.Tensor | None  # [1, D]
    adv: torch.Tensor  # [n] float64, on the host
    sample_ids: list[int]  # global ids: which update each sample trains in
    n_global_samples: int  # the samples of the step over all train ranks
    # drop_zero_advantage: each update's samples of advantage not 0, over all train ranks
    # (None: every sample counts)
    kept_per_update: list[int] | None = None
    first: int = 0  # the sigma grid's index of states[:, 0]: the first trained transition (where K > 0)


def synthetic_batch(n: int, k: int, cond: Conditioning, latent_shape, device) -> SDEBatch:
    """A seeded batch of n samples with k recorded transitions each, on `device` (what `hpcnft
    bench` times the train step on): random states, log-probabilities near the rollout's,
    advantages, CFG's empty prompt where `cond` has one."""
    g = torch.Generator().manual_seed(7)
    states = torch.randn(n, k + 1, *latent_shape, generator=g).to(device)
    old = (torch.randn(n, k, generator=g) * 1e-3 - 1.0).to(device)
    adv = torch.randn(n, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    neg = None if cond.neg_prompt_embeds is None else (cond.neg_prompt_embeds[:1].to(device),
                                                       cond.neg_pooled[:1].to(device))
    return SDEBatch(states, old, cond.prompt_embeds.to(device), cond.pooled.to(device),
                    neg[0] if neg else None, neg[1] if neg else None, adv, list(range(n)), n)


@dataclass
class TransitionBatch:
    """One micro-batch's (sample, transition) pairs, on the train device."""
    pos: torch.Tensor  # local sample positions, on the host
    index: torch.Tensor  # the same, on the device of the batch's tensors
    sigma: torch.Tensor  # [m] float32
    sigma_next: torch.Tensor
    x: torch.Tensor  # the states before and after each transition
    x_next: torch.Tensor
    old_log_prob: torch.Tensor  # [m]
    adv: torch.Tensor  # [m] float64


class TransitionTrainer(TrainerBase):
    DEVICE_SUMS = ("loss", "kl", "approx_kl", "clipped", "ratio")
    HOST_SUMS = ("adv_abs", "pairs")

    def __init__(self, cfg, policy, train_group, num_train_ranks: int, settings, prefix: str):
        super().__init__(cfg, policy, train_group, num_train_ranks)
        self.settings, self.prefix = settings, prefix  # the algorithm's section; its metrics' prefix

    def inputs(self, batch: SDEBatch, sigmas: torch.Tensor, mb: list[tuple[int, int]]) -> TransitionBatch:
        """One micro-batch's pairs, `mb` as (local sample position, transition index in the batch)."""
        dev = self.policy.device
        pos, steps = torch.tensor([p for p, _ in mb]), torch.tensor([j for _, j in mb])
        index, at = pos.to(batch.states.device), steps.to(batch.states.device)
        grid = steps + batch.first
        return TransitionBatch(pos, index, sigmas[grid].to(dev), sigmas[grid + 1].to(dev),
                               batch.states[index, at].to(dev), batch.states[index, at + 1].to(dev),
                               batch.old_log_probs[index, at].to(dev), batch.adv[pos].to(dev))

    def log_prob(self, batch: SDEBatch, m: TransitionBatch):
        """The live policy's (log-probability [m], transition mean, std_dev_t) of each pair's transition."""
        dev, n = self.policy.device, len(m.pos)
        cond = Conditioning(batch.prompt_embeds[m.index].to(dev), batch.pooled[m.index].to(dev))
        if batch.neg_prompt_embeds is not None:
            cond.neg_prompt_embeds = batch.neg_prompt_embeds.to(dev).expand(n, -1, -1)
            cond.neg_pooled = batch.neg_pooled.to(dev).expand(n, -1)
        r = self.cfg.rollout
        v = guided_velocity(self.policy.transformer, m.x, m.sigma, cond, r.guidance_scale, self.policy.compute_dtype,
                            self.policy.autocast, r.integer_timesteps, detach_uncond=True)
        _, log_prob, mean, std = sde.sde_step(m.x, v, m.sigma, m.sigma_next, self.sigma_max,
                                              self.settings.noise_level, prev_sample=m.x_next)
        return log_prob, mean, std

    def step(self, batch: SDEBatch, sigmas: torch.Tensor, step: int) -> dict[str, float]:
        """The step's updates over this rank's samples; returns the step's metrics (all ranks)."""
        cfg, g = self.cfg, self.settings
        self.sigma_max = sigmas[1].item()  # as the rollout's SDE
        k = batch.old_log_probs.shape[1]  # the transitions each sample trains
        update = sde.update_of(batch.sample_ids, g.updates_per_step, cfg.train.seed, step)
        kept = batch.kept_per_update or [batch.n_global_samples // g.updates_per_step] * g.updates_per_step
        # this rank's samples by virtual shard (determinism.layout_invariant), or all in one group
        invariant = cfg.determinism.layout_invariant
        per_shard = shard_size(cfg.samples_per_step, cfg.determinism.virtual_shards)
        shard_of = [sid // per_shard for sid in batch.sample_ids] if invariant else [0] * len(batch.sample_ids)
        shards = sorted(set(shard_of))
        dev_sums = {s: torch.zeros(len(self.DEVICE_SUMS), dtype=torch.float64, device=self.policy.device)
                    for s in shards}
        host_sums = {s: torch.zeros(len(self.HOST_SUMS), dtype=torch.float64) for s in shards}
        norms, skipped, scale = [], 0, self.scaler.scale
        for u in range(g.updates_per_step):
            if not kept[u] or not k:  # nothing to train (no advantage, no transition): every rank leaves it out
                skipped += 1
                continue
            # the gradient of the mean over the update's pairs on all ranks: FSDP averages over the
            # ranks, the shards' sum (layout_invariant) does not
            loss_norm = (1 if invariant else self.num_train_ranks) / (kept[u] * k)
            bank = ShardGradients(self.policy.trainable, self.group) if invariant else None
            self.optimizer.zero_grad(set_to_none=True)
            scale = self.scaler.scale
            for s in shards:
                pairs = [(p, j) for p in range(len(update)) if update[p] == u and shard_of[p] == s for j in range(k)]
                with span("train/inputs"):
                    mbs = [self.inputs(batch, sigmas, mb) for mb in self.micro_batches(pairs, cfg.train.micro_batch)]
                for m in mbs:
                    with span("train/micro_batch"):
                        dev_part, host_part = self.micro_batch(batch, m, loss_norm, scale)
                    dev_sums[s] += dev_part
                    host_sums[s] += host_part
                if bank is not None:
                    bank.take()
            if bank is not None:  # the update's gradient: every shard's, summed in shard order
                bank.sum_into_grads(self.comm_device())
            with span("train/optimizer"):
                norm, skip = self._optimizer_step((step - 1) * g.updates_per_step + u + 1)
            norms.append(norm)
            skipped += skip
        rows = torch.stack([torch.cat([dev_sums[s].cpu(), host_sums[s]]) for s in shards])
        if invariant:  # the step's metric sums: every shard's, in shard order
            total = sum_over_shards(rows, self.group, self.comm_device()).cpu()
        else:
            total = rows[0]
            if self.group is not None:
                total = total.to(self.comm_device())
                dist.all_reduce(total, group=self.group)
        return self._metrics(dict(zip(self.DEVICE_SUMS + self.HOST_SUMS, total.tolist())), norms, skipped, scale, k)

    def micro_batch(self, batch: SDEBatch, m: TransitionBatch, loss_norm: float, scale: float):
        """KL reference, trained forward, loss and backward of one micro-batch (gradients
        accumulate); returns its metric sums (DEVICE_SUMS on the device, HOST_SUMS on the host)."""
        g = self.settings
        kl_beta = getattr(g, "kl_beta", 0.0)
        mean_ref = None
        if kl_beta > 0:
            with torch.no_grad(), self.policy.base_weights():
                _, mean_ref, _ = self.log_prob(batch, m)
        log_prob, mean, std = self.log_prob(batch, m)
        loss, ratio = sde.clipped_loss(log_prob, m.old_log_prob, m.adv, g.clip_range, g.adv_clip_max)
        kl = torch.zeros_like(loss)
        total = loss
        if mean_ref is not None:
            kl = sde.kl_to_reference(mean, mean_ref, std)
            total = loss + kl_beta * kl
        weight = None
        if batch.kept_per_update is not None:  # the pairs of advantage 0 out of the loss and the metrics
            weight = (m.adv != 0).to(total.dtype)
            total = total * weight
        (total.sum() * loss_norm * scale).backward()
        with torch.no_grad():
            drift = log_prob.detach() - m.old_log_prob
            parts = [loss.detach(), kl.detach(), 0.5 * drift ** 2, ((ratio.detach() - 1.0).abs() > g.clip_range),
                     ratio.detach()]
            if weight is not None:
                parts = [t * weight for t in parts]
            dev = torch.stack([t.double().sum() for t in parts])
        a = batch.adv[m.pos]
        pairs = float(len(m.pos)) if weight is None else float((a != 0).sum())
        return dev, torch.tensor([a.abs().sum().item(), pairs], dtype=torch.float64)

    def _metrics(self, s: dict[str, float], norms: list[float], skipped: int, scale: float,
                 k: int) -> dict[str, float]:
        n, p = s["pairs"] or 1.0, f"train/{self.prefix}"  # no pair kept (drop_zero_advantage): the sums are 0
        out = {
            f"{p}_loss": s["loss"] / n,
            f"{p}_approx_kl": s["approx_kl"] / n,
            f"{p}_clipfrac": s["clipped"] / n,
            f"{p}_ratio_mean": s["ratio"] / n,
            "train/adv_abs_mean": s["adv_abs"] / n,
            f"{p}_num_timesteps": float(k),
            "train/grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/loss_scale": scale,
            "train/step_skipped": float(skipped),
        }
        if getattr(self.settings, "kl_beta", 0.0) > 0:
            out["train/kl_loss"] = s["kl"] / n
        return out
