"""Rollout sampling: flow-matching Euler ODE on the scheduler's sigma grid, seeded per sample.
What differs between base models (prompt encoding, the DiT's inputs, the grid's shift) is the
family's (hpcnft.models.families), known from the DiT's class.

The noise of sample i at step k is drawn on the CPU from a generator keyed by
stable_hash("rollout_noise", seed, k, i), so it does not depend on which rank or batch makes it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from hpcnft.common.determinism import stable_hash
from hpcnft.models.families import SD3, family_of


def sigma_grid(scheduler, num_steps: int) -> torch.Tensor:
    """SD3's: the scheduler's sigmas for `num_steps` steps, terminal 0 included (float32, CPU)."""
    return SD3.sigma_grid(scheduler, num_steps, None)


def initial_noise(shape: tuple[int, ...], seed: int, step: int, indices: list[int], purpose: str) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(stable_hash(purpose, seed, step, i)) for i in indices]
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in gens])


class NoiseAhead:
    """Initial noise for each of a list of chunks (futures, in order), drawn on the host by one
    worker thread while the caller goes on launching GPU work; pinned (`pin`) so that the copy to
    the GPU does not wait for the GPU to drain. Drawn between the rollout's chunks instead, it left
    the GPU idle ~25 ms per chunk at the real shapes. Same values as `initial_noise`."""

    def __init__(self):
        self._pool = None

    def draw(self, shape: tuple[int, ...], seed: int, step: int, parts: list[list[int]], purpose: str,
             pin: bool = False) -> list:
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcnft-noise-ahead")

        def one(indices):
            noise = initial_noise(shape, seed, step, indices, purpose)
            return noise.pin_memory() if pin else noise
        return [self._pool.submit(one, indices) for indices in parts]


@dataclass
class Conditioning:
    """The positive conditioning (token embeddings and the pooled embedding, or whatever second
    batch-first tensor the family's encode_prompt gives) for a batch (what the trainer reuses) and,
    with CFG, the negative."""
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    neg_prompt_embeds: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None


class PromptEncoder:
    """Encodes prompts one at a time (so batching never changes an embedding) and caches them in
    CPU memory: a run's cache grows to `cache_size` embeddings (2.7 MB each for SD3.5 at 256 T5
    tokens, 11 GB in all), which on the GPU would outgrow what an iteration was measured to need;
    a call copies its prompts' embeddings to `device`. `offload` (perf.text_encoders): the text
    encoders' weights stay in (pinned) CPU memory too; a device copy of them is made for each pass
    over prompts not yet cached and dropped after it (frozen weights: nothing is copied back).
    `prepare` encodes a step's (or an evaluation's) prompts in one such pass."""

    def __init__(self, pipe, max_sequence_length: int, device: torch.device, cfg: bool, cache_size: int = 4096,
                 offload: bool = False):
        self.pipe, self.msl, self.device, self.cfg = pipe, max_sequence_length, device, cfg
        self.family = family_of(pipe.transformer)
        self.cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cache_size = cache_size
        self.offload = offload
        self.passes = 0  # encoder passes over new prompts (each one device copy when offloaded)

    @contextlib.contextmanager
    def _encoders_on_device(self):
        if not self.offload:
            yield
            return
        tensors = [t for enc in self.family.text_encoders(self.pipe) for t in (*enc.parameters(), *enc.buffers())]
        if self.device.type == "cuda" and not all(t.is_pinned() for t in tensors):
            for t in tensors:  # once: pinned memory copies to the GPU at full speed, without staging
                t.data = t.data.pin_memory()
        host = [t.data for t in tensors]
        for t, h in zip(tensors, host):
            t.data = h.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            for t, h in zip(tensors, host):
                t.data = h

    @torch.no_grad()
    def _encode_missing(self, prompts: list[str]) -> None:
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        if not missing:
            return
        self.passes += 1
        with self._encoders_on_device():
            for prompt in missing:
                if len(self.cache) >= self.cache_size:
                    self.cache.pop(next(iter(self.cache)))
                pe, pooled = self.family.encode_prompt(self.pipe, prompt, self.msl, self.device)
                self.cache[prompt] = (pe.cpu(), pooled.cpu())

    def prepare(self, prompts: list[str]) -> None:
        """Encode what `prompts` need in one pass, so offloaded encoders come to the device once."""
        self._encode_missing(prompts + ([""] if self.cfg else []))

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._encode_missing([prompt])  # again only if a long call's own prompts were evicted
        pe, pooled = self.cache[prompt]
        return pe.to(self.device), pooled.to(self.device)

    def __call__(self, prompts: list[str]) -> Conditioning:
        self.prepare(prompts)
        pos = [self._encode_one(p) for p in prompts]
        cond = Conditioning(torch.cat([p[0] for p in pos]), torch.cat([p[1] for p in pos]))
        if self.cfg:
            neg_pe, neg_pooled = self._encode_one("")
            cond.neg_prompt_embeds = neg_pe.expand_as(cond.prompt_embeds)
            cond.neg_pooled = neg_pooled.expand_as(cond.pooled)
        return cond


def truncated_prompts(pipe, prompts: list[str], max_sequence_length: int) -> tuple[int, dict[str, int]]:
    """How many of `prompts` the text encoders cut, tokenized as encode_prompt does: the CLIP
    tokenizers at pipe.tokenizer_max_length (77) tokens, T5 at max_sequence_length, special tokens
    included. Returns (prompts cut by any encoder, {encoder: prompts it cuts})."""
    limits = family_of(pipe.transformer).token_limits(pipe, max_sequence_length)
    unique = list(dict.fromkeys(prompts))
    cut_by: dict[str, set[str]] = {}
    for name, tok, limit in limits:
        cut = cut_by.setdefault(name, set())
        for start in range(0, len(unique), 1024):
            part = unique[start:start + 1024]
            ids = tok(part, add_special_tokens=True, truncation=False)["input_ids"]
            cut.update(p for p, x in zip(part, ids) if len(x) > limit)
    cut_any = set().union(*cut_by.values()) if cut_by else set()
    return sum(p in cut_any for p in prompts), {name: sum(p in c for p in prompts) for name, c in cut_by.items()}


def velocity(transformer, x: torch.Tensor, sigma: torch.Tensor, prompt_embeds: torch.Tensor,
             pooled: torch.Tensor, dtype: torch.dtype, integer_timesteps: bool = False,
             guidance: float = 1.0) -> torch.Tensor:
    """The DiT's velocity at latents x [B, C, h, w] and flow time sigma ([B]), shaped like x: the
    timestep on the DiT's own scale (truncated 1000 sigma with `integer_timesteps`), and
    `guidance` embedded where the family's DiT embeds it (FLUX.1-dev)."""
    return family_of(transformer).velocity(transformer, x, sigma, prompt_embeds, pooled, dtype, integer_timesteps,
                                           guidance)


