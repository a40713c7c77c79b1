"""CLIP score as DiffusionNFT computes it (its clip_scorer.py): CLIP ViT-L/14's
logits_per_image.diagonal() / 100, that is exp(logit_scale) * cos(image, prompt) / 100.

The reference builds its image transform with torchvision from the processor's config and applies
it to the images as float tensors in [0, 1]. The same steps are written here with torch ops, so
that the term needs no torchvision; they follow torchvision >= 0.17 on tensors:
- uint8 / 255;
- T.Resize(size): for {"shortest_edge": s} the short edge becomes s and the long one
  int(s * long / short); bilinear (T.Resize's default, not the processor's bicubic) with
  antialias=True and align_corners=False; an image already at that size is left as it is;
- T.CenterCrop: top = int(round((h - crop_h) / 2)) (Python's round, halves to even) and the same
  for left; an image smaller than the crop is first zero-padded, (d // 2, (d + 1) // 2) per side;
- T.Normalize with the processor's mean and std: (x - mean) / std. There is no rescale step: the
  pixels are already in [0, 1].
The steps run on the term's device; a GPU's resize differs from the CPU's by float rounding only.
Prompts go through the processor's tokenizer padded to CLIP's 77 tokens and truncated."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hpcnft.rewards.base import as_uint8_numpy
from hpcnft.rewards.clip_l import clip_l_folder, load_clip_l
from hpcnft.rewards.config import RewardTermConfig

CLIP_TEXT_TOKENS = 77
LOGIT_DIVISOR = 100.0


def transform_size(size: dict) -> int | tuple[int, int]:
    """The size T.Resize / T.CenterCrop get from a processor's size dict (the reference's get_size)."""
    if isinstance(size, int):
        return (size, size)
    if "height" in size and "width" in size:
        return (size["height"], size["width"])
    if "shortest_edge" in size:
        return size["shortest_edge"]
    raise ValueError(f"invalid size: {size}")


def resized_hw(height: int, width: int, size: int | tuple[int, int]) -> tuple[int, int]:
    """T.Resize's output size: an int is the short edge (the long one truncated), a pair is (h, w)."""
    if isinstance(size, tuple):
        return size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def resize_bilinear(x: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """T.Resize(size) on float [n, C, H, W]: antialiased bilinear, half-pixel centres."""
    hw = resized_hw(x.shape[-2], x.shape[-1], size)
    if tuple(x.shape[-2:]) == hw:
        return x
    return F.interpolate(x, size=hw, mode="bilinear", align_corners=False, antialias=True)


def center_crop(x: torch.Tensor, crop: tuple[int, int]) -> torch.Tensor:
    """T.CenterCrop(crop) on [..., H, W]: zero padding where the image is smaller, then the
    crop whose corner torchvision rounds with round() (halves to even)."""
    crop_h, crop_w = crop
    h, w = x.shape[-2:]
    if crop_w > w or crop_h > h:
        dw, dh = max(crop_w - w, 0), max(crop_h - h, 0)
        x = F.pad(x, (dw // 2, (dw + 1) // 2, dh // 2, (dh + 1) // 2), value=0.0)
        h, w = x.shape[-2:]
        if (h, w) == (crop_h, crop_w):
            return x
    top, left = int(round((h - crop_h) / 2.0)), int(round((w - crop_w) / 2.0))
    return x[..., top:top + crop_h, left:left + crop_w]


def reference_pixels(images: np.ndarray, image_processor, device: torch.device) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> the reference's pixel_values [n, 3, crop_h, crop_w] on `device`."""
    config = image_processor.to_dict()
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2) / 255.0
    if config.get("do_resize"):
        x = resize_bilinear(x, transform_size(config["size"]))
    if config.get("do_center_crop"):
        crop = transform_size(config["crop_size"])
        x = center_crop(x, crop if isinstance(crop, tuple) else (crop, crop))
    if config.get("do_normalize"):
        mean = torch.as_tensor(image_processor.image_mean, dtype=x.dtype, device=device).view(-1, 1, 1)
        std = torch.as_tensor(image_processor.image_std, dtype=x.dtype, device=device).view(-1, 1, 1)
        x = (x - mean) / std
    return x


class ClipScoreTerm:
    """prompts[i] vs images[i] -> CLIP ViT-L/14 logits_per_image[i, i] / 100."""

    def __init__(self, processor, model, device: torch.device):
        self.processor, self.model, self.device = processor, model, device

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor:
        pixels = reference_pixels(as_uint8_numpy(images), self.processor.image_processor, self.device)
        # max_length is given so that a tokenizer saved without CLIP's model_max_length still pads to 77.
        text = self.processor(text=list(prompts), padding="max_length", truncation=True,
                              max_length=CLIP_TEXT_TOKENS, return_tensors="pt")
        out = self.model(pixel_values=pixels, input_ids=text["input_ids"].to(self.device),
                         attention_mask=text["attention_mask"].to(self.device))
        return (out.logits_per_image.diagonal() / LOGIT_DIVISOR).float().cpu()


def load(term: RewardTermConfig, cfg, device: torch.device) -> ClipScoreTerm:
    processor, model = load_clip_l(term, cfg, device)
    return ClipScoreTerm(processor, model, device)


def build_tiny(term: RewardTermConfig, cfg) -> None:
    """The tiny CLIP ViT-L/14 where the term names no folder (registry.build_tiny_models)."""
    clip_l_folder(term, cfg)
