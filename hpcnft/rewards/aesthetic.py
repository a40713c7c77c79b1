"""The LAION improved aesthetic predictor (v2, sac+logos+ava1-l14-linearMSE.pth) as DiffusionNFT
scores it (its aesthetic_scorer.py): CLIP ViT-L/14's image embedding from the
CLIPProcessor's own preprocessing, L2-normalised, through the predictor's MLP head.

The head's file is `weights`, by default sac+logos+ava1-l14-linearMSE.pth inside model_dir (the
CLIP folder). It is read with torch.load(weights_only=True): tensors only, no pickled code. The
head's input width is the CLIP projection width (768 for ViT-L/14). The tiny head (model_dir
empty) is a seeded one for the tiny CLIP's projection width, in its own cache folder."""
from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image
from torch import nn

from hpcnft.common.errors import one_line
from hpcnft.models.folders import ModelError
from hpcnft.models.tiny_cache import ensure_tiny, tiny_cache
from hpcnft.rewards.base import as_uint8_numpy
from hpcnft.rewards.clip_l import TINY_CLIP_L, clip_l_folder, load_clip_l, projected, term_key
from hpcnft.rewards.config import RewardTermConfig

HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
AESTHETIC_TINY = "aesthetic_tiny"


class AestheticMLP(nn.Module):
    """The predictor's head; state-dict keys layers.0, .2, .4, .6, .7 as in the released file.
    The dropouts are inactive in eval mode."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


def build_tiny_head(folder: str, seed: int = 0) -> None:
    """A seeded head for the tiny CLIP's projection width, written as FOLDER/HEAD_FILE."""
    torch.manual_seed(seed)
    torch.save(AestheticMLP(TINY_CLIP_L["projection_dim"]).state_dict(), os.path.join(folder, HEAD_FILE))


def head_path(term: RewardTermConfig, cfg) -> str:
    if term.weights:
        return term.weights
    if term.model_dir:
        return os.path.join(term.model_dir, HEAD_FILE)
    return os.path.join(ensure_tiny(tiny_cache(cfg), AESTHETIC_TINY, build_tiny_head), HEAD_FILE)


def load_head(path: str, key: str, width: int) -> AestheticMLP:
    """The MLP from its .pth (tensors only), checked against the CLIP projection width."""
    if not os.path.isfile(path):
        raise ModelError(f"{key}: aesthetic head file {path!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        raise ModelError(f"{key}: cannot load {path!r} ({one_line(e)})") from None
    first = state.get("layers.0.weight") if isinstance(state, dict) else None
    if first is None or first.ndim != 2 or first.shape[1] != width:
        found = f"{first.shape[1]}-wide" if first is not None and first.ndim == 2 else "no layers.0.weight"
        raise ModelError(f"{key}: {path!r} is not an aesthetic head for {width}-wide CLIP embeddings ({found})")
    head = AestheticMLP(width)
    try:
        head.load_state_dict({k: v.float() for k, v in state.items()})
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{key}: cannot load {path!r} ({one_line(e)})") from None
    return head


class AestheticTerm:
    """images[i] -> the predicted aesthetic rating (the prompts are not used)."""

    def __init__(self, processor, model, head: AestheticMLP, device: torch.device):
        self.processor, self.model, self.head, self.device = processor, model, head, device

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor:
        pil = [Image.fromarray(im) for im in as_uint8_numpy(images)]
        pixels = self.processor(images=pil, return_tensors="pt")["pixel_values"].to(self.device)
        embed = projected(self.model.get_image_features(pixel_values=pixels))
        embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        return self.head(embed).squeeze(1).float().cpu()


def load(term: RewardTermConfig, cfg, device: torch.device) -> AestheticTerm:
    processor, model = load_clip_l(term, cfg, device)
    head = load_head(head_path(term, cfg), term_key(term, "weights"), model.config.projection_dim)
    return AestheticTerm(processor, model, head.to(device).eval().requires_grad_(False), device)


def build_tiny(term: RewardTermConfig, cfg) -> None:
    """The tiny CLIP and head where the term names no folder (registry.build_tiny_models)."""
    clip_l_folder(term, cfg)
    head_path(term, cfg)
