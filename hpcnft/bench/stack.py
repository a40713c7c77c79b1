"""The package's own code path as a bench stack, with config overrides (the perf levers)."""
from __future__ import annotations

import contextlib
import json

from hpcnft.algo.config import AlgoConfig
from hpcnft.bench.random_models import build_clip, build_dit, build_dit_on_host, build_vae, clip_processor
from hpcnft.bench.shapes import (TRAIN_K, Shapes, _Pipe, _torch, prompt_list, random_images, scheduler, smooth_images,
                                 world1_mesh)
from hpcnft.common.errors import UsageError

DEFAULT_ALGO = AlgoConfig().name  # the stacks' own algorithm (algo.name's default): every stack, levers, baseline


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, list, tuple)):
        return json.dumps(list(v) if isinstance(v, tuple) else v)
    return str(v)


@contextlib.contextmanager
def fp32_arithmetic(module):
    """While inside, `module` computes in fp32: its half-precision parameters and buffers upcast
    (exactly) to fp32, no TF32, compiled code bypassed (eager); all put back on exit."""
    torch = _torch()
    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point() and t.dtype != torch.float32]
    saved = [t.data for t in tensors]
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        for t in tensors:
            t.data = t.data.float()
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for t, d in zip(tensors, saved):
            t.data = d
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def bench_config(S: Shapes, dev, overrides: dict):
    """The recipe at the bench's shapes (a video's frames too), world 1 (reward colocated),
    determinism off, plus overrides. The shapes set the precision on a GPU (fp32 on a CPU),
    checkpointing and the LoRA targets, as the eager stack uses them."""
    from hpcnft.algo.root_config import ConfigError, load_config

    base = {
        "rollout.height": S.hw[0], "rollout.width": S.hw[1], "rollout.num_frames": S.num_frames,
        "rollout.prompts_per_step": S.prompts, "rollout.samples_per_prompt": S.per_prompt,
        "rollout.num_steps": S.num_steps,
        "rollout.max_sequence_length": S.t5_tokens, "rollout.batch_size": max(S.rollout_batches),
        "train.micro_batch": max(S.micro_batches), "train.grad_checkpointing": S.grad_checkpointing,
        "train.precision": S.precision if dev.type == "cuda" else "fp32",
        "train.lora_rank": S.lora_rank, "train.lora_alpha": S.lora_alpha, "train.lora_targets": list(S.lora_targets),
        "layout.train_ranks": 1, "layout.reward_ranks": 0, "layout.device": dev.type,
        "determinism.enabled": False, "models.family": S.family, "models.sd3_dir": "", "models.flux_dir": "",
        "models.pickscore_dir": "",
        "models.pickscore_processor_dir": "", "data.train_prompts": "builtin:tiny_train_prompts.txt",
        "data.eval_prompts": "builtin:tiny_eval_prompts.txt", "steps": 1000,
    }
    base.update(overrides)
    try:
        return load_config(S.recipe, [f"{k}={_toml(v)}" for k, v in base.items()])
    except ConfigError as e:
        raise UsageError(str(e)) from None


def relative_error(a, b) -> float:
    """|a - b| / |b| in the 2-norm: what a lever's rounding costs against the reference b."""
    return float((a - b).norm() / b.norm())


