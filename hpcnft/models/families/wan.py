"""Wan2.1 text-to-video (T2V-1.3B): WanTransformer3DModel over video latents [B, 16, F', h, w]
(F' = (frames - 1) / 4 + 1: AutoencoderKLWan's causal 4x in time, 8x in space), one UMT5 text
encoder whose embeddings WanPipeline pads to max_sequence_length with zeros, no pooled embedding,
classifier-free guidance with a negative prompt, the DiT's time on the 0-1000 scale, and a static
flow shift of the sigma grid.

The sampler, the NFT and Flow-GRPO losses see the latents with their frame axis: every one of
them works per sample over whatever shape `latent_shape` gives. The real folder ships UniPC (flow
shift 3.0); our sampler walks its own Euler/SDE steps on the flow-matching grid at that shift, the
grid of FlowMatchEulerDiscreteScheduler(shift=flow_shift), which the tiny folder ships itself
(models/tiny_wan.py) so that WanPipeline samples the same steps."""
from __future__ import annotations

import torch

from hpcnft.models.families.base import Family
from hpcnft.models.families.sd3 import dit_timestep
from hpcnft.models.folders import WAN_REQUIRED
from hpcnft.models.tiny_cache import WAN_DIRNAME

TEMPORAL, SPATIAL = 4, 8  # AutoencoderKLWan's compression (Wan2.1's and the tiny one's)


def latent_frames(num_frames: int) -> int:
    """The latent frames of a video of `num_frames` (WanPipeline.prepare_latents)."""
    return (num_frames - 1) // TEMPORAL + 1


def euler_scheduler(scheduler):
    """The flow-matching Euler scheduler of the folder's: itself, or UniPC's flow shift as one."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
    c = scheduler.config
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=c.get("num_train_timesteps", 1000),
                                           shift=c.get("flow_shift", 3.0))


class WanFamily(Family):
    name = "wan"
    dir_key = "models.wan_dir"
    tiny_dirname = WAN_DIRNAME
    required = WAN_REQUIRED
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    cfg_guidance = True
    cfg_batched = False
    video = True

    def build_tiny(self, out_dir: str) -> None:
        from hpcnft.models.tiny_wan import build_tiny_wan

        build_tiny_wan(out_dir)

    text_encoder_names = ("text_encoder",)

    def encode_prompt(self, pipe, prompt, max_sequence_length, device):
        """WanPipeline's embeddings (zeros past the prompt's tokens) and an empty [1, 0] second
        tensor: Wan has no pooled embedding, and its DiT reads no mask."""
        pe, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
                                   device=device)
        return pe, pe.new_zeros(1, 0)

    def token_limits(self, pipe, max_sequence_length):
        return [("UMT5", pipe.tokenizer, max_sequence_length)]

    def prompt_tokens(self, max_sequence_length):
        return max_sequence_length

    def latent_shape(self, pipe, height, width, num_frames=1):
        """[C, F', h, w]: the video's latent frames with their channels."""
        return (pipe.vae.config.z_dim, latent_frames(num_frames), height // SPATIAL, width // SPATIAL)

    def decode(self, vae, latents):
        """[B, 3, F, H, W] of latents [B, C, F', h, w], latents_mean/std undone as WanPipeline does."""
        return vae.decode(self.latents_unnormalised(vae, latents.to(vae.dtype)), return_dict=False)[0]

    def sigma_grid(self, scheduler, num_steps, latent_shape):
        sched = euler_scheduler(scheduler)
        sched.set_timesteps(num_steps)
        return sched.sigmas.detach().to(torch.float32).cpu().clone()

    def velocity(self, transformer, x, sigma, prompt_embeds, pooled, dtype, integer_timesteps, guidance):
        return transformer(hidden_states=x.to(dtype), timestep=dit_timestep(sigma, integer_timesteps),
                           encoder_hidden_states=prompt_embeds.to(dtype), return_dict=False)[0]

    def fsdp_blocks(self, transformer):
        return list(transformer.blocks)


WAN = WanFamily()
