"""Load SD3 parts and PickScore from local folders (disk only), or the tiny models.

Every loader checks the folder first and turns any failure into one ModelError line naming
the config key and the path, so a typo in a path never ends in a traceback."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from hpcnft.common.config import Config
from hpcnft.common.errors import one_line
from hpcnft.models.folders import (PICKSCORE_REQUIRED, PROCESSOR_REQUIRED, SD3_REQUIRED, ModelError, check_folder,
                                   quiet_libraries)


@dataclass
class ModelPaths:
    sd3: str
    pickscore: str
    pickscore_processor: str


def resolve_model_paths(cfg: Config, build_tiny: bool = True) -> ModelPaths:
    """Model folders from the config; the tiny models (built on first use) where a path is empty."""
    m = cfg.models
    sd3, ps = m.sd3_dir, m.pickscore_dir
    if not sd3 or not ps:
        from hpcnft.models.tiny import ensure_tiny_models
        from hpcnft.models.tiny_cache import cache_dir

        cache = m.tiny_cache or cache_dir()
        tiny_sd3, tiny_ps = ensure_tiny_models(cache) if build_tiny else (None, None)
        sd3, ps = sd3 or tiny_sd3, ps or tiny_ps
    return ModelPaths(sd3, ps, m.pickscore_processor_dir or ps)


def load_sd3_pipeline(path: str, dtype: torch.dtype, device: torch.device):
    """The real diffusers StableDiffusion3Pipeline from a local folder (safetensors only)."""
    check_folder("models.sd3_dir", path, SD3_REQUIRED)
    quiet_libraries()
    from diffusers import StableDiffusion3Pipeline

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            pipe = StableDiffusion3Pipeline.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                            dtype=dtype)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        raise ModelError(f"models.sd3_dir: cannot load {path!r} ({one_line(e)})") from None
    pipe.set_progress_bar_config(disable=True)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer"):
        getattr(pipe, name).to(device).requires_grad_(False).eval()
    return pipe


def load_pickscore(model_path: str, processor_path: str, device: torch.device):
    """PickScore (a CLIPModel) and its CLIP processor from local folders."""
    check_folder("models.pickscore_dir", model_path, PICKSCORE_REQUIRED)
    check_folder("models.pickscore_processor_dir", processor_path, PROCESSOR_REQUIRED)
    from transformers import AutoModel, AutoProcessor

    quiet_libraries()
    try:
        processor = AutoProcessor.from_pretrained(processor_path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"models.pickscore_processor_dir: cannot load {processor_path!r} ({one_line(e)})") from None
    try:
        model = AutoModel.from_pretrained(model_path, local_files_only=True, use_safetensors=True)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"models.pickscore_dir: cannot load {model_path!r} ({one_line(e)})") from None
    return processor, model.to(device).eval().requires_grad_(False)
