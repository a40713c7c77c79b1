"""The reference baseline: a plain diffusers + peft eager stack, written without package code.

SD3 (SD3Transformer2DModel) as StableDiffusion3Pipeline calls it; FLUX.1 as FluxPipeline does:
the latents packed 2x2 into tokens with their image ids and zero text ids, the DiT's time as
sigma, the guidance value embedded (no classifier-free guidance), FluxPipeline's shifted sigma
grid; Qwen-Image as QwenImagePipeline does: the latents packed 2x2, the text mask and the image
shapes, the time as sigma, its shifted sigma grid, the 3D VAE's latents mean and std undone; Wan2.1
as WanPipeline does: the DiT on the video latents [B, 16, F', h, w] with the time as 1000 sigma and
the UMT5 embeddings, classifier-free guidance (where the shapes guide) as two DiT calls, the
conditional one first, the flow-shifted sigma grid, the latents mean and std undone and every frame
decoded by the VAE in fp32 (its documented use); PickScore of each frame, the mean per video.
All train on the unpacked latents with the same NFT loss."""
from __future__ import annotations

import contextlib

from hpcnft.bench.random_models import build_clip, build_dit, build_dit_on_host, build_vae, clip_processor
from hpcnft.bench.shapes import TRAIN_K, Shapes, _torch, prompt_list, random_images, scheduler

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
FLUX_GUIDANCE = 3.5  # FluxPipeline's default for FLUX.1-dev, as the flux1dev recipe's rollout.guidance_scale