def guided_velocity(transformer, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float,
                    dtype: torch.dtype, autocast, integer_timesteps: bool = False,
                    detach_uncond: bool = False) -> torch.Tensor:
    """The sampler's velocity at one step (sigma a 0-dim tensor, or one per sample), float32: with
    CFG when guidance_scale > 1 for a family that guides so (SD3), else with guidance_scale
    embedded in the DiT's one pass (FLUX.1-dev). `detach_uncond`: no gradient through CFG's
    unconditional half (Flow-GRPO's trained forward)."""
    b = x.shape[0]
    s = sigma.expand(b)
    with autocast():
        family = family_of(transformer)
        if guidance_scale > 1.0 and family.cfg_guidance:
            if family.cfg_batched:  # both halves in one call, [negative, positive]
                v_all = velocity(transformer, torch.cat([x, x]), torch.cat([s, s]),
                                 torch.cat([cond.neg_prompt_embeds, cond.prompt_embeds]),
                                 torch.cat([cond.neg_pooled, cond.pooled]), dtype, integer_timesteps)
                v_neg, v_pos = v_all.float().chunk(2)
            else:  # two calls, the positive first
                v_pos = velocity(transformer, x, s, cond.prompt_embeds, cond.pooled, dtype, integer_timesteps).float()
                v_neg = velocity(transformer, x, s, cond.neg_prompt_embeds, cond.neg_pooled, dtype,
                                 integer_timesteps).float()
            if detach_uncond:
                v_neg = v_neg.detach()
            return family.guide(v_neg, v_pos, guidance_scale)
        return velocity(transformer, x, s, cond.prompt_embeds, cond.pooled, dtype, integer_timesteps,
                        guidance_scale).float()


@torch.no_grad()
def euler_sample(transformer, noise: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
                 guidance_scale: float, dtype: torch.dtype, autocast, integer_timesteps: bool = False) -> torch.Tensor:
    """Deterministic Euler ODE x_{k+1} = x_k + (sigma_{k+1} - sigma_k) v(x_k, sigma_k); returns x0
    (the final latent, before VAE un-scaling), float32."""
    x = noise
    sigmas = sigmas.to(x.device)  # once: a host-to-device copy per step would wait for the GPU each time
    for k in range(len(sigmas) - 1):
        v = guided_velocity(transformer, x, sigmas[k], cond, guidance_scale, dtype, autocast, integer_timesteps)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    return x


