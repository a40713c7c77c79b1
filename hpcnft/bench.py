"""`hpcnft bench`: time, FLOPs and MFU of each phase of one DiffusionNFT iteration.

Random weights at the real shapes (`--shapes sd35m`: the SD3.5-M DiT, the SD3.5 VAE and a
PickScore-shaped CLIP-H; nothing is downloaded) or at the tiny shapes (`--shapes tiny`, runs on
a CPU). Each phase is timed after warm-up (CUDA events on a GPU, the median of the repeats), its
FLOPs counted by torch.utils.flop_counter.FlopCounterMode over the phase itself (run eagerly
once), and its achieved TFLOP/s set against a dense fp16 matmul measured in the same process.

Stacks, each measured in turn in this process:
  eager          the plain diffusers + peft stack (fp16 DiT, LoRA r32, autocast, default SDPA)
                 written out here without any package code (with --baseline);
  hpcnft default the package's own path (Policy under FSDP2, Trainer.step, TrainRank.iteration,
                 euler_sample, decode_to_uint8, PickScoreScorer) with every perf lever off;
  hpcnft fast    the same path with the levers of hpcnft.fast.FAST (change with --set).
`--levers` measures single levers against "hpcnft default", one at a time.

Phases: rollout DiT forward (batch 8/16), VAE decode, PickScore of one iteration's images, the
train pair (v_old + v_theta + backward through Trainer.step, micro-batch 4/16) and one whole
iteration of the recipe (64 samples x 10 steps at 512 px, 64 decodes and PickScores, 576 pairs).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

from hpcnft.cli import UsageError

SCHEMA = "hpcnft-bench/1"
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out"]
CLIP_TOKENS = 77
TRAIN_K = 2  # sigmas per sample in the train-pair phase: two micro-batches per measured step


# == shapes ==================================================================================
@dataclasses.dataclass
class Shapes:
    name: str
    recipe: str
    dit: dict
    vae: dict
    clip_text: dict
    clip_vision: dict
    clip_projection: int
    size: int  # image side, px
    t5_tokens: int  # rollout.max_sequence_length
    prompts: int  # P
    per_prompt: int  # G
    num_steps: int
    rollout_batches: tuple
    micro_batches: tuple
    ceiling_n: int
    lora_rank: int
    lora_alpha: int
    warm: int
    reps: int

    @property
    def samples(self) -> int:
        return self.prompts * self.per_prompt

    @property
    def text_tokens(self) -> int:
        return CLIP_TOKENS + self.t5_tokens


def sd35m_shapes() -> Shapes:
    return Shapes(
        name="sd35m", recipe="sd35m_pickscore",
        dit=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                 num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                 dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        vae=dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                 up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                 layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                 scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
        clip_text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       max_position_embeddings=77, vocab_size=49408, hidden_act="gelu", projection_dim=1024),
        clip_vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                         image_size=224, patch_size=14, hidden_act="gelu", projection_dim=1024),
        clip_projection=1024, size=512, t5_tokens=256, prompts=8, per_prompt=8, num_steps=10,
        rollout_batches=(8, 16), micro_batches=(4, 16), ceiling_n=8192, lora_rank=32, lora_alpha=64,
        warm=2, reps=5)


def tiny_shapes() -> Shapes:
    from hpcnft.tiny import TINY_PICKSCORE, TINY_TRANSFORMER, TINY_VAE

    return Shapes(
        name="tiny", recipe="tiny", dit=dict(TINY_TRANSFORMER), vae=dict(TINY_VAE),
        clip_text=dict(TINY_PICKSCORE["text"], vocab_size=1024), clip_vision=dict(TINY_PICKSCORE["vision"]),
        clip_projection=TINY_PICKSCORE["projection_dim"], size=64, t5_tokens=16, prompts=2, per_prompt=4,
        num_steps=10, rollout_batches=(4, 8), micro_batches=(4, 8), ceiling_n=512, lora_rank=8, lora_alpha=16,
        warm=1, reps=2)


SHAPES = {"sd35m": sd35m_shapes, "tiny": tiny_shapes}


# == measuring =================================================================================
def _torch():
    import torch

    return torch


def sync(dev) -> None:
    torch = _torch()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev, warm: int, reps: int) -> dict:
    """Median seconds of `fn` after `warm` calls (CUDA events on a GPU), and the peak memory
    allocated during the timed calls."""
    torch = _torch()
    for _ in range(warm):
        fn()
    sync(dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    out = {"s": statistics.median(times), "runs_s": [round(t, 6) for t in times]}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return out


def count_flops(fn) -> int:
    """FLOPs of one call of `fn`, counted by FlopCounterMode with compiled code run eagerly."""
    torch = _torch()
    from torch.utils.flop_counter import FlopCounterMode

    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
        else contextlib.nullcontext()
    with stance, FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def matmul_ceiling(dev, n: int) -> dict:
    torch = _torch()
    out = {}
    dtypes = (("fp16", torch.float16), ("bf16", torch.bfloat16)) if dev.type == "cuda" else (("fp32", torch.float32),)
    for name, dt in dtypes:
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=dt, generator=g)
        b = torch.randn(n, n, device=dev, dtype=dt, generator=g)
        m = measure(lambda: a @ b, dev, 3, 10 if dev.type == "cuda" else 3)
        out[f"{name}_tflops"] = 2 * n**3 / m["s"] / 1e12
        del a, b
    return out


# == model builders ============================================================================
def build_dit(S: Shapes, dev):
    torch = _torch()
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    with torch.device(dev):
        return SD3Transformer2DModel(**S.dit)


def build_vae(S: Shapes, dev):
    torch = _torch()
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    with torch.device(dev):
        return AutoencoderKL(**S.vae).eval().requires_grad_(False)


def build_clip(S: Shapes, dev):
    torch = _torch()
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(2)
    cfg = CLIPConfig(text_config=S.clip_text, vision_config=S.clip_vision, projection_dim=S.clip_projection)
    with torch.device(dev):
        return CLIPModel(cfg).eval().requires_grad_(False)


_PROCESSOR = []


def clip_processor():
    """The CLIP-H preprocessing and a CLIP BPE tokenizer, from the tiny models (built offline)."""
    if not _PROCESSOR:
        from transformers import AutoProcessor

        from hpcnft.models import quiet_libraries
        from hpcnft.tiny import ensure_tiny_models
        from hpcnft.tiny_cache import cache_dir

        quiet_libraries()
        _, ps = ensure_tiny_models(cache_dir())
        _PROCESSOR.append(AutoProcessor.from_pretrained(ps, local_files_only=True))
    return _PROCESSOR[0]


def scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def prompt_list(n: int) -> list[str]:
    from hpcnft.tiny import PROMPTS

    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def random_images(S: Shapes, n: int):
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (n, S.size, S.size, 3), generator=g, dtype=torch.uint8)


# == the plain diffusers + peft stack ==============================================================
class EagerStack:
    """What a plain diffusers + peft script does (the reference baseline), no package code."""

    key, label = "eager", "plain diffusers + peft, eager"

    def __init__(self, S: Shapes, dev):
        torch = _torch()
        self.S, self.dev = S, dev
        self.dtype = torch.float16 if dev.type == "cuda" else torch.float32
        self.mb = max(S.micro_batches)
        self.rollout_batch = max(S.rollout_batches)
        self.config = {"dtype": str(self.dtype), "rollout_batch": self.rollout_batch, "micro_batch": self.mb,
                       "attention": "default SDPA", "tf32": dev.type == "cuda"}
        self._dit = self._vae = self._clip = None
        self.sigmas = None

    # lazily built parts
    @property
    def dit(self):
        if self._dit is None:
            torch = _torch()
            from peft import LoraConfig

            dit = build_dit(self.S, self.dev).to(self.dtype).eval().requires_grad_(False)
            dit.add_adapter(LoraConfig(r=self.S.lora_rank, lora_alpha=self.S.lora_alpha, init_lora_weights="gaussian",
                                       target_modules=LORA_TARGETS))
            for n, p in dit.named_parameters():
                if "lora" in n:
                    p.data = p.data.float()
                    p.requires_grad_(True)
            self.lora = [p for p in dit.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(self.lora, lr=3e-4, weight_decay=1e-4)
            self._dit = dit
            sched = scheduler()
            sched.set_timesteps(self.S.num_steps)
            self.sigmas = sched.sigmas.to(self.dev, torch.float32)
        return self._dit

    @property
    def vae(self):
        if self._vae is None:
            self._vae = build_vae(self.S, self.dev).to(self.dtype)
        return self._vae

    @property
    def clip(self):
        if self._clip is None:
            self._clip = build_clip(self.S, self.dev)  # fp32, as PickScore is usually run
        return self._clip

    def autocast(self):
        torch = _torch()
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.dev.type, dtype=self.dtype)

    def _cond(self, n: int, seed: int = 0):
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        pe = torch.randn(n, self.S.text_tokens, self.S.dit["joint_attention_dim"], generator=g)
        pooled = torch.randn(n, self.S.dit["pooled_projection_dim"], generator=g)
        return pe.to(self.dev, self.dtype), pooled.to(self.dev, self.dtype)

    def _latent(self, n: int, seed: int = 0):
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        h = self.S.size // 8
        return torch.randn(n, self.S.dit["in_channels"], h, h, generator=g).to(self.dev)

    # rollout: the base DiT in fp16 (adapters off, as in the reference baseline)
    def _velocity(self, x, sigma, pe, pooled):
        return self.dit(hidden_states=x.to(self.dtype), timestep=sigma * 1000.0, encoder_hidden_states=pe,
                        pooled_projections=pooled, return_dict=False)[0]

    @contextlib.contextmanager
    def rollout_mode(self):
        self.dit.disable_adapters()
        try:
            yield
        finally:
            self.dit.enable_adapters()

    def rollout_forward(self, b: int):
        torch = _torch()
        self.dit
        x = self._latent(b)
        s = self.sigmas[3].expand(b).contiguous()
        pe, pooled = self._cond(b)

        def fn():
            with torch.no_grad():
                self._velocity(x, s, pe, pooled)
        return fn, self.rollout_mode

    def _decode(self, latents):
        torch = _torch()
        vae = self.vae
        with torch.no_grad():
            z = latents.to(self.dtype) / vae.config.scaling_factor + vae.config.shift_factor
            img = vae.decode(z, return_dict=False)[0].float()
            img = ((img / 2 + 0.5).clamp(0, 1) * 255.0).round().to(torch.uint8)
            return img.permute(0, 2, 3, 1).contiguous().cpu()

    def vae_decode(self, b: int):
        latents = self._latent(b)
        return (lambda: self._decode(latents)), contextlib.nullcontext

    def _score(self, prompts, images):
        torch = _torch()
        from PIL import Image

        proc = clip_processor()
        pil = [Image.fromarray(im) for im in images.numpy()]
        with torch.no_grad():
            px = proc(images=pil, return_tensors="pt")["pixel_values"].to(self.dev)
            text = proc(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
            img = self.clip.get_image_features(pixel_values=px)
            txt = self.clip.get_text_features(input_ids=text["input_ids"].to(self.dev),
                                              attention_mask=text["attention_mask"].to(self.dev))
            img = img if isinstance(img, torch.Tensor) else img.pooler_output
            txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
            img = img / img.norm(dim=-1, keepdim=True)
            txt = txt / txt.norm(dim=-1, keepdim=True)
            return (self.clip.logit_scale.exp() * (img * txt).sum(-1) / 26.0).float().cpu()

    def pickscore(self, n: int):
        images, prompts = random_images(self.S, n), prompt_list(n)
        self.clip
        return (lambda: self._score(prompts, images)), contextlib.nullcontext

    # training: v_old (no grad) + v_theta + NFT loss + backward per micro-batch, then AdamW
    def _pair_loss(self, x_sigma, x0, sig, pe, pooled):
        torch = _torch()
        with self.autocast():
            with torch.no_grad():
                v_old = self._velocity(x_sigma, sig, pe, pooled).float()
            v = self._velocity(x_sigma, sig, pe, pooled).float()
        s = sig.view(-1, 1, 1, 1)
        losses = []
        for vb in (v, 2 * v_old - v):  # beta = 1: v+ = v_theta, v- = 2 v_old - v_theta
            err = x_sigma - s * vb - x0
            w = err.detach().abs().flatten(1).mean(1).clamp_min(1e-5)
            losses.append(err.square().flatten(1).mean(1) / w)
        return (5.0 * (0.5 * losses[0] + 0.5 * losses[1])).mean()

    def _pair_data(self, n_pairs: int, mb: int):
        torch = _torch()
        g = torch.Generator().manual_seed(5)
        data = []
        for i in range(0, n_pairs, mb):
            m = min(mb, n_pairs - i)
            x0 = self._latent(m, seed=i + 7)
            eps = torch.randn(x0.shape, generator=g).to(self.dev)
            sig = self.sigmas[torch.randint(0, 9, (m,), generator=g)].to(self.dev)
            x_sigma = (1 - sig.view(-1, 1, 1, 1)) * x0 + sig.view(-1, 1, 1, 1) * eps
            pe, pooled = self._cond(m, seed=i)
            data.append((x_sigma, x0, sig, pe, pooled))
        return data

    def _train(self, data, n_pairs):
        for x_sigma, x0, sig, pe, pooled in data:
            (self._pair_loss(x_sigma, x0, sig, pe, pooled) * (len(sig) / n_pairs)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def train_pairs(self, mb: int):
        self.dit
        n_pairs = TRAIN_K * mb
        data = self._pair_data(n_pairs, mb)
        return (lambda: self._train(data, n_pairs)), contextlib.nullcontext, n_pairs

    def iteration(self):
        """64 samples x 10 Euler steps, decodes, PickScores, then 576 pairs and one AdamW step."""
        torch = _torch()
        S, b = self.S, self.rollout_batch
        n = S.samples
        k = int(S.num_steps * 0.99)
        pe_all, pooled_all = self._cond(n, seed=11)
        prompts = prompt_list(n)

        def fn():
            x0s, scores = [], []
            with self.rollout_mode(), torch.no_grad():
                for i in range(0, n, b):
                    x = self._latent(min(b, n - i), seed=100 + i)
                    for j in range(S.num_steps):
                        s = self.sigmas[j].expand(x.shape[0])
                        v = self._velocity(x, s, pe_all[i:i + b], pooled_all[i:i + b]).float()
                        x = x + (self.sigmas[j + 1] - self.sigmas[j]) * v
                    x0s.append(x)
                    scores.append(self._score(prompts[i:i + b], self._decode(x)))
            rewards = torch.cat(scores).double().view(-1, S.per_prompt)
            (rewards - rewards.mean(1, keepdim=True)) / (rewards.std() + 1e-4)  # advantages (loss uses r = 1/2)
            x0 = torch.cat(x0s)
            g = torch.Generator().manual_seed(9)
            pairs = [(i, j) for i in range(n) for j in range(k)]
            for q in range(0, len(pairs), self.mb):
                chunk = pairs[q:q + self.mb]
                idx = torch.tensor([i for i, _ in chunk])
                sig = self.sigmas[torch.tensor([j for _, j in chunk])]
                eps = torch.randn((len(chunk), *x0.shape[1:]), generator=g).to(self.dev)
                xs = (1 - sig.view(-1, 1, 1, 1)) * x0[idx] + sig.view(-1, 1, 1, 1) * eps
                loss = self._pair_loss(xs, x0[idx], sig, pe_all[idx.to(self.dev)], pooled_all[idx.to(self.dev)])
                (loss * (len(chunk) / len(pairs))).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return fn, contextlib.nullcontext

    def close(self) -> None:
        self._dit = self._vae = self._clip = self.opt = self.lora = None


# == the package's own path ======================================================================
class _Pipe:
    """What TrainRank uses of a StableDiffusion3Pipeline: the scheduler, the VAE, the DiT's config
    and encode_prompt (here: a fixed random embedding per prompt at the real text shapes)."""

    def __init__(self, transformer, vae, S: Shapes, dtype, device):
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler()
        self.S, self.dtype, self.device = S, dtype, device

    def encode_prompt(self, prompt, prompt_2=None, prompt_3=None, device=None, do_classifier_free_guidance=False,
                      max_sequence_length=256, **_):
        torch = _torch()
        from hpcnft.determinism import stable_hash

        g = torch.Generator().manual_seed(stable_hash("bench_prompt", prompt))
        pe = torch.randn(1, CLIP_TOKENS + max_sequence_length, self.S.dit["joint_attention_dim"], generator=g)
        pooled = torch.randn(1, self.S.dit["pooled_projection_dim"], generator=g)
        return pe.to(device or self.device, self.dtype), None, pooled.to(device or self.device, self.dtype), None


_MESH = []


def world1_mesh(dev):
    """A one-rank process group and train mesh, as hpcnft.distributed.setup makes for world 1."""
    if not _MESH:
        torch = _torch()
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from hpcnft.distributed import free_port

        if not dist.is_initialized():
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kwargs = {"device_id": dev} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    **kwargs)
        _MESH.append(DeviceMesh(dev.type, torch.tensor([0])))
    return _MESH[0]


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def bench_config(S: Shapes, dev, overrides: dict):
    """The recipe at the bench's shapes, world 1 (reward colocated), determinism off, plus overrides."""
    from hpcnft.config import ConfigError, load_config

    base = {
        "rollout.height": S.size, "rollout.width": S.size, "rollout.prompts_per_step": S.prompts,
        "rollout.samples_per_prompt": S.per_prompt, "rollout.num_steps": S.num_steps,
        "rollout.max_sequence_length": S.t5_tokens, "rollout.batch_size": max(S.rollout_batches),
        "train.micro_batch": max(S.micro_batches), "train.grad_checkpointing": False,
        "train.precision": "fp16" if dev.type == "cuda" else "fp32",
        "train.lora_rank": S.lora_rank, "train.lora_alpha": S.lora_alpha,
        "layout.train_ranks": 1, "layout.reward_ranks": 0, "layout.device": dev.type,
        "determinism.enabled": False, "models.sd3_dir": "", "models.pickscore_dir": "",
        "models.pickscore_processor_dir": "", "data.train_prompts": "builtin:tiny_train_prompts.txt",
        "data.eval_prompts": "builtin:tiny_eval_prompts.txt", "steps": 1000,
    }
    base.update(overrides)
    try:
        return load_config(S.recipe, [f"{k}={_toml(v)}" for k, v in base.items()])
    except ConfigError as e:
        raise UsageError(str(e)) from None


