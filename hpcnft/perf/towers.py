"""The VAE and PickScore towers in the levers' precision and layout: perf.vae_dtype,
vae_channels_last, compile_vae, cudnn_benchmark, pickscore_dtype, pickscore_preprocess."""
from __future__ import annotations

import torch

from hpcnft.perf.compiling import compile_module, inductor_options


VAE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def prepare_vae(vae, perf):
    """perf.vae_dtype (decode_to_uint8 casts the latents to the VAE's dtype), channels-last
    convolutions (NHWC, the tensor cores' native layout), a compiled decoder, and cuDNN's
    algorithm search (a process-wide switch; the VAE is what convolves)."""
    if perf.vae_dtype != "auto":
        vae.to(VAE_DTYPES[perf.vae_dtype])
    if perf.vae_channels_last:
        vae.to(memory_format=torch.channels_last)
    on_gpu = next(vae.parameters()).device.type == "cuda"
    if perf.cudnn_benchmark and on_gpu:
        torch.backends.cudnn.benchmark = True
    if perf.compile_vae and on_gpu and not getattr(vae.decoder, "_hpcnft_compiled", False):
        inductor_options(perf)
        compile_module(vae.decoder)
        vae.decoder._hpcnft_compiled = True
    return vae


class HalfPickScore:
    """A CLIPModel in half precision behind the three members PickScoreScorer uses: pixel
    values are cast in, embeddings come out in fp32, and logit_scale stays fp32."""

    def __init__(self, model, dtype=torch.float16):
        self.logit_scale = model.logit_scale.detach().float().clone()
        self.model = model.to(dtype)
        self.dtype = dtype

    @staticmethod
    def _fp32(out) -> torch.Tensor:
        return (out if isinstance(out, torch.Tensor) else out.pooler_output).float()

    def get_image_features(self, pixel_values, **kw):
        return self._fp32(self.model.get_image_features(pixel_values=pixel_values.to(self.dtype), **kw))

    def get_text_features(self, **kw):
        return self._fp32(self.model.get_text_features(**kw))


def prepare_scorer(scorer, cfg):
    """perf.pickscore_dtype = fp16: the scorer's model in half precision; perf.pickscore_preprocess
    = device: CLIP's image preprocessing as tensor ops on the scorer's device and prompts padded
    to 77 tokens (PickScoreScorer)."""
    if cfg.perf.pickscore_dtype == "fp16" and not isinstance(scorer.model, HalfPickScore):
        scorer.model = HalfPickScore(scorer.model, torch.float16)
    scorer.preprocess_on_device = cfg.perf.pickscore_preprocess == "device"
    return scorer
