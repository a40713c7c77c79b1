"""Load the base model (its family's diffusers pipeline) and PickScore from local folders (disk
only), or the tiny models.

Every loader checks the folder first and turns any failure into one ModelError line naming
the config key and the path, so a typo in a path never ends in a traceback."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcnft.common.errors import one_line
from hpcnft.models.families import Family, family_named
from hpcnft.models.folders import PICKSCORE_REQUIRED, PROCESSOR_REQUIRED, ModelError, check_folder, quiet_libraries
from hpcnft.models.tiny_cache import ensure_tiny, tiny_cache, tiny_models_used


@dataclass
class ModelPaths:
    base: str  # the base model's folder (models.sd3_dir, flux_dir or qwen_image_dir, by models.family)
    pickscore: str
    pickscore_processor: str


def check_model_folders(cfg, paths: ModelPaths) -> None:
    """Every folder this config loads holds, tensor for tensor, what its configs make (a rank's
    check before the rendezvous: a wrong shape or a missing shard is one ModelError line naming
    the key and the file, and nothing is written to the run dir)."""
    from hpcnft.models.folder_check import check_processor, check_tensors
    from hpcnft.models.tiny_cache import reads_pickscore_dir

    family = base_family(cfg)
    check_tensors(family.dir_key, paths.base)
    if reads_pickscore_dir(cfg):
        check_tensors("models.pickscore_dir", paths.pickscore)
        check_processor("models.pickscore_processor_dir", paths.pickscore_processor, paths.pickscore)


def base_family(cfg) -> Family:
    return family_named(cfg.models.family)


def resolve_model_paths(cfg) -> ModelPaths:
    """Model folders from the config; the tiny models (built on first use) where a path is empty."""
    family, m = base_family(cfg), cfg.models
    base, ps = family.model_dir(m), m.pickscore_dir
    sd3_and_pickscore, own = tiny_models_used(cfg)
    if sd3_and_pickscore:
        from hpcnft.models.tiny import ensure_tiny_models

        tiny_sd3, tiny_ps = ensure_tiny_models(tiny_cache(cfg))
        base = base or (tiny_sd3 if family.name == "sd3" else "")
        ps = ps or tiny_ps
    if own:  # the family's own tiny model (FLUX.1-dev's, Qwen-Image's, Wan's)
        base = ensure_tiny(tiny_cache(cfg), family.tiny_dirname, family.build_tiny)
    return ModelPaths(base, ps, m.pickscore_processor_dir or ps)


def import_libraries(cfg) -> None:
    """Import the classes that loading this config's models imports (its family's diffusers
    pipeline; transformers' CLIP, which PickScore and the CLIP-based reward terms are), loading
    no weights and running no torch operation."""
    quiet_libraries()
    import diffusers
    import transformers

    getattr(diffusers, base_family(cfg).pipeline_class)
    for name in ("CLIPModel", "CLIPProcessor", "AutoModel", "AutoProcessor"):
        getattr(transformers, name)


def load_sd3_pipeline(path: str, dtype: torch.dtype, device: torch.device):
    """The real diffusers StableDiffusion3Pipeline from a local folder (safetensors only)."""
    return family_named("sd3").load(path, dtype, device)


def load_base_pipeline(cfg, path: str, dtype: torch.dtype, device: torch.device):
    """The base model's real diffusers pipeline (StableDiffusion3Pipeline, FluxPipeline)."""
    return base_family(cfg).load(path, dtype, device)


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
