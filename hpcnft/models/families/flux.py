"""FLUX.1 (dev): FluxTransformer2DModel over 2x2-packed latents with rotary image and text ids,
CLIP-L (pooled) and T5 text encoders, the guidance value embedded by the DiT (guidance-distilled:
one pass, no classifier-free guidance), the DiT's time as sigma, and FluxPipeline's
resolution-dependent shift of the sigma grid.

The sampler and the NFT loss see the unpacked VAE latents [B, 16, h, w], as for SD3: `velocity`
packs them into FLUX's [B, h/2 * w/2, 64] tokens and unpacks the velocity back. Packing is a
permutation, so an Euler step in either layout has the same bits (FluxPipeline draws its noise
unpacked too, then packs it)."""
from __future__ import annotations

import numpy as np
import torch

from hpcnft.models.families.base import Family
from hpcnft.models.folders import FLUX_REQUIRED
from hpcnft.models.tiny_cache import FLUX_DIRNAME

def _pipeline():
    from diffusers import FluxPipeline

    return FluxPipeline


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C] (FluxPipeline._pack_latents)."""
    b, c, h, w = x.shape
    return _pipeline()._pack_latents(x, b, c, h, w)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w] (FluxPipeline._unpack_latents at the latents' own size)."""
    return _pipeline()._unpack_latents(tokens, h, w, 1)


def image_seq_len(latent_shape: tuple[int, int, int]) -> int:
    _, h, w = latent_shape
    return (h // 2) * (w // 2)


def avoid_cudnn_attention(transformer) -> None:
    """On CUDA, SDPA without its cuDNN backend, process-wide. cuDNN's attention backward at FLUX.1's
    shapes (24 heads of 128, 1,024 image + 512 text tokens, bf16) fails on an H200 with torch 2.11
    and cuDNN 9.19 (an illegal memory access, or a failed cuBLAS GEMM right after it); flash and
    memory-efficient attention pass. Process-wide because gradient checkpointing recomputes the
    forward inside backward(), outside any context the forward could set."""
    if next(transformer.parameters()).is_cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)


class FluxFamily(Family):
    name = "flux"
    dir_key = "models.flux_dir"
    tiny_dirname = FLUX_DIRNAME
    required = FLUX_REQUIRED
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    cfg_guidance = False

    def __init__(self):
        self._ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per shape and device

    def build_tiny(self, out_dir: str) -> None:
        from hpcnft.models.tiny_flux import build_tiny_flux

        build_tiny_flux(out_dir)

    text_encoder_names = ("text_encoder", "text_encoder_2")

    def encode_prompt(self, pipe, prompt, max_sequence_length, device):
        pe, pooled, _ = pipe.encode_prompt(prompt, None, device=device, max_sequence_length=max_sequence_length)
        return pe, pooled

    def token_limits(self, pipe, max_sequence_length):
        limits = [("CLIP", pipe.tokenizer, pipe.tokenizer_max_length)] if pipe.tokenizer is not None else []
        if pipe.tokenizer_2 is not None:
            limits.append(("T5", pipe.tokenizer_2, max_sequence_length))
        return limits

    def prompt_tokens(self, max_sequence_length):
        return max_sequence_length  # T5 alone: CLIP-L gives the pooled embedding only

    def sigma_grid(self, scheduler, num_steps, latent_shape):
        """FluxPipeline's: linspace(1, 1/N, N) shifted by mu = calculate_shift(image tokens)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        sched = type(scheduler).from_config(scheduler.config)
        c = sched.config
        sigmas = None if c.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(image_seq_len(latent_shape), c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        if sigmas is None:
            sched.set_timesteps(num_steps, mu=mu)
        else:
            sched.set_timesteps(sigmas=sigmas, mu=mu)
        return sched.sigmas.detach().to(torch.float32).cpu().clone()

    def _ids_for(self, h: int, w: int, text_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (h, w, text_len, str(device))
        if key not in self._ids:
            img = _pipeline()._prepare_latent_image_ids(1, h // 2, w // 2, device, torch.float32)
            self._ids[key] = (img, torch.zeros(text_len, 3, device=device))
        return self._ids[key]

    def velocity(self, transformer, x, sigma, prompt_embeds, pooled, dtype, integer_timesteps, guidance):
        b, _, h, w = x.shape
        img_ids, txt_ids = self._ids_for(h, w, prompt_embeds.shape[1], x.device)
        # FluxPipeline passes the scheduler's timestep (1000 sigma) divided by 1000
        t = sigma.to(torch.float32) * 1000.0
        t = torch.trunc(t) if integer_timesteps else t
        g = (torch.full((b,), guidance, dtype=torch.float32, device=x.device)
             if transformer.config.guidance_embeds else None)
        out = transformer(hidden_states=pack(x).to(dtype), timestep=t / 1000, guidance=g,
                          pooled_projections=pooled.to(dtype), encoder_hidden_states=prompt_embeds.to(dtype),
                          txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return unpack(out, h, w)

    def prepare_dit(self, transformer) -> None:
        avoid_cudnn_attention(transformer)

    def fsdp_blocks(self, transformer):
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


FLUX = FluxFamily()