class HpcnftStack:
    """The package's code path: Policy + Trainer + Learner, sampler and reward functions."""

    def __init__(self, key: str, label: str, S: Shapes, dev, overrides: dict, real_text: bool = False,
                 host_build: bool = False):
        self.key, self.label, self.S, self.dev = key, label, S, dev
        self.real_text = real_text  # SD3.5's text encoders at their real shapes (bench.text_encoders)
        # The DiT built in host memory, as a run loads it: Policy casts (and stores) it before it
        # moves it, so a capped GPU never holds the fp32 copy. Slower to build (a CPU's init).
        self.host_build = host_build
        self.overrides = dict(overrides)
        self.cfg = bench_config(S, dev, overrides)
        self.config = {"overrides": {k: v for k, v in overrides.items()}}
        self._policy = self._vae = self._scorer = self._tr = None
        self.term_towers = {}  # what each reward term beside PickScore ran (bench.terms.build_term)
        self.step_no = 0
        self.count_flops = True  # Bench counts each phase's FLOPs (an eager pass) after timing it
        self.last_metrics = {}

    @property
    def dtype(self):
        from hpcnft.algo.policy import AUTOCAST_DTYPES

        return AUTOCAST_DTYPES.get(self.cfg.train.precision, _torch().float32)

    @property
    def policy(self):
        if self._policy is None:
            from hpcnft.algo.registry import algorithm_for
            from hpcnft.algo.policy import Policy
            from hpcnft.models.families import family_named

            mesh = world1_mesh(self.dev)
            host = self.host_build or self.S.host_build
            dit = build_dit_on_host(self.S) if host else build_dit(self.S, self.dev)
            self._policy = Policy(self.cfg, dit, self.dev, mesh)
            self.algorithm = algorithm_for(self.cfg)  # algo.name's
            self.trainer = self.algorithm.make_trainer(self._policy, None, 1)
            self.sigmas = family_named(self.S.family).sigma_grid(scheduler(self.S), self.cfg.rollout.num_steps,
                                                                 self.S.latent_shape)
        return self._policy

    @property
    def vae(self):
        if self._vae is None:
            from hpcnft.perf import levers

            self._vae = levers.prepare_vae(build_vae(self.S, self.dev), self.cfg)  # loaded in fp32, as the job does
        return self._vae

    @property
    def scorer(self):
        if self._scorer is None:
            from hpcnft.perf import levers
            from hpcnft.rewards.pickscore import PickScoreScorer

            scorer = PickScoreScorer(clip_processor(), build_clip(self.S, self.dev), self.dev)
            self._scorer = levers.prepare_scorer(scorer, self.cfg)
        return self._scorer

    @property
    def train_rank(self):
        if self._tr is None:
            from hpcnft.distributed.groups import Topology
            from hpcnft.algo.iteration import Learner
            from hpcnft.distributed.reward_service import LocalRewardClient

            policy = self.policy
            topo = Topology(0, 1, 0, [0], [], "bench", "nccl" if self.dev.type == "cuda" else "gloo", self.dev)
            if self.real_text:
                from hpcnft.bench.text_encoders import real_text_pipeline

                pipe = real_text_pipeline(self.S, policy.transformer, self.vae, scheduler(self.S), self.dtype, self.dev,
                                          offload=self.cfg.perf.text_encoders == "offload")
            else:
                pipe = _Pipe(policy.transformer, self.vae, self.S, self.dtype, self.dev)
            self._tr = Learner(self.cfg, topo, None, world1_mesh(self.dev), LocalRewardClient(self._score_fn()),
                               pipe, policy, self.algorithm)
        return self._tr

    def _score_fn(self):
        from hpcnft.algo.reward import make_score_fn

        return make_score_fn(self.cfg, {"pickscore": self.scorer})  # the bench's config: PickScore alone

    def _cond(self, n: int, seed: int = 0):
        return self.S.conditioning(n, seed, self.dtype)

    def _latent(self, n: int, seed: int = 0):
        """Unpacked VAE latents, as the sampler and the NFT loss hold them (FLUX's too)."""
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, *self.S.latent_shape, generator=g)

    def rollout_forward(self, b: int):
        """One DiT forward of the rollout: sampler.velocity under the old weights and autocast (with
        the rollout's guidance value, which FLUX.1-dev's DiT embeds)."""
        torch = _torch()
        from hpcnft.algo.sampler import velocity

        policy = self.policy
        x = self._latent(b).to(self.dev)
        s = self.sigmas[3].expand(b).to(self.dev)
        pe, pooled = (t.to(self.dev) for t in self._cond(b))

        def fn():
            with torch.no_grad(), policy.autocast():
                velocity(policy.transformer, x, s, pe, pooled, policy.compute_dtype,
                         guidance=self.cfg.rollout.guidance_scale)
        return fn, policy.rollout_weights

    def vae_decode(self, b: int):
        from hpcnft.algo.sampler import decode_to_uint8
        from hpcnft.models.families import family_named

        latents = self._latent(b).to(self.dev)
        vae, family = self.vae, family_named(self.S.family)
        return (lambda: decode_to_uint8(vae, latents, self.cfg.rollout.uint8_rounding, family=family)), \
            contextlib.nullcontext

    def pickscore(self, n: int):
        """PickScore of n samples: images, or videos as a reward rank scores them (algo.reward.score_videos)."""
        prompts, scorer = prompt_list(n), self.scorer
        if self.S.video:
            from hpcnft.algo.reward import score_videos

            videos, how = random_images(self.S, n, videos=True), self.cfg.reward.frame_pooling
            return (lambda: score_videos(scorer, prompts, videos, how)), contextlib.nullcontext
        images = random_images(self.S, n)
        return (lambda: scorer(prompts, images)), contextlib.nullcontext

    def reward_term(self, kind: str, n: int):
        """One of the other reward terms (bench.terms) on n images (a video's shapes: frames) with their
        prompts, its preprocessing included. Smooth images, as decoded ones are: the JPEG size's time
        depends on the content; the OCR term's show their prompt's text (bench.terms.text_images)."""
        from hpcnft.bench.terms import build_term, text_images

        term, self.term_towers[kind] = build_term(self.S, kind, self.dev)
        prompts, images = text_images(n) if kind == "ocr" else (prompt_list(n), smooth_images(self.S, n))
        return (lambda: term(prompts, images)), contextlib.nullcontext

    def preprocess_cost(self, n: int) -> dict:
        """What perf.pickscore_preprocess="device" costs in reward: PickScore of the same n images
        (a video's shapes: n frames) through the device path and through the processor's PIL path
        (smooth images, as decoded ones are, and uniform noise, the worst case for a resize kernel)."""
        scorer, prompts, out = self.scorer, prompt_list(n), {}
        for name, images in (("smooth", smooth_images(self.S, n)), ("noise", random_images(self.S, n))):
            scores = {}
            for on_device in (True, False):
                scorer.preprocess_on_device = on_device
                scores[on_device] = scorer(prompts, images).double()
            diff = (scores[True] - scores[False]).abs()
            out[name] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                         "score_std": float(scores[False].std()), "n": n}
        scorer.preprocess_on_device = True
        return out

    def rollout_fp8_cost(self, n: int) -> dict:
        """What perf.rollout_fp8 costs: n samples (one batch, the same noise and conditioning)
        sampled with the blocks' GEMMs in fp8 and in the compute dtype. The velocity of one
        forward, the final latents, and PickScore of the decoded images, compared."""
        from hpcnft.algo.sampler import decode_to_uint8

        policy = self.policy
        prompts = prompt_list(n)
        out = {}
        for fp8 in (True, False):
            with policy.old_weights("perf.rollout_fp8" if fp8 else None):  # rollout_weights, both ways
                v, x0 = self._velocity_and_latents(policy.transformer, n)
            images = decode_to_uint8(self.vae, x0, self.cfg.rollout.uint8_rounding)
            out[fp8] = (v, x0.float(), self.scorer(prompts, images).double(), images)
        (v8, x8, s8, i8), (v16, x16, s16, i16) = out[True], out[False]
        diff = (s8 - s16).abs()
        return {"n": n, "velocity_rel_error": relative_error(v8, v16), "latent_rel_error": relative_error(x8, x16),
                "pixels_mean_abs": float((i8.float() - i16.float()).abs().mean()),
                "pickscore_max_abs": float(diff.max()), "pickscore_mean_abs": float(diff.mean()),
                "pickscore_mean_shift": float((s8 - s16).mean()), "pickscore_std": float(s16.std())}

    def base_fp8_storage_cost(self, n: int) -> dict:
        """What perf.base_fp8_storage costs: n samples (one batch, the same noise and conditioning)
        sampled by the policy's fp8-stored base (adapters off, so that phases that trained them
        before do not count) and by the same DiT built again in the compute dtype. The velocity of
        one forward and the final latents, compared."""
        policy = self.policy
        with policy.base_weights():
            v8, x8 = self._velocity_and_latents(policy.transformer, n)
        plain = build_dit(self.S, self.dev).to(policy.compute_dtype).requires_grad_(False)
        v16, x16 = self._velocity_and_latents(plain, n)
        del plain
        return {"n": n, "velocity_rel_error": relative_error(v8, v16),
                "latent_rel_error": relative_error(x8.float(), x16.float())}

    def _velocity_and_latents(self, dit, n: int):
        """`dit` on n seeded samples (noise and conditioning the same each call): one forward's
        velocity (fp32) at the grid's fourth sigma, and the latents the whole rollout ends with."""
        torch = _torch()
        from hpcnft.algo.sampler import Conditioning, euler_sample, velocity

        policy, cfg = self.policy, self.cfg
        noise = self._latent(n, seed=11).to(self.dev)
        pe, pooled = (t.to(self.dev) for t in self._cond(n, seed=12))
        with torch.no_grad(), policy.autocast():
            v = velocity(dit, noise, self.sigmas[3].expand(n).to(self.dev), pe, pooled, policy.compute_dtype,
                         guidance=cfg.rollout.guidance_scale).float()
        x0 = euler_sample(dit, noise, self.sigmas, Conditioning(pe, pooled), cfg.rollout.guidance_scale,
                          policy.compute_dtype, policy.autocast)
        return v, x0

    def _train_batch(self, mb: int):
        """The algorithm's seeded train batch of `mb` samples with TRAIN_K trained steps each, on
        the device as Learner.rollout leaves it, with CFG's empty prompt where the family guides so."""
        from hpcnft.algo.sampler import Conditioning
        from hpcnft.models.families import family_named

        self.policy
        cond = Conditioning(*self._cond(mb, seed=8))
        if self.cfg.rollout.guidance_scale > 1.0 and family_named(self.S.family).cfg_guidance:
            cond.neg_prompt_embeds, cond.neg_pooled = self._cond(1, seed=9)
        return self.algorithm.synthetic_batch(mb, TRAIN_K, cond, self.S.latent_shape, self.dev)

    def v_old_fp8_cost(self, mb: int) -> dict:
        """What perf.v_old_fp8 costs: one micro-batch of `mb` pairs (sigmas across the grid),
        v_old computed in fp8 and in the compute dtype, then the NFT loss and its gradient with
        each against the same v_theta. v_old's error is given relative to v_old and to the
        residual v_old - (eps - x0) the loss is made of (random weights: the residual of a
        trained model is smaller, so that share is larger there). With a half-precision compute
        dtype, `vs_fp32` puts both against v_old in fp32 arithmetic over the same weights: the
        scale of what the compute dtype's own rounding already costs."""
        torch = _torch()
        from hpcnft.algo.sampler import velocity
        from hpcnft.common.tensors import local_shard

        policy, trainer, cfg = self.policy, self.trainer, self.cfg
        batch = self._train_batch(mb)  # DiffusionNFT's: the stack's algorithm
        pairs = [(p, p % cfg.rollout.num_steps) for p in range(mb)]
        eps = torch.randn(mb, *batch.x0.shape[1:], generator=torch.Generator().manual_seed(10))
        m = trainer.inputs(batch, self.sigmas, pairs, eps)
        scale = trainer.scaler.scale
        half = policy.compute_dtype != torch.float32
        out = {}
        try:
            for how in ("fp8", "compute") + (("fp32",) if half else ()):
                with torch.no_grad(), policy.old_weights("perf.v_old_fp8" if how == "fp8" else None):
                    if how == "fp32":
                        with fp32_arithmetic(policy.transformer):
                            v_old = velocity(policy.transformer, m.x_sigma, m.sigma, batch.prompt_embeds[m.index],
                                             batch.pooled[m.index], torch.float32,
                                             guidance=cfg.rollout.guidance_scale).float()
                    else:
                        v_old = trainer.forward(m.x_sigma, m.sigma, batch, m.index).float()
                for p in policy.trainable:
                    p.grad = None
                sums, _ = trainer.micro_batch(batch, m, v_old, None, 1.0 / mb, scale)
                grad = torch.cat([local_shard(p.grad).float().flatten() / scale for p in policy.trainable
                                  if p.grad is not None])
                out[how] = (v_old, float(sums[0]) / mb, grad)
        finally:
            for p in policy.trainable:
                p.grad = None
        (v8, loss8, g8), (v16, loss16, g16) = out["fp8"], out["compute"]
        residual = v16 - (eps.to(v16.device) - m.x0.float())
        cost = {"n": mb, "v_old_rel_error": relative_error(v8, v16),
                "v_old_error_vs_residual": float((v8 - v16).norm() / residual.norm()),
                "loss_rel_error": abs(loss8 - loss16) / abs(loss16),
                "grad_cosine": float(torch.nn.functional.cosine_similarity(g8, g16, dim=0)),
                "grad_norm_ratio": float(g8.norm() / g16.norm()),
                "grad_rel_error": relative_error(g8, g16)}
        if half:
            v32, _, g32 = out["fp32"]
            cost["vs_fp32"] = {name: {"v_old_rel_error": relative_error(v, v32),
                                      "grad_rel_error": relative_error(g, g32),
                                      "grad_cosine": float(torch.nn.functional.cosine_similarity(g, g32, dim=0))}
                               for name, (v, _, g) in (("fp8", out["fp8"]), (cfg.train.precision, out["compute"]))}
        return cost

    def train_pairs(self, mb: int):
        """The algorithm's train step on `mb` samples with TRAIN_K trained steps each, in one
        update: TRAIN_K micro-batches of `mb`."""
        from hpcnft.algo.registry import spec_of

        cfg, batch = self.cfg, self._train_batch(mb)
        keys = spec_of(cfg.algo.name).one_update(cfg, TRAIN_K, mb)

        @contextlib.contextmanager
        def ctx():
            saved = {key: _get(cfg, key) for key in keys}
            for key, value in keys.items():
                _set(cfg, key, value)
            try:
                yield
            finally:
                for key, value in saved.items():
                    _set(cfg, key, value)

        def fn():
            self.step_no += 1
            self.last_metrics = self.trainer.step(batch, self.sigmas, self.step_no)
        return fn, ctx, mb * TRAIN_K

    def close(self) -> None:
        self._policy = self._vae = self._scorer = self._tr = self.trainer = self.algorithm = None

    def iteration(self):
        tr = self.train_rank

        def fn():
            self.step_no += 1
            metrics, _ = tr.iteration(self.step_no)
            self.last_metrics = {k: v for k, v in metrics.items() if k.startswith("perf/") or k.startswith("train/")}
        return fn, contextlib.nullcontext


def _get(cfg, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _set(cfg, key: str, value) -> None:
    section, _, name = key.partition(".")
    setattr(getattr(cfg, section), name, value)
