"""One NFT optimizer step of the policy: the pairs' inputs, v_old (and the KL reference) in
no-grad passes, the trained forward, loss and backward per micro-batch, AdamW with gradient
clipping, and a loss scaler for fp16 (hpcnft.algo.train_base)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcnft.algo.nft import formulas as nft
from hpcnft.algo.nft.pairs import MicroBatch, PairBatch, PairNoise, train_sigma_pairs
from hpcnft.algo.policy import Policy
from hpcnft.algo.root_config import Config
from hpcnft.algo.train_base import TrainerBase
from hpcnft.algo.virtual_shards import ShardGradients, pair_slices, shard_size
from hpcnft.perf import levers
from hpcnft.perf.mfu import span


class Trainer(TrainerBase):
    # Sums of the step's metrics: those of device tensors are kept on the device (no sync per
    # micro-batch), those of host tensors on the host.
    DEVICE_SUMS = ("loss", "pos", "neg", "r", "t", "kl")
    HOST_SUMS = ("adv", "adv_abs", "pairs")

    def __init__(self, cfg: Config, policy: Policy, train_group, num_train_ranks: int):
        super().__init__(cfg, policy, train_group, num_train_ranks)
        self.noise = PairNoise(cfg)

    # -- the pieces of a step (public: the bench measures them one at a time) ------------------
    def inputs(self, batch: PairBatch, sigmas: torch.Tensor, mb: list[tuple[int, int]], eps: torch.Tensor) -> MicroBatch:
        """One micro-batch's pairs, `mb` as (local sample position, sigma index), on the train device."""
        dev = self.policy.device
        pos = torch.tensor([p for p, _ in mb])
        index = pos.to(batch.x0.device)
        sig = sigmas[torch.tensor([j for _, j in mb])].to(dev)
        x0 = batch.x0[index].to(dev)
        x_sigma = nft.corrupt(x0, sig, eps.to(dev, non_blocking=eps.is_pinned()))
        return MicroBatch(pos, index, sig, x0, x_sigma, batch.r[pos].to(dev))

    def forward(self, x_sigma, sig, batch: PairBatch, index: torch.Tensor):
        """The live policy's velocity at the pairs whose samples `index` (on the rollout tensors'
        device) names."""
        from hpcnft.algo.sampler import velocity

        dev = self.policy.device
        with self.policy.autocast():
            # the guidance a guidance-distilled DiT embeds is the rollout's in the NFT passes too
            return velocity(self.policy.transformer, x_sigma, sig, batch.prompt_embeds[index].to(dev),
                            batch.pooled[index].to(dev), self.policy.compute_dtype,
                            guidance=self.cfg.rollout.guidance_scale)

    def step(self, batch: PairBatch, sigmas: torch.Tensor, step: int) -> dict[str, float]:
        """One optimizer step over this rank's pairs; returns the step's metrics (all ranks)."""
        cfg, policy = self.cfg, self.policy
        pairs = train_sigma_pairs(cfg, batch.sample_ids, step)
        invariant = cfg.determinism.layout_invariant
        with span("train/inputs"):
            eps = self.noise.take(step, batch.sample_ids, pairs, tuple(batch.x0.shape[1:]))
            # micro-batches of the rank's pairs; under determinism.layout_invariant, of each
            # virtual shard's pairs (sample-major: a shard's pairs are a slice of `pairs`)
            per_shard = shard_size(cfg.samples_per_step, cfg.determinism.virtual_shards)
            groups = pair_slices(pairs, batch.sample_ids, per_shard) if invariant else [(0, len(pairs))]
            size = cfg.train.micro_batch
            shards = [[self.inputs(batch, sigmas, pairs[i:min(i + size, hi)], eps[i:min(i + size, hi)])
                       for i in range(lo, hi, size)] for lo, hi in groups]
        self.optimizer.zero_grad(set_to_none=True)
        bank = ShardGradients(policy.trainable, self.group) if invariant else None
        # Gradient of the global mean over all pairs: FSDP averages over the train ranks, the
        # shards' sum (layout_invariant) does not.
        loss_norm = (1 if invariant else self.num_train_ranks) / batch.n_global_pairs
        used_scale = self.scaler.scale
        total = torch.zeros(len(self.DEVICE_SUMS) + len(self.HOST_SUMS), dtype=torch.float64)
        for mbs in shards:
            sums = self.train_pairs(batch, mbs, loss_norm, used_scale)
            if bank is not None:
                bank.take(sums)
            else:
                total += sums
        if bank is not None:
            total = bank.sum_into_grads(self.comm_device())
        with span("train/optimizer"):
            grad_norm, skipped = self._optimizer_step(step)  # one optimizer step a step
        if self.group is not None and bank is None:
            total = total.to(self.comm_device())
            dist.all_reduce(total, group=self.group)
        return self._metrics(dict(zip(self.DEVICE_SUMS + self.HOST_SUMS, total.tolist())), grad_norm, skipped,
                             used_scale)

    def train_pairs(self, batch: PairBatch, mbs: list[MicroBatch], loss_norm: float, scale: float) -> torch.Tensor:
        """v_old (and the KL reference) of the micro-batches, then each one's forward, loss and
        backward (gradients accumulate); their metric sums (DEVICE_SUMS + HOST_SUMS), on the host."""
        cfg, policy = self.cfg, self.policy
        # v_old (and the KL reference) for every micro-batch first, in the same composition as the
        # trained forward: with pi_old == pi_theta and no lever that changes the no-grad passes'
        # rounding, the two branches then agree bit for bit.
        with span("train/old_pass"), torch.no_grad(), policy.v_old_weights():
            if cfg.perf.old_pass_batch > 0:  # one batched no-grad pass over all pairs
                v_old = levers.old_velocities(self.forward, cfg.perf.old_pass_batch, batch, mbs)
            else:
                v_old = [self.forward(m.x_sigma, m.sigma, batch, m.index) for m in mbs]
        v_ref = None
        if cfg.nft.kl_beta > 0:
            with torch.no_grad(), policy.base_weights():
                v_ref = [self.forward(m.x_sigma, m.sigma, batch, m.index) for m in mbs]
        dev_sums = torch.zeros(len(self.DEVICE_SUMS), dtype=torch.float64, device=policy.device)
        host_sums = torch.zeros(len(self.HOST_SUMS), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            with span("train/micro_batch"):
                dev_part, host_part = self.micro_batch(batch, mb, v_old[i], v_ref[i] if v_ref else None,
                                                        loss_norm, scale)
            dev_sums += dev_part
            host_sums += host_part
        return torch.cat([dev_sums.cpu(), host_sums])

    def micro_batch(self, batch: PairBatch, mb: MicroBatch, v_old: torch.Tensor, v_ref, loss_norm: float,
                     scale: float):
        """Forward, NFT loss and backward of one micro-batch (gradients accumulate); returns its
        metric sums (DEVICE_SUMS on the device, HOST_SUMS on the host)."""
        cfg = self.cfg
        pos, sig, x0, x_sigma, r = mb.pos, mb.sigma, mb.x0, mb.x_sigma, mb.r
        v_theta = self.forward(x_sigma, sig, batch, mb.index)
        v_pos, v_neg = nft.implicit_policies(v_theta.float(), v_old.float(), cfg.nft.beta)
        l_pos = nft.branch_loss(x_sigma, x0, sig, v_pos, cfg.nft.adaptive_weight)
        l_neg = nft.branch_loss(x_sigma, x0, sig, v_neg, cfg.nft.adaptive_weight)
        per_pair = nft.pair_loss(l_pos, l_neg, r, cfg.nft.adv_clip_max, cfg.nft.beta)
        total = per_pair
        kl = torch.zeros_like(per_pair)
        if v_ref is not None:
            kl = nft.kl_to_reference(v_theta, v_ref)
            total = per_pair + cfg.nft.kl_beta * kl
        (total.sum() * loss_norm * scale).backward()
        a = batch.adv[pos]
        dev = torch.stack([per_pair.detach().double().sum(), l_pos.detach().double().sum(),
                           l_neg.detach().double().sum(), r.double().sum(), sig.double().sum(),
                           kl.detach().double().sum()])
        host = torch.tensor([a.sum().item(), a.abs().sum().item(), float(len(pos))], dtype=torch.float64)
        return dev, host

    def _metrics(self, s: dict[str, float], grad_norm: float, skipped: bool, scale: float) -> dict[str, float]:
        n = s["pairs"]
        k = self.cfg.trained_steps
        out = {
            "train/nft_loss": s["loss"] / n * k,
            "train/nft_loss_per_pair": s["loss"] / n,
            "train/nft_pos_loss": s["pos"] / n,
            "train/nft_neg_loss": s["neg"] / n,
            "train/nft_r_mean": s["r"] / n,
            "train/nft_adv_mean": s["adv"] / n,
            "train/adv_abs_mean": s["adv_abs"] / n,
            "train/nft_t_mean": s["t"] / n,
            "train/nft_num_timesteps": float(k),
            "train/grad_norm": grad_norm,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/loss_scale": scale,
            "train/step_skipped": float(skipped),
        }
        if self.cfg.nft.kl_beta > 0:
            out["train/kl_loss"] = s["kl"] / n
        return out
