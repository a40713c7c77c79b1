"""PickScore: real CLIP preprocessing and the formula score = exp(logit_scale) * cos / 26."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

PICKSCORE_DIVISOR = 26.0


def _embedding(out) -> torch.Tensor:
    # transformers 5 returns a ModelOutput with the projected embedding in pooler_output.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def clip_pixel_values(images: torch.Tensor, image_processor, device: torch.device) -> torch.Tensor:
    """CLIP's image preprocessing as tensor ops on `device` (perf.pickscore_preprocess="device"):
    resize the shortest edge with antialiased bicubic (a = -0.5, PIL's kernel), round to uint8
    as PIL's resize does, centre crop, rescale, normalise. Pixels land within a grey level or so
    of the PIL path's."""
    ip = image_processor
    edge, crop = ip.size.shortest_edge, (ip.crop_size.height, ip.crop_size.width)
    if not (edge and ip.do_resize and ip.do_center_crop and ip.resample == Image.Resampling.BICUBIC):
        raise ValueError("perf.pickscore_preprocess=\"device\": the processor is not CLIP's "
                         "(shortest-edge bicubic resize and centre crop)")
    x = images.to(device).permute(0, 3, 1, 2).float()
    h, w = x.shape[-2:]
    short, long = min(h, w), max(h, w)
    size = (edge, int(edge * long / short)) if h <= w else (int(edge * long / short), edge)
    x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    x = x.round().clamp(0, 255)
    top, left = (x.shape[-2] - crop[0]) // 2, (x.shape[-1] - crop[1]) // 2
    x = x[..., top:top + crop[0], left:left + crop[1]] * ip.rescale_factor
    mean = torch.tensor(ip.image_mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(ip.image_std, device=device).view(1, 3, 1, 1)
    return (x - mean) / std


CLIP_TEXT_TOKENS = 77


class PickScoreScorer:
    """PickScore of (prompt, image) pairs. `preprocess_on_device` (perf.pickscore_preprocess =
    "device") is the GPU-friendly path: CLIP's image preprocessing as tensor ops on the device,
    and the prompts padded to CLIP's full 77 tokens instead of the batch's longest, so the text
    tower always sees one shape (a new length makes cuDNN's attention plan its kernels afresh,
    ~0.5 s on an H200). Under CLIP's causal mask the padding after the end token changes nothing
    the pooled end-token embedding sees: the score moves by rounding only."""

    def __init__(self, processor, model, device: torch.device, preprocess_on_device: bool = False):
        self.processor, self.model, self.device = processor, model, device
        self.preprocess_on_device = preprocess_on_device

    def pixel_values(self, images: np.ndarray | torch.Tensor) -> torch.Tensor:
        if self.preprocess_on_device:
            return clip_pixel_values(torch.as_tensor(images), self.processor.image_processor, self.device)
        if isinstance(images, torch.Tensor):
            images = images.cpu().numpy()  # on the reward rank's GPU under layout.reward_transport=nccl
        pil = [Image.fromarray(np.ascontiguousarray(im)) for im in images]
        return self.processor(images=pil, return_tensors="pt")["pixel_values"].to(self.device)

    def text_tokens(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask on the device: padded to the batch's longest prompt (the
        PickScore reference's preprocessing), or to 77 tokens on the device path."""
        padding = "max_length" if self.preprocess_on_device else True
        text = self.processor(text=prompts, padding=padding, truncation=True, max_length=CLIP_TEXT_TOKENS,
                              return_tensors="pt")
        return {k: text[k].to(self.device) for k in ("input_ids", "attention_mask")}

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor:
        """prompts[i] vs images[i] ([n, H, W, 3] uint8) -> float32 scores [n] on the CPU."""
        pixels = self.pixel_values(images)
        text = self.text_tokens(prompts)
        img = _embedding(self.model.get_image_features(pixel_values=pixels))
        txt = _embedding(self.model.get_text_features(**text))
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        scores = self.model.logit_scale.exp() * (img * txt).sum(-1) / PICKSCORE_DIVISOR
        return scores.float().cpu()


def load(term, cfg, device: torch.device) -> PickScoreScorer:
    """The term's folder, else models.pickscore_dir, else the tiny PickScore; under the
    perf.pickscore_* levers."""
    from hpcnft.models.loading import load_pickscore, resolve_model_paths
    from hpcnft.perf import levers

    model = term.model_dir or resolve_model_paths(cfg).pickscore
    processor = term.processor_dir or (cfg.models.pickscore_processor_dir if not term.model_dir else "") or model
    return levers.prepare_scorer(PickScoreScorer(*load_pickscore(model, processor, device), device), cfg)


def build_tiny(term, cfg) -> None:
    """The tiny PickScore (built with the tiny SD3) where no folder is named."""
    if not term.model_dir and not cfg.models.pickscore_dir:
        from hpcnft.models.loading import resolve_model_paths

        resolve_model_paths(cfg)
