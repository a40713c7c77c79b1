"""A tiny Wan2.1 text-to-video model with the real classes, for tests and the `tiny_wan` recipe.

`build_tiny_wan(out)` writes a WanPipeline folder: WanTransformer3DModel (3-D patches, rotary
time/height/width embedding, cross-attention to the text); AutoencoderKLWan (causal 3-D VAE, 8x
in space and 4x in time, the real model's 16 latent channels and their latents_mean/std); a
UMT5EncoderModel with a T5-style unigram tokenizer learned from the tiny corpus (as the tiny
SD3.5's T5 tokenizer, so that two builds are byte-identical; its ids are a small subset of a
UMT5 vocabulary's size); and FlowMatchEulerDiscreteScheduler at shift 3, Wan2.1-T2V-1.3B's flow
shift, the Euler grid our sampler walks (the real folder ships UniPC with that shift:
models/families/wan.py builds the same Euler grid from it).
"""
from __future__ import annotations

import os
import shutil

import torch

from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS, record_t5_tokenizer_fast
from hpcnft.models.tiny_dims import TINY_WAN_TRANSFORMER
from hpcnft.models.tiny_tokenizers import finish_tokenizer_dir, make_t5_tokenizer

# Constraints (WanPipeline / WanTransformer3DModel):
#   transformer.in_channels == vae.z_dim ; transformer.text_dim == umt5.d_model
#   attention_head_dim: 2 * (head_dim // 6) rotary dims each for height and width, the rest time
TINY_WAN_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                    temperal_downsample=[False, True, True], dropout=0.0)
TINY_UMT5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                 tie_word_embeddings=False, is_encoder_decoder=False, use_cache=False)
WAN_FLOW_SHIFT = 3.0  # Wan2.1-T2V-1.3B-Diffusers' scheduler (UniPC, flow_shift 3.0)
TINY_WAN_SCHEDULER = dict(num_train_timesteps=1000, shift=WAN_FLOW_SHIFT)


def build_tiny_wan(path: str, seed: int = 0) -> str:
    """Write the tiny Wan2.1 T2V pipeline into `path` (an empty folder)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    tmp_tok = os.path.join(path, "_tok_tmp")
    tok = make_t5_tokenizer(os.path.join(tmp_tok, "umt5"), PROMPTS + [CHAR_COVERAGE])
    torch.manual_seed(seed)
    vocab = (len(tok) + 7) // 8 * 8
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=vocab, pad_token_id=tok.pad_token_id,
                                               eos_token_id=tok.eos_token_id, decoder_start_token_id=0, **TINY_UMT5))
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=AutoencoderKLWan(**TINY_WAN_VAE),
                       scheduler=FlowMatchEulerDiscreteScheduler(**TINY_WAN_SCHEDULER),
                       transformer=WanTransformer3DModel(**TINY_WAN_TRANSFORMER))
    pipe.save_pretrained(path, safe_serialization=True)
    finish_tokenizer_dir(os.path.join(path, "tokenizer"))
    record_t5_tokenizer_fast(path, "tokenizer")
    shutil.rmtree(tmp_tok, ignore_errors=True)
    return path
