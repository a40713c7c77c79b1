"""The `[models]` section: the base model's family and the model folders (hpcnft.models.loading
reads them; an empty folder means the tiny model)."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting

# The base-model families by name: hpcnft.models.families.FAMILIES has one of each (a test holds
# the two together; the families themselves import torch).
FAMILIES = ("sd3", "flux", "qwen_image", "wan")
FLUX_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline refuses more T5 tokens
QWEN_IMAGE_MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline refuses more text tokens


@dataclass
class ModelsConfig:
    family: str = setting(
        "sd3", "the base model's family: `sd3` (SD3.5-M, SD3.5-L; `models.sd3_dir`), `flux` (FLUX.1-dev; "
        "`models.flux_dir`), `qwen_image` (Qwen-Image; `models.qwen_image_dir`) or `wan` (Wan2.1 T2V, video; "
        "`models.wan_dir`); see "
        "[Base models](recipes.md#base-models-sd35-large-and-flux1-dev)", choices=FAMILIES)
    sd3_dir: str = setting("", "the SD3.5 model folder (diffusers layout); empty: the tiny SD3, built into "
                           "`models.tiny_cache` on first use")
    flux_dir: str = setting("", "the FLUX.1-dev model folder (diffusers layout); empty: the tiny FLUX")
    qwen_image_dir: str = setting("", "the Qwen-Image model folder (diffusers layout); empty: the tiny Qwen-Image")
    wan_dir: str = setting("", "the Wan2.1 T2V model folder (diffusers layout); empty: the tiny Wan")
    pickscore_dir: str = setting("", "the PickScore model folder; empty: the tiny PickScore")
    pickscore_processor_dir: str = setting("", "PickScore's processor folder (CLIP-H's); empty: `models.pickscore_dir`")
    tiny_cache: str = setting("", "where the tiny models are built; empty: `$HPCNFT_CACHE/tiny-models`, or "
                              "`~/.cache/hpcnft/tiny-models`", on_resume="free")
