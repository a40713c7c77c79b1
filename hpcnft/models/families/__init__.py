"""Base-model families: what differs between SD3, FLUX.1, Qwen-Image and Wan2.1 (text encoders
and prompt encoding, latent packing and image ids, a video's frame axis and its decode, timestep
and guidance conditioning, the sampler's sigma grid, the pipeline class), behind one small
interface (`base.Family`). The NFT math, the trainer, the
layout, the run file and the checkpoints know only that interface.

The family of a DiT is known by its class (`family_of`), so that the sampler and the trainer need
no more than the transformer they already hold; a config names it with `models.family`."""
from __future__ import annotations

from hpcnft.models.families.base import Family
from hpcnft.models.families.flux import FLUX
from hpcnft.models.families.qwen_image import QWEN_IMAGE
from hpcnft.models.families.sd3 import SD3
from hpcnft.models.families.wan import WAN

# one per name of models.family's choices, hpcnft.models.config.FAMILIES (a test holds the two)
FAMILIES: dict[str, Family] = {f.name: f for f in (SD3, FLUX, QWEN_IMAGE, WAN)}


def family_named(name: str) -> Family:
    return FAMILIES[name]


_BY_CLASS: dict[type, Family] = {}


def family_of(transformer) -> Family:
    """The family whose DiT class `transformer` is (FSDP2 and peft keep the class an instance)."""
    cls = type(transformer)
    if cls not in _BY_CLASS:
        owners = [f for f in FAMILIES.values() if f.owns(transformer)]
        if not owners:
            raise TypeError(f"no model family takes a {cls.__name__}")
        _BY_CLASS[cls] = owners[0]
    return _BY_CLASS[cls]
