"""Stable Diffusion 3 / 3.5 (Medium and Large): SD3Transformer2DModel over unpacked latents, CLIP-L,
CLIP-G and T5 text encoders, a static shift of the flow-matching sigma grid, classifier-free
guidance, the DiT's time on the 0-1000 scale."""
from __future__ import annotations

import torch

from hpcnft.models.families.base import Family
from hpcnft.models.folders import SD3_REQUIRED
from hpcnft.models.tiny_cache import SD3_DIRNAME

CLIP_TOKENS = 77  # the CLIP encoders' padded length (pipe.tokenizer_max_length)


def dit_timestep(sigma: torch.Tensor, integer: bool = False) -> torch.Tensor:
    """SD3's DiT embeds time on the 0-1000 scale: tau = 1000 sigma in float32. With `integer`
    (rollout.integer_timesteps) tau is truncated toward zero, as the official pipeline's
    torch.full(..., sigma * 1000, dtype=long); kept as a float tensor, which the DiT's sinusoidal
    embedding casts to anyway, so the embedding sees the same values."""
    tau = sigma.to(torch.float32) * 1000.0
    return torch.trunc(tau) if integer else tau


class SD3Family(Family):
    name = "sd3"
    dir_key = "models.sd3_dir"
    tiny_dirname = SD3_DIRNAME
    required = SD3_REQUIRED
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    cfg_guidance = True

    def build_tiny(self, out_dir: str) -> None:
        from hpcnft.models.tiny import build_tiny_sd3

        build_tiny_sd3(out_dir)

    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")

    def encode_prompt(self, pipe, prompt, max_sequence_length, device):
        pe, _, pooled, _ = pipe.encode_prompt(prompt, None, None, device=device, do_classifier_free_guidance=False,
                                              max_sequence_length=max_sequence_length)
        return pe, pooled

    def token_limits(self, pipe, max_sequence_length):
        limits = [("CLIP", t, pipe.tokenizer_max_length) for t in (pipe.tokenizer, pipe.tokenizer_2) if t is not None]
        if getattr(pipe, "text_encoder_3", None) is not None and pipe.tokenizer_3 is not None:
            limits.append(("T5", pipe.tokenizer_3, max_sequence_length))
        return limits

    def prompt_tokens(self, max_sequence_length):
        return CLIP_TOKENS + max_sequence_length  # CLIP-L and CLIP-G side by side (77), then T5

    def sigma_grid(self, scheduler, num_steps, latent_shape):
        # A fresh scheduler from the same config keeps the shared one's state untouched.
        sched = type(scheduler).from_config(scheduler.config)
        sched.set_timesteps(num_steps)
        return sched.sigmas.detach().to(torch.float32).cpu().clone()

    def velocity(self, transformer, x, sigma, prompt_embeds, pooled, dtype, integer_timesteps, guidance):
        return transformer(hidden_states=x.to(dtype), timestep=dit_timestep(sigma, integer_timesteps),
                           encoder_hidden_states=prompt_embeds.to(dtype), pooled_projections=pooled.to(dtype),
                           return_dict=False)[0]

    def fsdp_blocks(self, transformer):
        return list(transformer.transformer_blocks)


SD3 = SD3Family()
