"""Model folders at the bench's real shapes with random weights, so a whole job (`hpcnft run`)
can be tried at the SD3.5-M sizes where no weights may be fetched: the SD3.5-M DiT and the SD3.5
VAE as `hpcnft bench` builds them, PickScore at CLIP-H's shape, and text encoders that are small
but emit the widths the DiT takes (T5 at 4096, pooled CLIP-L + CLIP-G at 768 + 1280).

    python3 -m hpcnft.bench.folders OUT [--shapes sd35m]

writes OUT/sd35_tiny and OUT/pickscore_tiny (the names `make-tiny` uses), weights in fp16.
"""
from __future__ import annotations

import argparse
import os

from hpcnft.bench.shapes import SHAPES, Shapes



def pooled_widths(pooled: int) -> tuple[int, int]:
    """CLIP-L's and CLIP-G's projection widths: SD3's pooled input is both side by side
    (768 + 1280 = 2048 in SD3.5)."""
    first = pooled * 3 // 8
    return first, pooled - first


def write_real_shape_folders(out_dir: str, S: Shapes, device: str = "cpu") -> tuple[str, str]:
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTextModelWithProjection, T5Config, \
        T5EncoderModel

    from hpcnft.models.tiny import build_tiny_models

    sd3, ps = build_tiny_models(out_dir)  # tokenizers, scheduler, processor and the folder layout

    def save(model, path: str) -> None:
        model.to(torch.float16).save_pretrained(path, safe_serialization=True)

    torch.manual_seed(0)
    with torch.device(device):
        save(SD3Transformer2DModel(**S.dit), os.path.join(sd3, "transformer"))
        save(AutoencoderKL(**S.vae), os.path.join(sd3, "vae"))
        for folder, width in zip(("text_encoder", "text_encoder_2"), pooled_widths(S.dit["pooled_projection_dim"])):
            cfg = CLIPTextConfig.from_pretrained(os.path.join(sd3, folder))
            cfg.projection_dim = width
            save(CLIPTextModelWithProjection(cfg), os.path.join(sd3, folder))
        t5 = T5Config.from_pretrained(os.path.join(sd3, "text_encoder_3"))
        t5.d_model = S.dit["joint_attention_dim"]
        save(T5EncoderModel(t5), os.path.join(sd3, "text_encoder_3"))
        tiny = CLIPConfig.from_pretrained(ps).text_config
        text = dict(S.clip_text, vocab_size=tiny.vocab_size, bos_token_id=tiny.bos_token_id,
                    eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id)
        save(CLIPModel(CLIPConfig(text_config=text, vision_config=S.clip_vision, projection_dim=S.clip_projection)),
             ps)
    return sd3, ps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hpcnft.bench.folders", description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder; receives sd35_tiny/ and pickscore_tiny/")
    p.add_argument("--shapes", choices=sorted(k for k in SHAPES if SHAPES[k]().family == "sd3"), default="sd35m",
                   help="SD3 shapes only (the folders are a StableDiffusion3Pipeline's)")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda is faster)")
    args = p.parse_args(argv)
    for path in write_real_shape_folders(args.out, SHAPES[args.shapes](), args.device):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
