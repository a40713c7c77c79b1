"""Signs of reward hacking the engine measures ([watch]): how different a prompt's images are
from each other (collapse to one image is a classic hack), and how far the policy has moved from
its base. Pure functions of tensors; hpcnft.algo.iteration calls them."""
from __future__ import annotations

import torch

THUMB_SIDE = 32  # images are compared as 32x32 RGB thumbnails: cheap, and blind to pixel noise


def thumbnails(images: torch.Tensor, side: int = THUMB_SIDE) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float64 [n, 3 * side * side] in 0..1, each pixel the mean of its
    area (adaptive average pooling); a video's frames [n, F, H, W, 3] -> [n, F * 3 * side * side]."""
    if images.dim() == 5:
        return thumbnails(images.flatten(0, 1), side).reshape(images.shape[0], -1)
    x = images.permute(0, 3, 1, 2).to(torch.float64) / 255.0
    return torch.nn.functional.adaptive_avg_pool2d(x, side).flatten(1)


def group_diversity(thumbs: torch.Tensor, group: int) -> float:
    """The mean over prompt groups (consecutive rows of `group` samples) of the mean RMS distance
    between two different samples of the group: 0 when every group is one image repeated; at
    most 1 (black against white)."""
    n = thumbs.shape[0] // group
    rows = thumbs[:n * group].reshape(n, group, -1)
    d = torch.cdist(rows, rows) / rows.shape[-1] ** 0.5  # [n, g, g] RMS distances
    pairs = group * (group - 1)
    return float(d.sum() / (n * pairs)) if pairs else 0.0


def velocity_drift(v_policy: torch.Tensor, v_base: torch.Tensor) -> torch.Tensor:
    """The mean squared difference per sample ([n, ...] -> [n], float64)."""
    diff = v_policy.to(torch.float64) - v_base.to(torch.float64)
    return diff.pow(2).flatten(1).mean(dim=1)