class EagerStack:
    """What a plain diffusers + peft script does (the reference baseline), no package code."""

    key, label = "eager", "plain diffusers + peft, eager"

    def __init__(self, S: Shapes, dev):
        torch = _torch()
        self.S, self.dev = S, dev
        self.flux = S.family == "flux"
        self.dtype = getattr(torch, DTYPES[S.precision]) if dev.type == "cuda" else torch.float32
        self.mb = max(S.micro_batches)
        self.rollout_batch = max(S.rollout_batches)
        self.config = {"dtype": str(self.dtype), "rollout_batch": self.rollout_batch, "micro_batch": self.mb,
                       "attention": "default SDPA without cuDNN" if self.flux else "default SDPA",
                       "tf32": dev.type == "cuda", "family": S.family,
                       "lora_targets": list(S.lora_targets), "grad_checkpointing": S.grad_checkpointing}
        if self.flux:
            self.config["guidance"] = FLUX_GUIDANCE
        if S.cfg_scale > 1.0:
            self.config["cfg_scale"] = S.cfg_scale
        if S.video:
            self.config["num_frames"] = S.num_frames
        if S.family == "wan":
            self.config["vae_dtype"] = "fp32"
        self._dit = self._vae = self._clip = None
        self._ids = {}  # FLUX's image and text ids, by shape
        self.sigmas = None
        self.k = S.trained_steps  # the trained sigmas per sample (the recipe's timestep_fraction)

    # lazily built parts
    @property
    def dit(self):
        if self._dit is None:
            torch = _torch()
            from peft import LoraConfig

            if self.S.host_build:  # cast on the host: the fp32 DiT outgrows the card
                dit = build_dit_on_host(self.S).to(self.dtype).to(self.dev).eval().requires_grad_(False)
            else:
                dit = build_dit(self.S, self.dev).to(self.dtype).eval().requires_grad_(False)
            dit.add_adapter(LoraConfig(r=self.S.lora_rank, lora_alpha=self.S.lora_alpha, init_lora_weights="gaussian",
                                       target_modules=list(self.S.lora_targets)))
            for n, p in dit.named_parameters():
                if "lora" in n:
                    p.data = p.data.float()
                    p.requires_grad_(True)
            if self.S.grad_checkpointing:
                dit.enable_gradient_checkpointing()
            if self.flux:  # what a plain user must do too: cuDNN's SDPA backward fails at FLUX's shapes
                from hpcnft.models.families.flux import avoid_cudnn_attention

                avoid_cudnn_attention(dit)
            self.lora = [p for p in dit.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(self.lora, lr=3e-4, weight_decay=1e-4)
            self._dit = dit
            self.sigmas = self._sigma_grid().to(self.dev, torch.float32)
        return self._dit

    def _sigma_grid(self):
        """The scheduler's sigmas as the family's pipeline sets them for num_steps steps."""
        sched = scheduler(self.S)
        if self.S.family in ("sd3", "wan"):  # WanPipeline's too: the scheduler's static flow shift
            sched.set_timesteps(self.S.num_steps)
            return sched.sigmas
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # QwenImagePipeline's is the same

        _, h, w = self.S.latent_shape
        c = sched.config  # FluxPipeline, QwenImagePipeline: linspace(1, 1/N, N), shifted by mu of the token count
        mu = calculate_shift((h // 2) * (w // 2), c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                             c.max_shift)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / self.S.num_steps, self.S.num_steps), mu=mu)
        return sched.sigmas

    @property
    def vae(self):
        if self._vae is None:  # Wan's in fp32, as WanPipeline's documented use loads it beside the bf16 DiT
            self._vae = build_vae(self.S, self.dev).to(_torch().float32 if self.S.family == "wan" else self.dtype)
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
        pe, pooled = self.S.conditioning(n, seed, self.dtype)  # Qwen-Image: its text mask for the pooled
        return pe.to(self.dev), pooled.to(self.dev)

    def _latent(self, n: int, seed: int = 0):
        """VAE latents [n, 16, h, w] (FLUX's unpacked, as FluxPipeline draws its noise; Wan's
        [n, 16, F', h, w])."""
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, *self.S.latent_shape, generator=g).to(self.dev)

    # rollout: the base DiT in half precision (adapters off, as in the reference baseline)
    def _velocity(self, x, sigma, pe, pooled):
        if self.flux:
            return self._flux_velocity(x, sigma, pe, pooled)
        if self.S.family == "qwen_image":
            return self._qwen_velocity(x, sigma, pe, pooled)
        if self.S.family == "wan":  # WanPipeline: the time as 1000 sigma, the text alone
            return self.dit(hidden_states=x.to(self.dtype), timestep=sigma * 1000.0, encoder_hidden_states=pe,
                            return_dict=False)[0]
        return self.dit(hidden_states=x.to(self.dtype), timestep=sigma * 1000.0, encoder_hidden_states=pe,
                        pooled_projections=pooled, return_dict=False)[0]

    def _guided_velocity(self, x, sigma, pe, pooled, neg):
        """The rollout's velocity (fp32): with `neg` (the negative prompt's embeddings), WanPipeline's
        classifier-free guidance, the conditional call first, combined in the DiT's dtype."""
        v = self._velocity(x, sigma, pe, pooled)
        if neg is not None:
            v_neg = self._velocity(x, sigma, neg[0].expand_as(pe), neg[1].expand(len(pooled), -1))
            v = v_neg + self.S.cfg_scale * (v - v_neg)
        return v.float()

    def _flux_velocity(self, x, sigma, pe, pooled):
        """FluxPipeline's DiT call on unpacked latents x [B, C, h, w]: packed 2x2 into tokens, the
        time as sigma, the guidance embedded, the velocity unpacked back."""
        torch = _torch()
        from diffusers import FluxPipeline

        b, c, h, w = x.shape
        tokens = FluxPipeline._pack_latents(x.to(self.dtype), b, c, h, w)
        key = (h, w, pe.shape[1])
        if key not in self._ids:  # FluxPipeline makes them once per call, before its loop
            self._ids[key] = (FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, self.dtype),
                              torch.zeros(pe.shape[1], 3, device=x.device, dtype=self.dtype))
        img_ids, txt_ids = self._ids[key]
        guidance = torch.full([1], FLUX_GUIDANCE, device=x.device, dtype=torch.float32).expand(b)
        out = self.dit(hidden_states=tokens, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                       encoder_hidden_states=pe, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)

    def _qwen_velocity(self, x, sigma, pe, mask):
        """QwenImagePipeline's DiT call on unpacked latents: packed 2x2, the time as sigma, the text
        mask and the image shapes, the velocity unpacked back."""
        from diffusers import QwenImagePipeline

        b, c, h, w = x.shape
        tokens = QwenImagePipeline._pack_latents(x.to(self.dtype), b, c, h, w)
        out = self.dit(hidden_states=tokens, timestep=sigma, encoder_hidden_states=pe, encoder_hidden_states_mask=mask,
                       img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return QwenImagePipeline._unpack_latents(out, h * 8, w * 8, 8)[:, :, 0]

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
        """uint8 images [B, H, W, 3] (Wan's videos: frames [B, F, H, W, 3])."""
        torch = _torch()
        vae, qwen = self.vae, self.S.family == "qwen_image"
        dtype = vae.dtype  # the pipelines cast the latents to the VAE's
        with torch.no_grad():
            if qwen or self.S.family == "wan":  # their pipelines: latents_mean / latents_std undone
                c = vae.config.z_dim
                mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents.device, dtype)
                inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(latents.device, dtype)
                z = latents.to(dtype)
                z = (z.unsqueeze(2) if qwen else z) / inv_std + mean  # QwenImagePipeline: one frame
                img = vae.decode(z, return_dict=False)[0]
                img = (img[:, :, 0] if qwen else img).float()
            else:
                z = latents.to(dtype) / vae.config.scaling_factor + vae.config.shift_factor
                img = vae.decode(z, return_dict=False)[0].float()
            img = ((img / 2 + 0.5).clamp(0, 1) * 255.0).round().to(torch.uint8)
            return img.movedim(1, -1).contiguous().cpu()

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

    def _score_samples(self, prompts, samples):
        """PickScore of images, or of videos [n, F, H, W, 3]: each frame with its video's prompt, the mean per video."""
        if samples.dim() == 4:
            return self._score(prompts, samples)
        n, f = samples.shape[:2]
        return self._score([p for p in prompts for _ in range(f)], samples.flatten(0, 1)).view(n, f).mean(1)

    def pickscore(self, n: int):
        samples, prompts = random_images(self.S, n, videos=self.S.video), prompt_list(n)
        self.clip
        return (lambda: self._score_samples(prompts, samples)), contextlib.nullcontext

    # training: v_old (no grad) + v_theta + NFT loss + backward per micro-batch, then AdamW
    def _pair_loss(self, x_sigma, x0, sig, pe, pooled):
        torch = _torch()
        with self.autocast():
            with torch.no_grad():
                v_old = self._velocity(x_sigma, sig, pe, pooled).float()
            v = self._velocity(x_sigma, sig, pe, pooled).float()
        s = _per_sample(sig, x_sigma)
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
            sig = self.sigmas[torch.randint(0, self.k, (m,), generator=g)].to(self.dev)
            s = _per_sample(sig, x0)
            x_sigma = (1 - s) * x0 + s * eps
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
        """64 samples x 10 Euler steps, decodes, PickScores, then 576 pairs and one AdamW step (sd35m;
        the shapes' samples, steps and trained sigmas; CFG's two DiT calls a step where they guide)."""
        torch = _torch()
        S, b = self.S, self.rollout_batch
        n = S.samples
        k = self.k
        pe_all, pooled_all = self._cond(n, seed=11)
        neg = self._cond(1, seed=12) if S.cfg_scale > 1.0 else None  # the negative prompt's embeddings
        prompts = prompt_list(n)

        def fn():
            x0s, scores = [], []
            with self.rollout_mode(), torch.no_grad():
                for i in range(0, n, b):
                    x = self._latent(min(b, n - i), seed=100 + i)
                    for j in range(S.num_steps):
                        s = self.sigmas[j].expand(x.shape[0])
                        v = self._guided_velocity(x, s, pe_all[i:i + b], pooled_all[i:i + b], neg)
                        x = x + (self.sigmas[j + 1] - self.sigmas[j]) * v
                    x0s.append(x)
                    scores.append(self._score_samples(prompts[i:i + b], self._decode(x)))
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
                s = _per_sample(sig, eps)
                xs = (1 - s) * x0[idx] + s * eps
                loss = self._pair_loss(xs, x0[idx], sig, pe_all[idx.to(self.dev)], pooled_all[idx.to(self.dev)])
                (loss * (len(chunk) / len(pairs))).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return fn, contextlib.nullcontext

    def close(self) -> None:
        self._dit = self._vae = self._clip = self.opt = self.lora = None
        self._ids = {}


def _per_sample(sig, x):
    """Per-sample sigmas [B] shaped to broadcast over latents x [B, ...] (images' and videos')."""
    return sig.view(-1, *(1,) * (x.dim() - 1))