@torch.no_grad()
def decode_to_uint8(vae, latents: torch.Tensor, rounding: str = "round", batch: int = 0, family=SD3) -> torch.Tensor:
    """VAE decode of (unpacked) latents to uint8 images [B, H, W, 3] (a video family's frames
    [B, F, H, W, 3]) on the CPU, the latent scaling undone as `family`'s pipeline does. `batch` > 0
    (perf.vae_decode_batch): decode that many at a time (the decoder's activations are the largest
    of the rollout's)."""
    if 0 < batch < len(latents):
        return torch.cat([decode_to_uint8(vae, part, rounding, 0, family) for part in latents.split(batch)])
    img = family.decode(vae, latents).float()
    img = (img / 2 + 0.5).clamp(0, 1) * 255.0
    img = img.round() if rounding == "round" else img.floor()
    return img.to(torch.uint8).movedim(1, -1).contiguous().cpu()


def prompt_grid(images: np.ndarray, prompts: list[str], caption_lines: int = 3) -> np.ndarray:
    """[n, H, W, 3] uint8 images and the prompt of each -> one grid image: a column per prompt
    (consecutive images of one prompt, top to bottom), headed by the prompt's text, wrapped to
    the column's width and cut after `caption_lines` lines."""
    from PIL import Image, ImageDraw, ImageFont

    n, h, w, c = images.shape
    columns = grid_columns(prompts)
    font = ImageFont.load_default()
    line_h = font.getbbox("Ag")[3] + 2
    head = caption_lines * line_h + 4
    rows = max(len(ids) for _, ids in columns)
    canvas = Image.new("RGB", (len(columns) * w, head + rows * h), "white")
    draw = ImageDraw.Draw(canvas)
    for q, (prompt, ids) in enumerate(columns):
        for y, text in enumerate(_wrap(prompt, font, w - 4, caption_lines)):
            draw.text((q * w + 2, 2 + y * line_h), text, fill="black", font=font)
        for r, i in enumerate(ids):
            canvas.paste(Image.fromarray(np.ascontiguousarray(images[i])), (q * w, head + r * h))
    return np.asarray(canvas)


def grid_columns(prompts: list[str]) -> list[tuple[str, list[int]]]:
    """The sample grid's columns: (prompt, the indices of its consecutive images)."""
    columns: list[tuple[str, list[int]]] = []
    for i, prompt in enumerate(prompts):
        if columns and columns[-1][0] == prompt:
            columns[-1][1].append(i)
        else:
            columns.append((prompt, [i]))
    return columns


def grid_cells(grid: np.ndarray, prompts: list[str], height: int, width: int, caption_lines: int = 3) -> np.ndarray:
    """prompt_grid undone: the [n, height, width, 3] images of a grid made of images whose
    prompts were `prompts`. ValueError where the grid's size does not fit them."""
    from PIL import ImageFont

    columns = grid_columns(prompts)
    font = ImageFont.load_default()
    head = caption_lines * (font.getbbox("Ag")[3] + 2) + 4
    rows = max(len(ids) for _, ids in columns)
    if grid.shape != (head + rows * height, len(columns) * width, 3):
        raise ValueError(f"a grid of {grid.shape[1]}x{grid.shape[0]} pixels is not one of {len(prompts)} images of "
                         f"{width}x{height} in {len(columns)} columns")
    out = np.empty((len(prompts), height, width, 3), dtype=np.uint8)
    for q, (_, ids) in enumerate(columns):
        for r, i in enumerate(ids):
            out[i] = grid[head + r * height:head + (r + 1) * height, q * width:(q + 1) * width]
    return out


def grid_sample_ids(samples_per_step: int, train_ranks: int, n: int) -> list[int]:
    """The samples of a step the sample grid of up to n images shows, in its order: an equal
    share from each train rank (rank r owns samples r*per .. (r+1)*per - 1)."""
    per = samples_per_step // train_ranks
    share = min(per, math.ceil(n / train_ranks))
    return [r * per + j for r in range(train_ranks) for j in range(share)][:n]


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a cut text ends in '...'."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if font.getlength(candidate) <= width or not line:
            line = candidate
        else:
            lines.append(line)
            line = word
    lines.append(line)
    lines = [_fit(x, font, width) for x in lines]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = _fit(lines[-1] + "...", font, width, force_ellipsis=True)
    return lines


def _fit(text: str, font, width: int, force_ellipsis: bool = False) -> str:
    if font.getlength(text) <= width and not (force_ellipsis and not text.endswith("...")):
        return text
    base = text[:-3] if text.endswith("...") else text
    while base and font.getlength(base + "...") > width:
        base = base[:-1]
    return base + "..."


def null_autocast():
    return contextlib.nullcontext()
