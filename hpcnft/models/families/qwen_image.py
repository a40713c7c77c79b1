"""Qwen-Image: QwenImageTransformer2DModel (60 double-stream MMDiT blocks) over 2x2-packed
latents with 3-axis rotary embeddings, the Qwen2.5-VL text encoder (its last hidden state, the
prompt template's system prefix dropped), true classifier-free guidance with QwenImagePipeline's
renormalisation, the DiT's time as sigma, QwenImagePipeline's shifted sigma grid, and the causal
3D VAE (AutoencoderKLQwenImage) with its per-channel latents mean and std.

The encoder's embeddings vary in length with the prompt. A batch is a cat of prompts, so each is
padded with zeros to rollout.max_sequence_length tokens, and its mask (1 for the prompt's tokens,
0 for the padding; torch.long, as QwenImagePipeline.encode_prompt makes it) is the family's
second conditioning tensor: the DiT takes it as encoder_hidden_states_mask and attends to no
padding. The text tokens' rotary positions count from the start, so the prompt's tokens sit where
they sit unpadded.

The sampler and the NFT loss see the unpacked latents [B, 16, h, w], as for FLUX.1 (packing is a
permutation, so an Euler step in either layout has the same bits)."""
from __future__ import annotations

import torch

from hpcnft.models.families.base import Family
from hpcnft.models.families.flux import FluxFamily, image_seq_len
from hpcnft.models.folders import QWEN_IMAGE_REQUIRED
from hpcnft.models.tiny_cache import QWEN_IMAGE_DIRNAME


def _pipeline():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C] (QwenImagePipeline._pack_latents)."""
    b, c, h, w = x.shape
    return _pipeline()._pack_latents(x, b, c, h, w)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w] (QwenImagePipeline._unpack_latents at the latents' own
    size, its frame axis of one dropped)."""
    return _pipeline()._unpack_latents(tokens, h, w, 1)[:, :, 0]


class TemplatedTokenizer:
    """The tokens the DiT sees of a prompt: QwenImagePipeline's template around it, tokenized,
    the system prefix (prompt_template_encode_start_idx tokens) dropped. Called as a tokenizer
    (truncated_prompts counts the prompts the encoder cuts with it)."""

    def __init__(self, pipe):
        self.tokenizer, self.template = pipe.tokenizer, pipe.prompt_template_encode
        self.drop = pipe.prompt_template_encode_start_idx

    def __call__(self, texts: list[str], **kwargs) -> dict:
        ids = self.tokenizer([self.template.format(t) for t in texts], **kwargs)["input_ids"]
        return {"input_ids": [x[self.drop:] for x in ids]}


class QwenImageFamily(Family):
    name = "qwen_image"
    dir_key = "models.qwen_image_dir"
    tiny_dirname = QWEN_IMAGE_DIRNAME
    required = QWEN_IMAGE_REQUIRED
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    cfg_guidance = True  # true_cfg_scale: a second pass on the negative prompt
    # two DiT calls, the positive first, as QwenImagePipeline makes them: one call on both halves
    # multiplies at twice the rows, which some CPUs' kernels round differently
    cfg_batched = False

    def build_tiny(self, out_dir: str) -> None:
        from hpcnft.models.tiny_qwen_image import build_tiny_qwen_image

        build_tiny_qwen_image(out_dir)

    text_encoder_names = ("text_encoder",)

    def encode_prompt(self, pipe, prompt, max_sequence_length, device):
        """QwenImagePipeline.encode_prompt's embeddings [1, n, D] (n <= max_sequence_length)
        padded with zeros to [1, max_sequence_length, D], and their mask [1, max_sequence_length]."""
        pe, _ = pipe.encode_prompt(prompt, device=device, max_sequence_length=max_sequence_length)
        n = pe.shape[1]
        padded = pe.new_zeros(1, max_sequence_length, pe.shape[2])
        padded[:, :n] = pe
        mask = torch.zeros(1, max_sequence_length, dtype=torch.long, device=pe.device)
        mask[:, :n] = 1
        return padded, mask

    def token_limits(self, pipe, max_sequence_length):
        has = getattr(pipe, "tokenizer", None) is not None
        return [("Qwen2.5-VL", TemplatedTokenizer(pipe), max_sequence_length)] if has else []

    def prompt_tokens(self, max_sequence_length):
        return max_sequence_length

    def latent_shape(self, pipe, height, width, num_frames=1):
        factor = 2 ** len(pipe.vae.temperal_downsample)  # QwenImagePipeline.vae_scale_factor
        return (pipe.vae.config.z_dim, height // factor, width // factor)

    def decode(self, vae, latents):
        """QwenImagePipeline's: latents / (1 / std) + mean per channel, one frame, decoded, the
        frame axis dropped."""
        z = self.latents_unnormalised(vae, latents.to(vae.dtype).unsqueeze(2))
        return vae.decode(z, return_dict=False)[0][:, :, 0]

    def sigma_grid(self, scheduler, num_steps, latent_shape):
        """QwenImagePipeline's: linspace(1, 1/N, N) shifted by mu = calculate_shift(image tokens)
        (FluxPipeline's construction; Qwen-Image's scheduler shifts exponentially and stretches
        the grid to its terminal sigma)."""
        return FluxFamily.sigma_grid(self, scheduler, num_steps, latent_shape)

    def velocity(self, transformer, x, sigma, prompt_embeds, pooled, dtype, integer_timesteps, guidance):
        b, _, h, w = x.shape
        t = sigma.to(torch.float32) * 1000.0  # QwenImagePipeline passes the scheduler's timestep / 1000
        t = torch.trunc(t) if integer_timesteps else t
        out = transformer(hidden_states=pack(x).to(dtype), timestep=t / 1000, guidance=None,
                          encoder_hidden_states_mask=pooled, encoder_hidden_states=prompt_embeds.to(dtype),
                          img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return unpack(out, h, w)

    def guide(self, v_neg, v_pos, scale):
        """QwenImagePipeline's true CFG: the guided velocity rescaled, token by token (a packed
        token's 4C values), to the norm of the conditional one."""
        h, w = v_pos.shape[-2:]
        comb, cond = pack(Family.guide(self, v_neg, v_pos, scale)), pack(v_pos)
        comb = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        return unpack(comb, h, w)

    def unreached(self, transformer):
        """The last block's text stream after its attention: the text attention output's
        projection and the text feed-forward feed only text tokens, which the DiT drops after that
        block. (Its text queries get a gradient of zeros: the joint attention's backward covers
        every query.)"""
        last = transformer.transformer_blocks[-1]
        return [last.attn.to_add_out, last.txt_mlp]

    def fsdp_blocks(self, transformer):
        return list(transformer.transformer_blocks)


QWEN_IMAGE = QwenImageFamily()

__all__ = ["QWEN_IMAGE", "QwenImageFamily", "image_seq_len", "pack", "unpack"]
