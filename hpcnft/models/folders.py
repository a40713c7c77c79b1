"""What a model folder must hold, checked before anything loads, and the Hugging Face
libraries kept offline and quiet (set before they are first imported)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SD3_REQUIRED = ("model_index.json", "transformer/config.json", "vae/config.json", "scheduler",
                "text_encoder/config.json", "text_encoder_2/config.json", "text_encoder_3/config.json",
                "tokenizer", "tokenizer_2", "tokenizer_3")
FLUX_REQUIRED = ("model_index.json", "transformer/config.json", "vae/config.json", "scheduler",
                 "text_encoder/config.json", "text_encoder_2/config.json", "tokenizer", "tokenizer_2")
QWEN_IMAGE_REQUIRED = ("model_index.json", "transformer/config.json", "vae/config.json", "scheduler",
                       "text_encoder/config.json", "tokenizer")
WAN_REQUIRED = ("model_index.json", "transformer/config.json", "vae/config.json", "scheduler",
                "text_encoder/config.json", "tokenizer")
# what each base-model family's folder must hold, by models.family (its key: models.<family>_dir)
BASE_REQUIRED = {"sd3": SD3_REQUIRED, "flux": FLUX_REQUIRED, "qwen_image": QWEN_IMAGE_REQUIRED, "wan": WAN_REQUIRED}
PICKSCORE_REQUIRED = ("config.json",)
PROCESSOR_REQUIRED = ("preprocessor_config.json|processor_config.json",)  # "a|b": either


def quiet_libraries() -> None:
    """Keep library notices (no torchvision, shard-writing bars) out of the job's output."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()


class ModelError(Exception):
    """A model folder that is missing, incomplete or unloadable (one line)."""


def check_folder(key: str, path: str, required: tuple[str, ...]) -> None:
    if not path:
        raise ModelError(f"{key}: no folder given")
    if not os.path.isdir(path):
        raise ModelError(f"{key}: folder {path!r} does not exist")
    for rel in required:
        if not any(os.path.exists(os.path.join(path, alt)) for alt in rel.split("|")):
            raise ModelError(f"{key}: {path!r} is incomplete, {rel.replace('|', ' or ')} is missing")


# transformer/config.json's (_class_name, num_layers) -> the real model it is (hpcnft bench --shapes)
REAL_MODELS = {("SD3Transformer2DModel", 24): "sd35m", ("SD3Transformer2DModel", 38): "sd35l",
               ("FluxTransformer2DModel", 19): "flux1dev", ("QwenImageTransformer2DModel", 60): "qwen_image"}


def real_model(path: str) -> str:
    """Which real model a pipeline folder holds, read from its transformer's config.json without
    loading anything ("" for any other, the tiny models included)."""
    import json

    try:
        with open(os.path.join(path, "transformer", "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ""
    return REAL_MODELS.get((config.get("_class_name"), config.get("num_layers")), "")
