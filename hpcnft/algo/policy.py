"""The trained DiT: LoRA (peft) or full fine-tune under FSDP2, and the old policy pi_old as an
EMA shadow of the trainable parameters, swapped into the live parameters (no gradient) to sample
rollouts and to compute v_old, as miles' `--ref-mode ema`."""
from __future__ import annotations

import contextlib

import torch

from hpcnft.algo.root_config import Config
from hpcnft.common.determinism import stable_hash
from hpcnft.common.tensors import local_shard
from hpcnft.models.families import family_of
from hpcnft.perf import levers

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def read_dtype(cfg: Config) -> torch.dtype:
    """The dtype the base DiT is read from its folder in: a LoRA run's, all frozen, in the compute
    dtype (the values a cast of its fp32 copy gives, in half the host memory: FLUX.1-dev's 22 GiB,
    not 44); a full fine-tune's in fp32, the master copy of its trained weights."""
    if cfg.train.finetune == "lora":
        return AUTOCAST_DTYPES.get(cfg.train.precision, torch.float32)
    return torch.float32


@contextlib.contextmanager
def adapters_in_fp32():
    """peft draws a new adapter's init in fp32 and then casts it to its base layer's dtype, which
    rounds it where the base is half precision: kept in fp32, the init has the same bits whatever
    dtype the base was read in."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    where = BaseTunerLayer._get_base_layer_device_and_dtype
    BaseTunerLayer._get_base_layer_device_and_dtype = lambda self, base: (where(self, base)[0], None)
    try:
        yield
    finally:
        BaseTunerLayer._get_base_layer_device_and_dtype = where


def add_lora(transformer: torch.nn.Module, cfg: Config) -> None:
    """peft LoRA on the configured projections, 'gaussian' init (B = 0: the step-0 model is the
    base), trained weights in fp32."""
    from peft import LoraConfig

    t = cfg.train
    lora = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, init_lora_weights="gaussian",
                      target_modules=list(t.lora_targets))
    # peft draws the LoRA A init from the global RNG: seed it from the config, then put the
    # global state back so nothing else depends on this draw.
    with torch.random.fork_rng(devices=[]), adapters_in_fp32():
        torch.manual_seed(stable_hash("lora_init", t.seed))
        transformer.add_adapter(lora)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def make_trainable(transformer: torch.nn.Module, cfg: Config) -> None:
    """What train.finetune trains (LoRA adapters, or the whole DiT) set requires_grad, but for
    the modules the DiT's output never reaches (the family's `unreached`), which stay frozen."""
    if cfg.train.finetune == "lora":
        add_lora(transformer, cfg)
    else:
        transformer.requires_grad_(True)
    for module in family_of(transformer).unreached(transformer):  # no gradient reaches them
        module.requires_grad_(False)


class Policy:
    def __init__(self, cfg: Config, transformer: torch.nn.Module, device: torch.device, mesh):
        self.cfg, self.device = cfg, device
        self.compute_dtype = AUTOCAST_DTYPES.get(cfg.train.precision, torch.float32)
        self.transformer = transformer
        self.blocks = family_of(transformer).fsdp_blocks(transformer)  # the DiT's repeated blocks
        self.base_storage = ""  # perf.base_fp8_storage: what the stored base holds, for the user
        self._prepare(mesh)
        levers.prepare_policy(self)  # perf levers applied at construction (regional compile)
        self.trainable = [p for p in self.transformer.parameters() if p.requires_grad]
        self.trainable_names = [n for n, p in self.transformer.named_parameters() if p.requires_grad]
        self.shadow = [local_shard(p).detach().clone() for p in self.trainable]
        # eval.policy="ema": a second EMA of theta that only the evaluation uses (official recipe)
        self.eval_shadow = ([local_shard(p).detach().clone() for p in self.trainable]
                            if cfg.eval.policy == "ema" else None)
        # a full fine-tune's base, for watch.drift_sigmas (LoRA's base is its adapters turned off):
        # the weights as loaded, on the host, this rank's shards
        self.base_copy = ([local_shard(p).detach().to("cpu", copy=True) for p in self.trainable]
                          if cfg.train.finetune == "full" and cfg.watch.drift_sigmas else None)

    def _prepare(self, mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        cfg, tr = self.cfg.train, self.transformer
        make_trainable(tr, self.cfg)
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
        # before the move: only fp8 reaches the GPU
        self.base_storage = levers.store_base_weights(self.cfg, family_of(tr).fsdp_blocks(tr))
        if cfg.grad_checkpointing:
            tr.enable_gradient_checkpointing()
        tr.to(self.device)
        family_of(tr).prepare_dit(tr)
        if not levers.use_fsdp(self.cfg, mesh):  # perf.skip_single_rank_fsdp on a one-rank mesh
            return
        options = levers.fsdp_options(self.cfg, self.device, tr)  # perf.fsdp_cpu_offload, replicate_frozen_base
        if self.cfg.determinism.layout_invariant:  # the adapters whole on every rank: the trainer sums
            # their shards' gradients itself, in a fixed order (hpcnft.algo.virtual_shards)
            trained = {p for p in tr.parameters() if p.requires_grad}
            options["ignored_params"] = options.get("ignored_params", set()) | trained
        # FSDP2 wants one dtype per parameter group: with a half-precision base, each LoRA linear
        # (fp32) gets its own group. Fewer groups mean fewer collectives, so only then (and not
        # where the base is left out of FSDP2 altogether).
        if cfg.finetune == "lora" and self.compute_dtype != torch.float32 and "ignored_params" not in options:
            for module in tr.modules():
                if isinstance(module, torch.nn.Linear) and any(p.requires_grad for p in module.parameters(False)):
                    fully_shard(module, mesh=mesh, **options)
        for block in family_of(tr).fsdp_blocks(tr):
            fully_shard(block, mesh=mesh, **options)
        fully_shard(tr, mesh=mesh, **options)

    # -- old policy ----------------------------------------------------------------------
    def old_weights(self, fp8_gemms: str | None = None):
        """Temporarily put pi_old's weights into the live parameters. With `fp8_gemms` (the name
        of the lever that asks for it) the blocks' GEMMs multiply in fp8 (perf.fp8)."""
        return self._swapped_in(self.shadow, fp8_gemms)

    def eval_weights(self):
        """The weights the evaluation samples with: pi_old (eval.policy="old") or the evaluation
        EMA of theta (eval.policy="ema")."""
        return self._swapped_in(self.eval_shadow if self.eval_shadow is not None else self.shadow, None)

    @contextlib.contextmanager
    def _swapped_in(self, weights: list[torch.Tensor], fp8_gemms: str | None):
        self._settle_host_shards()
        with torch.no_grad():
            live = [local_shard(p).detach().clone() for p in self.trainable]
            for p, s in zip(self.trainable, weights):
                local_shard(p).copy_(s)
        try:
            with levers.nograd_weights(self):  # perf.merge_lora_nograd, perf.fuse_qkv (no-grad uses only)
                with levers.fp8_blocks(self, fp8_gemms):
                    yield
        finally:
            self._settle_host_shards()
            with torch.no_grad():
                for p, x in zip(self.trainable, live):
                    local_shard(p).copy_(x)

    def _settle_host_shards(self) -> None:
        """Under perf.fsdp_cpu_offload the shards live in pinned host memory, which FSDP2 copies
        to the GPU without blocking: the copies queued so far must have read the shards before
        they are rewritten in place, or a block computes with the other policy's weights."""
        if self.device.type == "cuda" and self.trainable and local_shard(self.trainable[0]).device.type == "cpu":
            torch.cuda.synchronize(self.device)

    def rollout_weights(self):
        """pi_old for the rollout: old_weights, in fp8 under perf.rollout_fp8."""
        return self.old_weights("perf.rollout_fp8" if levers.effective(self.cfg).rollout_fp8 else None)

    def v_old_weights(self):
        """pi_old for the train step's v_old pass: old_weights, in fp8 under perf.v_old_fp8."""
        return self.old_weights("perf.v_old_fp8" if levers.effective(self.cfg).v_old_fp8 else None)

    @contextlib.contextmanager
    def base_weights(self):
        """The frozen base model: LoRA's adapters off (the KL reference, the drift), or a full
        fine-tune's weights as loaded (the drift)."""
        if self.base_copy is not None:
            with self._swapped_in(self.base_copy, None):
                yield
            return
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    @torch.no_grad()
    def ema_update(self, decay: float) -> None:
        """theta_old <- decay * theta_old + (1 - decay) * theta."""
        for s, p in zip(self.shadow, self.trainable):
            s.mul_(decay).add_(local_shard(p).detach(), alpha=1.0 - decay)

    @torch.no_grad()
    def eval_ema_update(self, decay: float) -> None:
        """theta_eval <- theta_eval + (1 - decay) (theta - theta_eval), the official EMA's update."""
        one_minus_decay = 1 - decay
        for e, p in zip(self.eval_shadow, self.trainable):
            e.add_(one_minus_decay * (local_shard(p).detach() - e))

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return levers.with_attention(self.cfg, contextlib.nullcontext())
        return levers.with_attention(self.cfg, torch.autocast(self.device.type, dtype=self.compute_dtype))
