"""The trained DiT: LoRA (peft) or full fine-tune under FSDP2, the old policy as an EMA shadow,
AdamW, gradient clipping, a loss scaler for fp16, and one NFT optimizer step.

The old policy pi_old is a shadow copy of the trainable parameters. It is swapped into the live
parameters (no gradient) to sample rollouts and to compute v_old, as miles' `--ref-mode ema`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpcnft.perf import levers
from hpcnft.algo import nft
from hpcnft.common.config import Config
from hpcnft.common.determinism import stable_hash
from hpcnft.dist.groups import collective_device
from hpcnft.perf.mfu import span

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2 holds them as DTensors)."""
    return p.to_local() if isinstance(p, DTensor) else p


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rules (init S, x0.5 on overflow, x2
    after 2000 clean steps). The overflow decision comes from the global grad norm, which is
    the same on every rank of the FSDP mesh, so all ranks skip or step together."""

    def __init__(self, init_scale: float, enabled: bool, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= 0.5
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= 2.0
                self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


@dataclass
class PairBatch:
    """The pairs (sample, sigma) this rank trains on in one step, sample-major."""
    x0: torch.Tensor  # [n_samples, C, H, W] float32
    prompt_embeds: torch.Tensor  # [n_samples, L, D]
    pooled: torch.Tensor  # [n_samples, D]
    adv: torch.Tensor  # [n_samples] float64
    r: torch.Tensor  # [n_samples] float64
    sample_ids: list[int]  # global ids (stable across layouts) used to seed sigma order and noise
    n_global_pairs: int  # pairs of the whole optimizer step over all train ranks


@dataclass
class MicroBatch:
    """One micro-batch's pairs, ready on the train device before any forward runs: every tensor
    a forward or the loss reads is made here, so the step copies nothing host-to-device (each such
    copy would wait for the GPU to drain) between micro-batches."""
    pos: torch.Tensor  # local sample positions, on the host (host metric sums)
    index: torch.Tensor  # the same, on the device of the rollout tensors (their gathers)
    sigma: torch.Tensor  # [m] float32, train device
    x0: torch.Tensor
    x_sigma: torch.Tensor
    r: torch.Tensor  # [m] float64, train device


def add_lora(transformer: torch.nn.Module, cfg: Config) -> None:
    """peft LoRA on the configured projections, 'gaussian' init (B = 0: the step-0 model is the
    base), trained weights in fp32."""
    from peft import LoraConfig

    t = cfg.train
    lora = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, init_lora_weights="gaussian",
                      target_modules=list(t.lora_targets))
    # peft draws the LoRA A init from the global RNG: seed it from the config, then put the
    # global state back so nothing else depends on this draw.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_hash("lora_init", t.seed))
        transformer.add_adapter(lora)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


class Policy:
    def __init__(self, cfg: Config, transformer: torch.nn.Module, device: torch.device, mesh):
        self.cfg, self.device = cfg, device
        self.compute_dtype = AUTOCAST_DTYPES.get(cfg.train.precision, torch.float32)
        self.transformer = transformer
        self._prepare(mesh)
        levers.prepare_policy(self)  # perf levers applied at construction (regional compile)
        self.trainable = [p for p in self.transformer.parameters() if p.requires_grad]
        self.trainable_names = [n for n, p in self.transformer.named_parameters() if p.requires_grad]
        self.shadow = [_local(p).detach().clone() for p in self.trainable]

    def _prepare(self, mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        cfg, tr = self.cfg.train, self.transformer
        if cfg.finetune == "lora":
            add_lora(self.transformer, self.cfg)
        else:
            tr.requires_grad_(True)
        # Frozen base weights live in the compute dtype; trained weights stay fp32 (master).
        if self.compute_dtype != torch.float32:
            for p in tr.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(self.compute_dtype)
            # Under autocast the LoRA matmuls run in the compute dtype whatever the input's dtype:
            # peft's cast of each activation to the fp32 master dtype would only add an exact
            # round-trip copy (forward and backward) per LoRA linear.
            for layer in levers.lora_layers(tr):
                layer.cast_input_dtype_enabled = False
        if cfg.grad_checkpointing:
            tr.enable_gradient_checkpointing()
        tr.to(self.device)
        if not levers.use_fsdp(self.cfg, mesh):  # perf.skip_single_rank_fsdp on a one-rank mesh
            return
        # FSDP2 wants one dtype per parameter group: with a half-precision base, each LoRA linear
        # (fp32) gets its own group. Fewer groups mean fewer collectives, so only then.
        if cfg.finetune == "lora" and self.compute_dtype != torch.float32:
            for module in tr.modules():
                if isinstance(module, torch.nn.Linear) and any(p.requires_grad for p in module.parameters(False)):
                    fully_shard(module, mesh=mesh)
        for block in tr.transformer_blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(tr, mesh=mesh)

    # -- old policy ----------------------------------------------------------------------
    @contextlib.contextmanager
    def old_weights(self, fp8_gemms: str | None = None):
        """Temporarily put pi_old's weights into the live parameters. With `fp8_gemms` (the name
        of the lever that asks for it) the blocks' GEMMs multiply in fp8 (hpcnft.fp8)."""
        from hpcnft.perf import fp8

        with torch.no_grad():
            live = [_local(p).detach().clone() for p in self.trainable]
            for p, s in zip(self.trainable, self.shadow):
                _local(p).copy_(s)
        try:
            with levers.nograd_weights(self):  # perf.merge_lora_nograd, perf.fuse_qkv (no-grad uses only)
                with fp8.blocks_in_fp8(self.transformer, fp8_gemms) if fp8_gemms else contextlib.nullcontext():
                    yield
        finally:
            with torch.no_grad():
                for p, x in zip(self.trainable, live):
                    _local(p).copy_(x)

    def rollout_weights(self):
        """pi_old for the rollout: old_weights, in fp8 under perf.rollout_fp8."""
        return self.old_weights("perf.rollout_fp8" if levers.effective(self.cfg).rollout_fp8 else None)

    def v_old_weights(self):
        """pi_old for the train step's v_old pass: old_weights, in fp8 under perf.v_old_fp8."""
        return self.old_weights("perf.v_old_fp8" if levers.effective(self.cfg).v_old_fp8 else None)

    @contextlib.contextmanager
    def base_weights(self):
        """The frozen base model (LoRA adapters off), for the KL reference."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    @torch.no_grad()
    def ema_update(self, decay: float) -> None:
        """theta_old <- decay * theta_old + (1 - decay) * theta."""
        for s, p in zip(self.shadow, self.trainable):
            s.mul_(decay).add_(_local(p).detach(), alpha=1.0 - decay)

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return levers.with_attention(self.cfg, contextlib.nullcontext())
        return levers.with_attention(self.cfg, torch.autocast(self.device.type, dtype=self.compute_dtype))


def train_sigma_pairs(cfg: Config, sample_ids: list[int], step: int) -> list[tuple[int, int]]:
    """(local sample position, sigma grid index) for every pair, sample-major."""
    out = []
    for pos, sid in enumerate(sample_ids):
        idx = nft.trained_sigma_indices(cfg.rollout.num_steps, cfg.nft.timestep_fraction,
                                        cfg.nft.timestep_strategy, cfg.nft.shuffle_timesteps, cfg.train.seed,
                                        stable_hash(step, sid))
        out += [(pos, j) for j in idx]
    return out


def pair_noise(cfg: Config, step: int, sid: int, sigma_index: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_hash("nft_corrupt", cfg.train.seed, step, sid, sigma_index))
    return torch.randn(shape, generator=g, dtype=torch.float32)


class PairNoise:
    """The corruption noise of a step's pairs, drawn on the host from per-pair generators (so it
    does not depend on the layout). `prefetch` draws it in a worker thread, into pinned memory,
    while the rollout keeps the GPU busy (drawing it at the start of the train step left the GPU
    idle ~0.2 s an iteration at the real shapes); `take` returns it, or draws it now when nothing
    was prefetched for this step and these samples. Same values either way."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._pending = None  # (step, sample ids, shape, future)
        self._pool = None

    def draw(self, step: int, sample_ids: list[int], pairs: list[tuple[int, int]], shape: tuple,
             pin: bool = False) -> torch.Tensor:
        eps = torch.stack([pair_noise(self.cfg, step, sample_ids[p], j, shape) for p, j in pairs])
        return eps.pin_memory() if pin else eps

    def prefetch(self, step: int, sample_ids: list[int], shape: tuple, pin: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcnft-noise")
        ids, shape = list(sample_ids), tuple(shape)
        pairs = train_sigma_pairs(self.cfg, ids, step)
        self._pending = (step, ids, shape, self._pool.submit(self.draw, step, ids, pairs, shape, pin))

    def take(self, step: int, sample_ids: list[int], pairs: list[tuple[int, int]], shape: tuple) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None and pending[:3] == (step, list(sample_ids), tuple(shape)):
            return pending[3].result()  # re-raises the worker's exception here
        return self.draw(step, list(sample_ids), pairs, tuple(shape))


class Trainer:
    # Sums of the step's metrics: those of device tensors are kept on the device (no sync per
    # micro-batch), those of host tensors on the host.
    DEVICE_SUMS = ("loss", "pos", "neg", "r", "t", "kl")
    HOST_SUMS = ("adv", "adv_abs", "pairs")

    def __init__(self, cfg: Config, policy: Policy, train_group, num_train_ranks: int):
        self.cfg, self.policy = cfg, policy
        self.group, self.num_train_ranks = train_group, num_train_ranks
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(policy.trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scaler = LossScaler(cfg.train.grad_scaler_init, enabled=cfg.train.precision == "fp16")
        self.noise = PairNoise(cfg)

    def _micro_batches(self, pairs: list, size: int):
        for i in range(0, len(pairs), size):
            yield pairs[i:i + size]

    def _inputs(self, batch: PairBatch, sigmas: torch.Tensor, mb: list[tuple[int, int]], eps: torch.Tensor) -> MicroBatch:
        dev = self.policy.device
        pos = torch.tensor([p for p, _ in mb])
        index = pos.to(batch.x0.device)
        sig = sigmas[torch.tensor([j for _, j in mb])].to(dev)
        x0 = batch.x0[index].to(dev)
        x_sigma = nft.corrupt(x0, sig, eps.to(dev, non_blocking=eps.is_pinned()))
        return MicroBatch(pos, index, sig, x0, x_sigma, batch.r[pos].to(dev))

    def _forward(self, x_sigma, sig, batch: PairBatch, index: torch.Tensor):
        """The live policy's velocity at the pairs whose samples `index` (on the rollout tensors'
        device) names."""
        from hpcnft.algo.sampler import velocity

        dev = self.policy.device
        with self.policy.autocast():
            return velocity(self.policy.transformer, x_sigma, sig, batch.prompt_embeds[index].to(dev),
                            batch.pooled[index].to(dev), self.policy.compute_dtype)

    def step(self, batch: PairBatch, sigmas: torch.Tensor, step: int) -> dict[str, float]:
        """One optimizer step over this rank's pairs; returns the step's metrics (all ranks)."""
        cfg, policy = self.cfg, self.policy
        pairs = train_sigma_pairs(cfg, batch.sample_ids, step)
        with span("train/inputs"):
            eps = self.noise.take(step, batch.sample_ids, pairs, tuple(batch.x0.shape[1:]))
            size = cfg.train.micro_batch
            mbs = [self._inputs(batch, sigmas, mb, eps[i * size:i * size + len(mb)])
                   for i, mb in enumerate(self._micro_batches(pairs, size))]
        # v_old (and the KL reference) for every micro-batch first, in the same composition as the
        # trained forward: with pi_old == pi_theta and no lever that changes the no-grad passes'
        # rounding, the two branches then agree bit for bit.
        with span("train/old_pass"), torch.no_grad(), policy.v_old_weights():
            if cfg.perf.old_pass_batch > 0:  # one batched no-grad pass over all pairs
                v_old = levers.old_velocities(self, batch, mbs)
            else:
                v_old = [self._forward(m.x_sigma, m.sigma, batch, m.index) for m in mbs]
        v_ref = None
        if cfg.nft.kl_beta > 0:
            with torch.no_grad(), policy.base_weights():
                v_ref = [self._forward(m.x_sigma, m.sigma, batch, m.index) for m in mbs]
        self.optimizer.zero_grad(set_to_none=True)
        dev_sums = torch.zeros(len(self.DEVICE_SUMS), dtype=torch.float64, device=policy.device)
        host_sums = torch.zeros(len(self.HOST_SUMS), dtype=torch.float64)
        # Gradient of the global mean over all pairs: FSDP averages over the train ranks.
        loss_norm = self.num_train_ranks / batch.n_global_pairs
        used_scale = self.scaler.scale
        for i, mb in enumerate(mbs):
            with span("train/micro_batch"):
                dev_part, host_part = self._micro_batch(batch, mb, v_old[i], v_ref[i] if v_ref else None,
                                                        loss_norm, used_scale)
            dev_sums += dev_part
            host_sums += host_part
        with span("train/optimizer"):
            grad_norm, skipped = self._optimizer_step()
        sums = torch.cat([dev_sums.cpu(), host_sums])
        if self.group is not None:
            sums = sums.to(collective_device(dist.get_backend(self.group), policy.device))
            dist.all_reduce(sums, group=self.group)
        return self._metrics(dict(zip(self.DEVICE_SUMS + self.HOST_SUMS, sums.tolist())), grad_norm, skipped,
                             used_scale)

    def _micro_batch(self, batch: PairBatch, mb: MicroBatch, v_old: torch.Tensor, v_ref, loss_norm: float,
                     scale: float):
        """Forward, NFT loss and backward of one micro-batch (gradients accumulate); returns its
        metric sums (DEVICE_SUMS on the device, HOST_SUMS on the host)."""
        cfg = self.cfg
        pos, sig, x0, x_sigma, r = mb.pos, mb.sigma, mb.x0, mb.x_sigma, mb.r
        v_theta = self._forward(x_sigma, sig, batch, mb.index)
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

    def _optimizer_step(self) -> tuple[float, bool]:
        params = self.policy.trainable
        if self.scaler.enabled:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.scaler.scale)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        grad_norm = float(norm.item())
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.scaler.update(found_inf=skipped)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _metrics(self, s: dict[str, float], grad_norm: float, skipped: bool, scale: float) -> dict[str, float]:
        n = s["pairs"]
        k = nft.num_trained_sigmas(self.cfg.rollout.num_steps, self.cfg.nft.timestep_fraction)
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
