"""The bench's random-weight models at its shapes: the family's DiT (on the device, or in host
memory with its random fills drawn on every core), the family's VAE, PickScore's CLIP-H and the
CLIP processor. Each is seeded: the same weights every build."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os

from hpcnft.bench.shapes import Shapes, _torch

VAE_CLASSES = {"qwen_image": "AutoencoderKLQwenImage", "wan": "AutoencoderKLWan"}  # else SD3's and FLUX's


def build_dit(S: Shapes, dev):
    """The family's DiT at the shapes, random weights (fp32) on `dev`."""
    torch = _torch()
    import diffusers

    from hpcnft.models.families import family_named

    torch.manual_seed(0)
    with torch.device(dev):
        return getattr(diffusers, family_named(S.family).transformer_class)(**S.dit)


# torch.nn.init's random fills: a CPU runs each on one core (SD3.5-L's 8 B parameters: 94 s on 16)
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_")


@contextlib.contextmanager
def _deferred_random_init(calls: list):
    """torch.nn.init's random fills recorded in `calls` instead of run (the tensors stay empty)."""
    init = _torch().nn.init
    saved = {name: getattr(init, name) for name in _RANDOM_INITS}

    def deferring(fn):
        def record(tensor, *args, **kwargs):
            calls.append((fn, tensor, args, kwargs))
            return tensor
        return record

    for name, fn in saved.items():
        setattr(init, name, deferring(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def build_dit_on_host(S: Shapes):
    """build_dit's DiT in host memory, fp32, its random fills (the same init functions and
    bounds) drawn on every core, each from its own seeded generator: the same weights whatever
    the threads' order."""
    torch = _torch()
    calls = []
    with _deferred_random_init(calls):
        dit = build_dit(S, torch.device("cpu"))

    # a tensor filled twice (a module's own init after nn.Linear's) is filled in the same order
    by_storage: dict[int, list[int]] = {}
    for i, (_, tensor, _, _) in enumerate(calls):
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(i)

    def fill(indices: list[int]) -> None:
        for i in indices:
            fn, tensor, args, kwargs = calls[i]
            with torch.no_grad():
                fn(tensor, *args, **kwargs, generator=torch.Generator().manual_seed(i))

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(fill, by_storage.values()))
    return dit


def build_vae(S: Shapes, dev):
    torch = _torch()
    import diffusers

    cls = getattr(diffusers, VAE_CLASSES.get(S.family, "AutoencoderKL"))
    torch.manual_seed(1)
    with torch.device(dev):
        return cls(**S.vae).eval().requires_grad_(False)


def build_clip(S: Shapes, dev):
    torch = _torch()
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(2)
    cfg = CLIPConfig(text_config=S.clip_text, vision_config=S.clip_vision, projection_dim=S.clip_projection)
    with torch.device(dev):
        return CLIPModel(cfg).eval().requires_grad_(False)


_PROCESSOR = []


def clip_processor():
    """The CLIP-H preprocessing and a CLIP BPE tokenizer, from the tiny models (built offline)."""
    if not _PROCESSOR:
        from transformers import AutoProcessor

        from hpcnft.models.folders import quiet_libraries
        from hpcnft.models.tiny import ensure_tiny_models
        from hpcnft.models.tiny_cache import cache_dir

        quiet_libraries()
        _, ps = ensure_tiny_models(cache_dir())
        _PROCESSOR.append(AutoProcessor.from_pretrained(ps, local_files_only=True))
    return _PROCESSOR[0]
