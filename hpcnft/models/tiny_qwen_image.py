"""A tiny Qwen-Image with the real classes, for tests and the `tiny_qwen_image` recipe.

`build_tiny_qwen_image(out)` writes a QwenImagePipeline folder: QwenImageTransformer2DModel (the
double-stream MMDiT over 2x2-packed latents with 3-axis rotary embeddings); the causal-3D VAE
(AutoencoderKLQwenImage) with Qwen-Image's latents_mean/latents_std; the flow-matching scheduler
with Qwen-Image's configuration (its exponential, resolution-dependent shift and terminal 0.02);
a Qwen2.5-VL text encoder (Qwen2_5_VLForConditionalGeneration, vision tower included) and a
Qwen2 byte-level BPE tokenizer learned from the tiny corpus and QwenImagePipeline's prompt
template, so that the template's system prefix is 34 tokens as with the real tokenizer (the
pipeline drops exactly that many). Every id is within the real vocabulary (151,936); two builds
are byte-identical (the merges are learned by a small pure-Python routine, as the tiny SD3.5's).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch

from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS
from hpcnft.models.tiny_dims import TINY_QWEN_IMAGE_TRANSFORMER
from hpcnft.models.tiny_tokenizers import _bytes_to_unicode, finish_tokenizer_dir, learn_merges

REAL_VOCAB = 151_936  # Qwen2.5-VL's token embedding rows (its tokenizer's ids are all below)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# QwenImagePipeline.prompt_template_encode (its prefix is dropped after encoding)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
# Constraints (QwenImagePipeline / QwenImageTransformer2DModel):
#   in_channels == 4 * vae.z_dim (2x2 packing); out_channels == vae.z_dim; sum(axes_dims_rope) == attention_head_dim
#   joint_attention_dim == text_encoder hidden_size ; mrope_section sums to the text heads' head_dim / 2
TINY_QWEN_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1]})
TINY_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                        fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TINY_QWEN_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                     temperal_downsample=[False, True, True])  # latents_mean / latents_std: Qwen-Image's defaults
# Qwen-Image's scheduler_config.json
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential")
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2Tokenizer's pre-tokenizer


def _words(texts: list[str]) -> list[str]:
    """Qwen2Tokenizer's normalisation and pre-tokenisation (NFC, its split, byte-level), the
    special tokens taken out first as the tokenizer does."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = "(" + "|".join(re.escape(s) for s in SPECIALS) + ")"
    words = []
    for text in texts:
        for part in re.split(special, normalizers.NFC().normalize_str(text)):
            if part and part not in SPECIALS:
                words += [w for w, _ in pre.pre_tokenize_str(part)]
    return words


def train_qwen_bpe(texts: list[str]) -> tuple[dict[str, int], list[str]]:
    """Byte-level BPE merges learned until every corpus word is one token (highest count first,
    ties in lexicographic order): the 256 byte symbols in GPT-2's order (Qwen2's first 256 ids),
    the merged tokens in merge order, then the special tokens."""
    from collections import Counter

    words = {tuple(w): f for w, f in sorted(Counter(_words(texts)).items())}
    merges = learn_merges(words)
    vocab_list = _bytes_to_unicode()
    seen = set(vocab_list)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            vocab_list.append(a + b)
    vocab_list += list(SPECIALS)
    return {t: i for i, t in enumerate(vocab_list)}, [f"{a} {b}" for a, b in merges]


def make_qwen_tokenizer(out_dir: str, texts: list[str]):
    """A Qwen2Tokenizer of the learned BPE (vocab.json, merges.txt and tokenizer.json written)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = train_qwen_bpe(texts)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True, normalized=False)
                                                          for s in SPECIALS[1:]]})
    return tok


def build_tiny_qwen_image(path: str, seed: int = 0) -> str:
    """Write the tiny Qwen-Image pipeline into `path` (an empty folder)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    tmp_tok = os.path.join(path, "_tok_tmp")
    tok = make_qwen_tokenizer(tmp_tok, PROMPTS + [CHAR_COVERAGE, TEMPLATE.format("")])
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(text_config=dict(TINY_QWEN_TEXT, vocab_size=(len(tok) + 7) // 8 * 8,
                                               bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
                              vision_config=dict(TINY_QWEN_VISION), tie_word_embeddings=False)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    pipe = QwenImagePipeline(transformer=QwenImageTransformer2DModel(**TINY_QWEN_IMAGE_TRANSFORMER),
                             scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                             vae=AutoencoderKLQwenImage(**TINY_QWEN_VAE), text_encoder=text_encoder, tokenizer=tok)
    pipe.save_pretrained(path, safe_serialization=True)
    finish_tokenizer_dir(os.path.join(path, "tokenizer"), tmp_tok)
    shutil.rmtree(tmp_tok, ignore_errors=True)
    return path
