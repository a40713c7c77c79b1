"""DDPO's model-free rewards: the size of the image as a JPEG (quality 95) in kilobytes.
`jpeg_incompressibility` is the size, `jpeg_compressibility` its negative (Flow-GRPO and
DiffusionNFT divide by 500 as well: a weight of 1/500 gives theirs). The prompt is not used."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from hpcnft.rewards.base import as_uint8_numpy

JPEG_QUALITY = 95


def jpeg_kilobytes(image: np.ndarray) -> float:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.tell() / 1000


class JpegSize:
    def __init__(self, sign: float):
        self.sign = sign

    def __call__(self, prompts: list[str], images) -> torch.Tensor:
        sizes = [jpeg_kilobytes(im) for im in as_uint8_numpy(images)]
        return torch.tensor([self.sign * s for s in sizes], dtype=torch.float32)


def load(term, cfg, device: torch.device) -> JpegSize:
    return JpegSize(-1.0 if term.kind == "jpeg_compressibility" else 1.0)
