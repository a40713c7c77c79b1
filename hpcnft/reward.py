"""PickScore: real CLIP preprocessing and the formula score = exp(logit_scale) * cos / 26."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

PICKSCORE_DIVISOR = 26.0


def _embedding(out) -> torch.Tensor:
    # transformers 5 returns a ModelOutput with the projected embedding in pooler_output.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class PickScoreScorer:
    def __init__(self, processor, model, device: torch.device):
        self.processor, self.model, self.device = processor, model, device

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor:
        """prompts[i] vs images[i] ([n, H, W, 3] uint8) -> float32 scores [n] on the CPU."""
        if isinstance(images, torch.Tensor):
            images = images.numpy()
        pil = [Image.fromarray(np.ascontiguousarray(im)) for im in images]
        pixels = self.processor(images=pil, return_tensors="pt")["pixel_values"].to(self.device)
        text = self.processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = _embedding(self.model.get_image_features(pixel_values=pixels))
        txt = _embedding(self.model.get_text_features(input_ids=text["input_ids"].to(self.device),
                                                      attention_mask=text["attention_mask"].to(self.device)))
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        scores = self.model.logit_scale.exp() * (img * txt).sum(-1) / PICKSCORE_DIVISOR
        return scores.float().cpu()