class HpcnftStack:
    """The package's code path: Policy + Trainer + TrainRank, sampler and reward functions."""

    def __init__(self, key: str, label: str, S: Shapes, dev, overrides: dict):
        self.key, self.label, self.S, self.dev = key, label, S, dev
        self.overrides = dict(overrides)
        self.cfg = bench_config(S, dev, overrides)
        self.config = {"overrides": {k: v for k, v in overrides.items()}}
        self._policy = self._vae = self._scorer = self._tr = None
        self.step_no = 0
        self.last_metrics = {}

    @property
    def dtype(self):
        from hpcnft.trainer import AUTOCAST_DTYPES

        return AUTOCAST_DTYPES.get(self.cfg.train.precision, _torch().float32)

    @property
    def policy(self):
        if self._policy is None:
            from hpcnft.sampler import sigma_grid
            from hpcnft.trainer import Policy, Trainer

            mesh = world1_mesh(self.dev)
            self._policy = Policy(self.cfg, build_dit(self.S, self.dev), self.dev, mesh)
            self.trainer = Trainer(self.cfg, self._policy, None, 1)
            self.sigmas = sigma_grid(scheduler(), self.cfg.rollout.num_steps)
        return self._policy

    @property
    def vae(self):
        if self._vae is None:
            from hpcnft import fast

            self._vae = fast.prepare_vae(build_vae(self.S, self.dev), self.cfg)  # loaded in fp32, as the runner does
        return self._vae

    @property
    def scorer(self):
        if self._scorer is None:
            from hpcnft import fast
            from hpcnft.reward import PickScoreScorer

            self._scorer = fast.prepare_scorer(PickScoreScorer(clip_processor(), build_clip(self.S, self.dev), self.dev),
                                               self.cfg)
        return self._scorer

    @property
    def train_rank(self):
        if self._tr is None:
            from hpcnft.distributed import Topology
            from hpcnft.loop import TrainRank
            from hpcnft.reward_service import LocalRewardClient

            policy = self.policy
            topo = Topology(0, 1, 0, [0], [], "bench", "nccl" if self.dev.type == "cuda" else "gloo", self.dev)
            pipe = _Pipe(policy.transformer, self.vae, self.S, self.dtype, self.dev)
            self._tr = TrainRank(self.cfg, topo, None, world1_mesh(self.dev), LocalRewardClient(self._score_fn()),
                                 pipe, policy, self.trainer)
        return self._tr

    def _score_fn(self):
        """runner.make_score_fn's rule: the prompt of sample i of step s from the train stream."""
        from hpcnft.prompts import PromptStream, read_prompt_file

        cfg, scorer = self.cfg, self.scorer
        stream = PromptStream(read_prompt_file(cfg.data.train_prompts, "data.train_prompts"), cfg.data.shuffle,
                              cfg.train.seed)
        p, g = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt

        def score(kind, step, images, ids):
            return scorer([stream.at((step - 1) * p + i // g) for i in ids], images)
        return score

    def _cond(self, n: int, seed: int = 0):
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        pe = torch.randn(n, self.S.text_tokens, self.S.dit["joint_attention_dim"], generator=g).to(self.dtype)
        pooled = torch.randn(n, self.S.dit["pooled_projection_dim"], generator=g).to(self.dtype)
        return pe, pooled

    def _latent(self, n: int, seed: int = 0):
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        h = self.S.size // 8
        return torch.randn(n, self.S.dit["in_channels"], h, h, generator=g)

    def rollout_forward(self, b: int):
        """One DiT forward of the rollout: sampler.velocity under the old weights and autocast."""
        torch = _torch()
        from hpcnft.sampler import velocity

        policy = self.policy
        x = self._latent(b).to(self.dev)
        s = self.sigmas[3].expand(b).to(self.dev)
        pe, pooled = (t.to(self.dev) for t in self._cond(b))

        def fn():
            with torch.no_grad(), policy.autocast():
                velocity(policy.transformer, x, s, pe, pooled, policy.compute_dtype)
        return fn, policy.old_weights

    def vae_decode(self, b: int):
        from hpcnft.sampler import decode_to_uint8

        latents = self._latent(b).to(self.dev)
        vae = self.vae
        return (lambda: decode_to_uint8(vae, latents, self.cfg.rollout.uint8_rounding)), contextlib.nullcontext

    def pickscore(self, n: int):
        images, prompts = random_images(self.S, n), prompt_list(n)
        scorer = self.scorer
        return (lambda: scorer(prompts, images)), contextlib.nullcontext

    def train_pairs(self, mb: int):
        """Trainer.step on `mb` samples with TRAIN_K sigmas each: TRAIN_K micro-batches of `mb`."""
        torch = _torch()
        from hpcnft import nft
        from hpcnft.trainer import PairBatch

        self.policy
        cfg = self.cfg
        x0 = self._latent(mb, seed=7)
        pe, pooled = self._cond(mb, seed=8)
        adv = torch.randn(mb, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        batch = PairBatch(x0, pe, pooled, adv, nft.optimality_r(adv, cfg.nft.adv_clip_max), list(range(mb)),
                          mb * TRAIN_K)

        @contextlib.contextmanager
        def ctx():
            saved = (cfg.nft.timestep_fraction, cfg.train.micro_batch)
            cfg.nft.timestep_fraction, cfg.train.micro_batch = TRAIN_K / cfg.rollout.num_steps, mb
            try:
                yield
            finally:
                cfg.nft.timestep_fraction, cfg.train.micro_batch = saved

        def fn():
            self.step_no += 1
            self.last_metrics = self.trainer.step(batch, self.sigmas, self.step_no)
        return fn, ctx, mb * TRAIN_K

    def close(self) -> None:
        self._policy = self._vae = self._scorer = self._tr = self.trainer = None

    def iteration(self):
        tr = self.train_rank

        def fn():
            self.step_no += 1
            metrics, _ = tr.iteration(self.step_no)
            self.last_metrics = {k: v for k, v in metrics.items() if k.startswith("perf/") or k.startswith("train/")}
        return fn, contextlib.nullcontext


# == the bench run =================================================================================
def _fmt_ms(s):
    if s is None:
        return "—"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


class Bench:
    def __init__(self, args, S: Shapes, dev):
        self.args, self.S, self.dev = args, S, dev
        self.t0 = time.perf_counter()
        self.doc = {"schema": SCHEMA, "command": "hpcnft bench " + " ".join(args.argv),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "shapes": S.name, "environment": environment(dev), "ceiling": {}, "stacks": {}, "levers": [],
                    "errors": [], "skipped": []}

    # -- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.args.budget_s is not None and self.elapsed() > self.args.budget_s

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.doc, f, indent=1, default=str)
            os.replace(tmp, self.args.json)

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", file=sys.stderr, flush=True)

    @property
    def ceiling(self) -> float:
        return self.doc["ceiling_tflops"] * 1e12

    # -- one phase of one stack
    def phase(self, rec: dict, name: str, make, unit: str, per: int, warm=None, reps=None, flops=True) -> dict | None:
        torch = _torch()
        if self.over_budget():
            self.doc["skipped"].append(f"{rec['key']}:{name} (budget)")
            return None
        warm = self.S.warm if warm is None else warm
        reps = self.S.reps if reps is None else reps
        try:
            made = make()
            fn, ctx = made[0], made[1]
            with ctx():
                m = measure(fn, self.dev, warm, reps)
                if flops:
                    m["flops"] = count_flops(fn)
        except Exception as e:  # noqa: BLE001 - one failing phase must not lose the others
            msg = f"{rec['key']}:{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            self.doc["errors"].append(msg)
            rec["phases"][name] = {"error": msg}
            self.log("ERROR " + msg)
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            self.save()
            return None
        m.update(unit=unit, per=per, per_unit_s=m["s"] / per)
        if m.get("flops"):
            m["tflops"] = m["flops"] / m["s"] / 1e12
            m["mfu"] = m["flops"] / m["s"] / self.ceiling
        rec["phases"][name] = m
        self.log(f"{rec['key']:<16} {name:<18} {_fmt_ms(m['s']):>10} per call, {_fmt_ms(m['per_unit_s']):>10} per "
                 f"{unit}" + (f", {m['tflops']:.0f} TFLOP/s, MFU {m['mfu'] * 100:.1f} %" if m.get("mfu") else "")
                 + (f", peak {m['peak_gib']:.1f} GiB" if "peak_gib" in m else ""))
        self.save()
        return m

    def run_stack(self, stack, phases: list[tuple], iteration: bool, extra: dict | None = None) -> dict:
        rec = {"key": stack.key, "label": stack.label, "config": stack.config, "phases": {}}
        if extra:
            rec.update(extra)
        self.doc["stacks"][stack.key] = rec
        self.log(f"stack {stack.key}: {stack.label}")
        for ph in phases:
            self.phase(rec, *ph)
        if iteration:
            S = self.S
            eager = stack.key == "eager"  # the eager iteration is the slow one: once, after its warm phases
            m = self.phase(rec, "iteration", stack.iteration, "iteration", 1, warm=0 if eager else self.args.iteration_warm,
                           reps=1 if eager else self.args.iteration_reps, flops=False)
            if m is not None:
                m.update(self._iteration_flops(rec))
                if getattr(stack, "last_metrics", None):
                    m["metrics"] = met = stack.last_metrics
                    # the package's own split of the (last) iteration: rollout incl. decode and reward, train
                    for part in ("rollout", "train"):
                        if m.get(f"{part}_flops") and met.get(f"perf/{part}_s"):
                            m[f"{part}_s"] = met[f"perf/{part}_s"]
                            m[f"{part}_mfu"] = m[f"{part}_flops"] / met[f"perf/{part}_s"] / self.ceiling
                m["samples"], m["pairs"] = S.samples, S.samples * int(S.num_steps * 0.99)
                self.save()
        return rec

    def _iteration_flops(self, rec: dict) -> dict:
        """Iteration FLOPs from the per-call counts of its phases at the stack's own batch sizes."""
        S, ph = self.S, rec["phases"]
        b = rec.get("rollout_batch") or max(S.rollout_batches)
        mb = rec.get("micro_batch") or max(S.micro_batches)
        parts = {"rollout_fwd": (ph.get(f"rollout_fwd_b{b}"), S.samples * S.num_steps / b),
                 "vae_decode": (ph.get("vae_decode"), S.samples / max(S.rollout_batches)),
                 "pickscore": (ph.get("pickscore"), 1),
                 "train": (ph.get(f"train_pair_mb{mb}"), S.samples * int(S.num_steps * 0.99) / (TRAIN_K * mb))}
        if any(p is None or not p.get("flops") for p, _ in parts.values()):
            return {}
        total = sum(p["flops"] * k for p, k in parts.values())
        t = ph["iteration"]["s"]
        out = {"flops": int(total), "flops_from": "phase counts x phase calls per iteration",
               "tflops": total / t / 1e12, "mfu": total / t / self.ceiling,
               "rollout_flops": int(sum(parts[k][0]["flops"] * parts[k][1] for k in ("rollout_fwd", "vae_decode",
                                                                                     "pickscore"))),
               "train_flops": int(parts["train"][0]["flops"] * parts["train"][1])}
        return out

    def phases_for(self, stack, rollout_batches, micro_batches, vae=True, pick=True) -> list[tuple]:
        S = self.S
        out = [(f"rollout_fwd_b{b}", (lambda b=b: stack.rollout_forward(b)), "forward sample", b)
               for b in rollout_batches]
        if vae:
            b = max(S.rollout_batches)
            out.append(("vae_decode", lambda: stack.vae_decode(b), "image", b))
        if pick:
            out.append(("pickscore", lambda: stack.pickscore(S.samples), "image", S.samples))
        for mb in micro_batches:
            out.append((f"train_pair_mb{mb}", (lambda mb=mb: stack.train_pairs(mb)), "pair", TRAIN_K * mb,
                        max(1, S.warm - 1), max(2, S.reps - 2)))
        return out

    def free(self, stack) -> None:
        torch = _torch()
        stack.close()
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        try:
            import torch._dynamo

            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass

    # -- the whole run
    def run(self) -> dict:
        S, args, dev = self.S, self.args, self.dev
        self.log(f"shapes {S.name} on {self.doc['environment']['device']}")
        self.doc["ceiling"] = matmul_ceiling(dev, S.ceiling_n)
        key = "fp16_tflops" if dev.type == "cuda" else "fp32_tflops"
        self.doc["ceiling_tflops"] = self.doc["ceiling"][key]
        self.doc["ceiling_what"] = f"dense matmul {S.ceiling_n}^3, {key.split('_')[0]}, measured in this process"
        self.log(f"ceiling {self.doc['ceiling']}")
        self.save()

        fast_over = fast_overrides(S, dev, args.overrides)
        fast_b = int(fast_over.get("rollout.batch_size", max(S.rollout_batches)))
        fast_mb = int(fast_over.get("train.micro_batch", max(S.micro_batches)))
        if args.baseline:
            eager = EagerStack(S, dev)
            self.run_stack(eager, self.phases_for(eager, S.rollout_batches, S.micro_batches), args.iteration != "none",
                           {"rollout_batch": eager.rollout_batch, "micro_batch": eager.mb})
            self.free(eager)
        fast = HpcnftStack("hpcnft_fast", "hpcnft path, levers of hpcnft.fast.FAST", S, dev, fast_over)
        fb = sorted({fast_b} | (set(S.rollout_batches) if args.all_shapes else set()))
        fm = sorted({fast_mb} | (set(S.micro_batches) if args.all_shapes else set()))
        self.run_stack(fast, self.phases_for(fast, fb, fm), args.iteration != "none",
                       {"rollout_batch": fast_b, "micro_batch": fast_mb})
        self.free(fast)
        if not args.no_default:
            default = HpcnftStack("hpcnft_default", "hpcnft path, every perf lever off", S, dev, {})
            self.run_stack(default, self.phases_for(default, S.rollout_batches, S.micro_batches),
                           args.iteration == "all",
                           {"rollout_batch": max(S.rollout_batches), "micro_batch": max(S.micro_batches)})
            self.free(default)
        for lever in expand_levers(args.levers, dev, S):
            if self.over_budget():
                self.doc["skipped"].append(f"lever {lever} (budget)")
                continue
            self.run_lever(lever)
        self.finish()
        return self.doc

    def finish(self) -> None:
        """Speed-ups against the eager stack beside each phase, and the targets."""
        eager = self.doc["stacks"].get("eager", {}).get("phases", {})
        for rec in list(self.doc["stacks"].values()) + self.doc["levers"]:
            if rec.get("key") == "eager":
                continue
            for name, m in rec["phases"].items():
                if "s" in m and eager.get(name, {}).get("s"):
                    m["speedup_vs_eager"] = eager[name]["per_unit_s"] / m["per_unit_s"]
        self.doc["targets"] = targets(self.doc, self.S)
        self.save()

    def run_lever(self, lever: dict) -> None:
        """hpcnft default plus `lever` (one lever; compile comes with skip_single_rank_fsdp)."""
        S = self.S
        name = ",".join(f"{k}={_toml(v)}" for k, v in lever.items())
        stack = HpcnftStack(f"lever:{name}", f"hpcnft default + {name}", S, self.dev, lever)
        k, v = next(iter(lever.items()))
        b, mb = max(S.rollout_batches), max(S.micro_batches)
        if k == "rollout.batch_size":
            phases = self.phases_for(stack, [int(v)], [], vae=False, pick=False)
        elif k in ("perf.vae_channels_last", "perf.vae_dtype"):
            phases = self.phases_for(stack, [], [], vae=True, pick=False)
        elif k == "perf.pickscore_dtype":
            phases = self.phases_for(stack, [], [], vae=False, pick=True)
        elif k == "perf.old_pass_batch":
            phases = self.phases_for(stack, [], [min(S.micro_batches)], vae=False, pick=False)
        elif k == "train.grad_checkpointing":
            phases = self.phases_for(stack, [], [mb], vae=False, pick=False)
        else:
            phases = self.phases_for(stack, [b], [mb], vae=False, pick=False)
        rec = self.run_stack(stack, phases, False)
        self.doc["stacks"].pop(stack.key, None)
        rec["lever"] = name
        base = self.doc["stacks"].get("hpcnft_default", {}).get("phases", {})
        for ph, m in rec["phases"].items():
            if "s" in m and base.get(ph, {}).get("s"):
                m["speedup_vs_default"] = base[ph]["per_unit_s"] / m["per_unit_s"]
        self.doc["levers"].append(rec)
        self.free(stack)
        self.save()


LEVER_SWEEP = [
    {"perf.attention_backend": "flash"}, {"perf.attention_backend": "cudnn"},
    {"perf.skip_single_rank_fsdp": True}, {"perf.merge_lora_nograd": True}, {"perf.old_pass_batch": 16},
    {"rollout.batch_size": 32}, {"perf.vae_dtype": "fp16"}, {"perf.vae_channels_last": True},
    {"perf.pickscore_dtype": "fp16"}, {"train.grad_checkpointing": True},
    {"perf.compile_blocks": True, "perf.skip_single_rank_fsdp": True},
]


def _parse_value(raw: str):
    import tomllib

    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def expand_levers(specs: list[str], dev, S: Shapes) -> list[dict]:
    """--levers items -> one dict of config overrides per measurement. An item is 'all' (the
    standard sweep) or KEY=VALUE[,KEY=VALUE...]; a KEY without a dot is a perf.* key."""
    out = []
    for spec in specs or []:
        if spec == "all":
            for lever in LEVER_SWEEP:
                lever = dict(lever)
                if dev.type != "cuda" and set(lever) & set(CUDA_ONLY_KEYS()):
                    continue
                if "rollout.batch_size" in lever:
                    lever["rollout.batch_size"] = 2 * max(S.rollout_batches)
                    if lever["rollout.batch_size"] > S.samples:
                        continue
                if "perf.old_pass_batch" in lever:
                    lever["perf.old_pass_batch"] = max(S.rollout_batches)
                out.append(lever)
            continue
        lever = {}
        for item in spec.split(","):
            if "=" not in item:
                raise UsageError(f"--levers {spec!r}: expected KEY=VALUE[,KEY=VALUE...] or 'all'")
            k, raw = item.split("=", 1)
            k = k.strip()
            lever[k if "." in k else "perf." + k] = _parse_value(raw)
        out.append(lever)
    return out


def CUDA_ONLY_KEYS():  # noqa: N802 - a constant, read lazily so the CLI stays light
    from hpcnft.fast import CUDA_ONLY

    return CUDA_ONLY


def fast_overrides(S: Shapes, dev, overrides: list[str]) -> dict:
    from hpcnft.fast import FAST

    out = dict(FAST)
    if S.name != "sd35m":  # FAST's batch sizes are for the real shapes
        out["rollout.batch_size"], out["train.micro_batch"] = max(S.rollout_batches), max(S.micro_batches)
        out["perf.old_pass_batch"] = max(S.rollout_batches)
    if dev.type != "cuda":  # compile and SDPA backends are measured on GPUs; half precision too
        for k in CUDA_ONLY_KEYS() + ("perf.vae_dtype", "perf.pickscore_dtype"):
            out.pop(k, None)
    for item in overrides or []:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        k, raw = item.split("=", 1)
        out[k.strip()] = _parse_value(raw)
    return out


def targets(doc: dict, S: Shapes) -> dict:
    """The acceptance targets of issue 7 (sd35m on one H200), checked against this run."""
    st = doc["stacks"]
    fast = st.get("hpcnft_fast", {})
    ph = fast.get("phases", {})
    b, mb = fast.get("rollout_batch"), fast.get("micro_batch")
    out = {}

    def put(name, value, goal, ok):
        out[name] = {"value": value, "target": goal, "met": None if value is None else bool(ok(value))}
    fwd = ph.get(f"rollout_fwd_b{b}", {}).get("mfu")
    put("rollout_fwd_mfu", fwd, ">= 0.70", lambda v: v >= 0.70)
    tr = ph.get(f"train_pair_mb{mb}", {})
    put("train_pair_mfu", tr.get("mfu"), ">= 0.65", lambda v: v >= 0.65)
    put("train_peak_gib_mb16", tr.get("peak_gib") if mb == 16 else None, "<= 40", lambda v: v <= 40)
    it = ph.get("iteration", {}).get("s")
    put("iteration_s", it, "<= 13", lambda v: v <= 13)
    eager_it = st.get("eager", {}).get("phases", {}).get("iteration", {}).get("s")
    put("iteration_speedup_vs_eager", eager_it / it if (it and eager_it) else None, ">= 2.25", lambda v: v >= 2.25)
    if S.name != "sd35m":
        for v in out.values():
            v["met"] = None  # the targets are for the real shapes only
    return out


def environment(dev) -> dict:
    torch = _torch()
    env = {"device": "cpu: " + (platform.processor() or platform.machine()) + f", {os.cpu_count()} cores",
           "torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    for mod in ("diffusers", "transformers", "peft"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    return env


# == report ===========================================================================================
PHASE_ORDER = ["rollout_fwd_b4", "rollout_fwd_b8", "rollout_fwd_b16", "rollout_fwd_b32", "vae_decode", "pickscore",
               "train_pair_mb4", "train_pair_mb8", "train_pair_mb16", "iteration"]


def _cell(m: dict | None) -> str:
    if not m:
        return "—"
    if "error" in m:
        return "error"
    text = _fmt_ms(m["per_unit_s"]) + (f"/{m['unit'].split()[0]}" if m["per"] > 1 or m["unit"] != "iteration" else "")
    if m.get("mfu"):
        text += f" · {m['mfu'] * 100:.0f} %"
    if m.get("peak_gib") is not None and m["unit"] == "pair":
        text += f" · {m['peak_gib']:.1f} GiB"
    return text


def markdown(doc: dict) -> str:
    st = doc["stacks"]
    cols = [k for k in ("eager", "hpcnft_default", "hpcnft_fast") if k in st]
    names = [n for n in PHASE_ORDER if any(n in st[c]["phases"] for c in cols)]
    names += sorted({n for c in cols for n in st[c]["phases"]} - set(names))
    env = doc["environment"]
    lines = [f"`{doc['command']}` on {env['device']} (torch {env['torch']}), {doc['date']}; "
             f"ceiling: {doc.get('ceiling_what', '')} = {doc.get('ceiling_tflops', 0):.4g} TFLOP/s. "
             "Cells: time per unit · MFU against that ceiling (FLOPs counted over the phase) · peak memory.", "",
             "| phase | " + " | ".join(st[c]["label"] for c in cols) + " | fast vs eager |",
             "|---|" + "---|" * (len(cols) + 1)]
    for n in names:
        cells = [_cell(st[c]["phases"].get(n)) for c in cols]
        ratio = "—"
        e, f = st.get("eager", {}).get("phases", {}).get(n), st.get("hpcnft_fast", {}).get("phases", {}).get(n)
        if e and f and "s" in e and "s" in f:
            ratio = f"{e['per_unit_s'] / f['per_unit_s']:.2f}×"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")
    if doc.get("levers"):
        lines += ["", "One lever at a time on top of hpcnft default (speed-up against hpcnft default):", "",
                  "| lever | phase | time per unit | MFU | peak GiB | vs default |", "|---|---|---|---|---|---|"]
        for rec in doc["levers"]:
            for n, m in rec["phases"].items():
                if "error" in m:
                    lines.append(f"| {rec['lever']} | {n} | error | | | |")
                    continue
                lines.append(f"| {rec['lever']} | {n} | {_fmt_ms(m['per_unit_s'])} | "
                             f"{m['mfu'] * 100:.1f} % | {m.get('peak_gib', 0):.1f} | "
                             + (f"{m['speedup_vs_default']:.2f}× |" if "speedup_vs_default" in m else "— |")
                             if m.get("mfu") else f"| {rec['lever']} | {n} | {_fmt_ms(m['per_unit_s'])} | | | |")
    if doc.get("targets"):
        lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
        for k, t in doc["targets"].items():
            v = t["value"]
            vs = "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            lines.append(f"| {k} | {vs} | {t['target']} | {'—' if t['met'] is None else ('yes' if t['met'] else 'NO')} |")
    if doc.get("errors"):
        lines += ["", "Errors: " + "; ".join(doc["errors"])]
    if doc.get("skipped"):
        lines += ["", "Skipped: " + ", ".join(doc["skipped"])]
    return "\n".join(lines)


# == CLI ==============================================================================================
def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", choices=sorted(SHAPES), default="sd35m",
                   help="sd35m: the real SD3.5-M/VAE/CLIP-H shapes (needs CUDA); tiny: the tiny models (CPU is fine)")
    p.add_argument("--baseline", action="store_true",
                   help="also measure the plain diffusers + peft eager stack, and print the ratios")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON here (rewritten after every phase)")
    p.add_argument("--levers", nargs="*", default=[], metavar="KEY=VALUE",
                   help="single levers measured one at a time against hpcnft default, e.g. "
                        "attention_backend=cudnn perf.compile_blocks=true, or 'all' for the standard sweep")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change the 'hpcnft fast' combination (default: hpcnft.fast.FAST), repeatable")
    p.add_argument("--iteration", choices=["fast", "all", "none"], default="fast",
                   help="which stacks run a whole iteration: fast (+ eager with --baseline), all, none")
    p.add_argument("--iteration-warm", type=int, default=0,
                   help="untimed whole iterations of the hpcnft stacks first (default 0: their phases warmed them)")
    p.add_argument("--iteration-reps", type=int, default=1,
                   help="timed whole iterations of the hpcnft stacks, median (default 1; eager: always 1)")
    p.add_argument("--all-shapes", action="store_true",
                   help="measure 'hpcnft fast' at every rollout batch and micro-batch too (more compiles)")
    p.add_argument("--no-default", action="store_true", help="skip the 'hpcnft default' stack")
    p.add_argument("--budget-s", type=float, help="skip the remaining measurements after this many seconds")


def main(name: str, args: argparse.Namespace) -> int:
    args.argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv[1:2] else []
    import torch

    S = SHAPES[args.shapes]()
    if args.shapes == "sd35m" and not torch.cuda.is_available():
        raise UsageError("--shapes sd35m needs a CUDA device and none is available (use --shapes tiny on a CPU)")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    for over in expand_levers(args.levers, dev, S) + [fast_overrides(S, dev, args.overrides)]:
        bench_config(S, dev, over)  # bad specs and config values fail before anything is built
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d):
            raise UsageError(f"--json {args.json!r}: folder {d!r} does not exist")
    from hpcnft.models import quiet_libraries

    quiet_libraries()
    bench = Bench(args, S, dev)
    try:
        doc = bench.run()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(markdown(doc))
    return 0
