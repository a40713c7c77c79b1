"""A tiny FLUX.1-dev with the real classes, for tests and the `tiny_flux` recipe.

`build_tiny_flux(out)` writes a FluxPipeline folder: FluxTransformer2DModel with the guidance
embedding (FLUX.1-dev's), double- and single-stream blocks and 3-axis rotary ids; a 16-channel
VAE with FLUX's scaling and shift; the flow-matching scheduler with FLUX's resolution-dependent
shift; CLIP-L (pooled) and T5 text encoders with tokenizers learned from the tiny corpus (as the
tiny SD3.5's, so that two builds are byte-identical).
"""
from __future__ import annotations

import os
import shutil

import torch

from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS, TINY_CLIP_TEXT, TINY_T5, TINY_VAE, record_t5_tokenizer_fast
from hpcnft.models.tiny_dims import TINY_FLUX_TRANSFORMER
from hpcnft.models.tiny_tokenizers import finish_tokenizer_dir, make_clip_tokenizer, make_t5_tokenizer

# Constraints (FluxPipeline / FluxTransformer2DModel):
#   in_channels == 4 * vae.latent_channels (2x2 packing), patch_size 1
#   sum(axes_dims_rope) == attention_head_dim
#   joint_attention_dim == t5.d_model ; pooled_projection_dim == clip.hidden_size (pooler output)
TINY_FLUX_VAE = dict(TINY_VAE, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's values
TINY_FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                           max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def build_tiny_flux(path: str, seed: int = 0) -> str:
    """Write the tiny FLUX.1-dev pipeline into `path` (an empty folder)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    texts = PROMPTS + [CHAR_COVERAGE]
    tmp_tok = os.path.join(path, "_tok_tmp")
    tok1 = make_clip_tokenizer(os.path.join(tmp_tok, "clip"), texts, pad_token="<|endoftext|>")
    tok2 = make_t5_tokenizer(os.path.join(tmp_tok, "t5"), texts)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok1), hidden_act="quick_gelu",
                                                bos_token_id=tok1.bos_token_id, eos_token_id=tok1.eos_token_id,
                                                pad_token_id=tok1.pad_token_id, **TINY_CLIP_TEXT))
    t5_vocab = (len(tok2) + 7) // 8 * 8
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=t5_vocab, pad_token_id=tok2.pad_token_id,
                                             eos_token_id=tok2.eos_token_id, decoder_start_token_id=0, **TINY_T5))
    pipe = FluxPipeline(transformer=FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER),
                        scheduler=FlowMatchEulerDiscreteScheduler(**TINY_FLUX_SCHEDULER),
                        vae=AutoencoderKL(**TINY_FLUX_VAE), text_encoder=text_encoder, tokenizer=tok1,
                        text_encoder_2=text_encoder_2, tokenizer_2=tok2)
    pipe.save_pretrained(path, safe_serialization=True)
    finish_tokenizer_dir(os.path.join(path, "tokenizer"), os.path.join(tmp_tok, "clip"))
    finish_tokenizer_dir(os.path.join(path, "tokenizer_2"))
    record_t5_tokenizer_fast(path, "tokenizer_2")
    shutil.rmtree(tmp_tok, ignore_errors=True)
    return path
