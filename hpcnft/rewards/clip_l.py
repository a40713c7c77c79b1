"""CLIP ViT-L/14 for the clipscore and aesthetic terms: a model folder in the
openai/clip-vit-large-patch14 layout (a CLIPModel and its CLIPProcessor) loaded from disk, and the
tiny stand-in used when a term's model_dir is empty.

The tiny folder keeps ViT-L/14's wiring at toy width: quick_gelu in both towers, 14-pixel patches
on 224-pixel images, 77 text positions, a projection width unlike the towers' widths, the learned
temperature exp(logit_scale) = 100, and ViT-L/14's preprocessing (shortest edge 224, bicubic,
224 centre crop, the OpenAI mean and std)."""
from __future__ import annotations

import math
import os
import shutil

import torch

from hpcnft.common.errors import one_line
from hpcnft.models.folders import PROCESSOR_REQUIRED, ModelError, check_folder, quiet_libraries
from hpcnft.models.tiny_cache import ensure_tiny, tiny_cache
from hpcnft.rewards.config import RewardTermConfig

CLIP_L_TINY = "clip_l_tiny"
CLIP_MODEL_REQUIRED = ("config.json",)
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
TINY_CLIP_L = dict(
    text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=77, hidden_act="quick_gelu"),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=224, patch_size=14, hidden_act="quick_gelu"),
    projection_dim=24,
)
# openai/clip-vit-large-patch14's config.json, the fields that shape the towers (the rest are
# CLIPConfig's defaults); the bench builds the terms' towers at these widths.
VIT_L_14 = dict(
    text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, vocab_size=49408, hidden_act="quick_gelu"),
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                image_size=224, patch_size=14, hidden_act="quick_gelu"),
    projection_dim=768,
)


def term_key(term: RewardTermConfig, field: str) -> str:
    """The config key of one of a term's settings, as an error line names it."""
    return f"reward.terms[{term.name or term.kind}].{field}"


def clip_l_config(arch: dict, tokenizer):
    """CLIPConfig of towers laid out as `arch` (TINY_CLIP_L, VIT_L_14): the tokenizer's special
    ids (the text tower pools at its end token), its vocabulary where `arch` names none, and
    ViT-L/14's learned temperature."""
    from transformers import CLIPConfig

    text = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **arch["text"]}
    return CLIPConfig(text_config=text, vision_config=dict(arch["vision"]), projection_dim=arch["projection_dim"],
                      logit_scale_init_value=math.log(100.0))


def build_tiny_clip_l(folder: str, seed: int = 0) -> None:
    """Write a CLIPModel + CLIPProcessor in ViT-L/14's layout into `folder` (deterministic)."""
    from transformers import CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS
    from hpcnft.models.tiny_tokenizers import finish_tokenizer_dir, make_clip_tokenizer

    quiet_libraries()
    tok_src = os.path.join(folder, "_tok_tmp")
    tok = make_clip_tokenizer(tok_src, PROMPTS + [CHAR_COVERAGE])
    image_processor = CLIPImageProcessorPil(
        do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, do_convert_rgb=True,
    )
    torch.manual_seed(seed)
    CLIPModel(clip_l_config(TINY_CLIP_L, tok)).save_pretrained(folder, safe_serialization=True)
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(folder)
    finish_tokenizer_dir(folder, tok_src)
    shutil.rmtree(tok_src)


def clip_l_folder(term: RewardTermConfig, cfg) -> str:
    """The term's CLIP folder: model_dir, or the tiny one (built on first use) when empty."""
    if term.model_dir:
        return term.model_dir
    return ensure_tiny(tiny_cache(cfg), CLIP_L_TINY, build_tiny_clip_l)


def load_clip_l(term: RewardTermConfig, cfg, device: torch.device):
    """(CLIPProcessor with the PIL image backend, float32 CLIPModel on `device`) for a term;
    processor_dir defaults to the model folder, as in the openai/clip-vit-large-patch14 layout."""
    model_dir = clip_l_folder(term, cfg)
    processor_dir = term.processor_dir or model_dir
    check_folder(term_key(term, "model_dir"), model_dir, CLIP_MODEL_REQUIRED)
    check_folder(term_key(term, "processor_dir"), processor_dir, PROCESSOR_REQUIRED)
    quiet_libraries()
    from transformers import CLIPModel, CLIPProcessor

    try:
        processor = CLIPProcessor.from_pretrained(processor_dir, local_files_only=True, backend="pil")
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        raise ModelError(f"{term_key(term, 'processor_dir')}: cannot load {processor_dir!r} ({one_line(e)})") from None
    try:
        model = CLIPModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                          dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{term_key(term, 'model_dir')}: cannot load {model_dir!r} ({one_line(e)})") from None
    return processor, model.to(device).eval().requires_grad_(False)


def projected(out) -> torch.Tensor:
    """The projected embedding from get_image_features / get_text_features (transformers 5
    returns a ModelOutput with it in pooler_output, 4.x the tensor itself)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output
