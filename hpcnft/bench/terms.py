"""The reward terms beside PickScore at the bench's shapes, with random weights: each term's own
class (HPSv2Scorer, ClipScoreTerm, AestheticTerm, JpegSize) around a random-weight CLIPModel of
the shapes' config (sd35m: open_clip's ViT-H-14 for HPSv2, openai's ViT-L/14 for CLIP score and
aesthetic), with the tiny models' CLIP tokenizers and processors, whose preprocessing sizes are
the real ones. The towers are float32 on the device, as a job loads them; no perf lever
touches these terms. The OCR term is the real one (its models come with the `ocr` extra), on the
CPU as a reward rank runs it (one thread, determinism.cpu_threads), or on the GPU where
onnxruntime-gpu is installed, scoring images of the OCR task's size (512 pixels, whatever the
shapes: the recognizer's time depends on the image alone) that show their prompt's quoted text."""
from __future__ import annotations

from hpcnft.bench.shapes import Shapes, _torch

TERMS = ("hpsv2", "clipscore", "aesthetic", "jpeg", "ocr")
SEEDS = {"hpsv2": 5, "clipscore": 6, "aesthetic": 7, "ocr": 8}
OCR_SIZE = 512  # sd35m_ocr's images
OCR_WORDS = ("OPEN LATE", "COFFEE", "SALE", "HELLO WORLD", "EXIT", "FREE HUGS", "BAKERY", "STOP")


def text_images(n: int, size: int = OCR_SIZE, seed: int = SEEDS["ocr"]) -> tuple[list[str], object]:
    """n prompts quoting a word and [n, size, size, 3] uint8 images showing it: dark DejaVu Sans
    text of 32-72 px at a seeded place on a smooth background (random colours upsampled), as a
    generated sign might look."""
    import numpy as np
    from matplotlib import font_manager
    from PIL import Image, ImageDraw, ImageFont

    torch = _torch()
    rng = np.random.default_rng(seed)
    font_path = font_manager.findfont("DejaVu Sans", fallback_to_default=False)
    low = torch.from_numpy(rng.uniform(150, 255, (n, 3, 8, 8)).astype(np.float32))
    backgrounds = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    backgrounds = backgrounds.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    prompts, images = [], []
    for i in range(n):
        word = OCR_WORDS[i % len(OCR_WORDS)]
        font = ImageFont.truetype(font_path, int(rng.integers(32, 73)))
        im = Image.fromarray(backgrounds[i])
        draw = ImageDraw.Draw(im)
        left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        x = int(rng.integers(0, max(1, size - (right - left))))
        y = int(rng.integers(0, max(1, size - (bottom - top))))
        draw.text((x - left, y - top), word, fill=tuple(int(c) for c in rng.integers(0, 60, 3)), font=font)
        prompts.append(f'a sign that says "{word}"')
        images.append(np.asarray(im))
    return prompts, torch.from_numpy(np.stack(images))


def hpsv2_tokenizer():
    from transformers import CLIPTokenizer

    from hpcnft.models.tiny_cache import cache_dir, ensure_tiny
    from hpcnft.rewards.hpsv2 import TINY_DIRNAME, build_tiny_hpsv2

    return CLIPTokenizer.from_pretrained(ensure_tiny(cache_dir(), TINY_DIRNAME, build_tiny_hpsv2),
                                         local_files_only=True)


def clip_l_processor():
    from transformers import CLIPProcessor

    from hpcnft.models.tiny_cache import cache_dir, ensure_tiny
    from hpcnft.rewards.clip_l import CLIP_L_TINY, build_tiny_clip_l

    return CLIPProcessor.from_pretrained(ensure_tiny(cache_dir(), CLIP_L_TINY, build_tiny_clip_l),
                                         local_files_only=True, backend="pil")


def tower_config(S: Shapes, kind: str, tokenizer):
    """The CLIPConfig of a term's towers at the shapes S (the special ids from `tokenizer`)."""
    from hpcnft.rewards.clip_l import clip_l_config
    from hpcnft.rewards.hpsv2 import clip_config

    if kind == "hpsv2":
        return clip_config(S.hpsv2_arch, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return clip_l_config(S.clip_l, tokenizer)


def tower_params(model) -> dict:
    """Parameters of each tower of a CLIPModel, its projection included (open_clip counts so)."""
    count = lambda *mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    return {"vision_params": count(model.vision_model, model.visual_projection),
            "text_params": count(model.text_model, model.text_projection)}


def random_clip(config, dev, seed: int):
    torch = _torch()
    from transformers import CLIPModel

    torch.manual_seed(seed)
    with torch.device(dev):
        return CLIPModel(config).eval().requires_grad_(False)


def build_term(S: Shapes, kind: str, dev) -> tuple[object, dict]:
    """(the term, what it runs: its parameters by tower, dtype and device)."""
    torch = _torch()
    if kind == "ocr":
        from hpcnft.rewards.ocr import OcrTerm, build_engine

        engine = build_engine(dev, threads=1)
        provider = engine.text_det.infer.session.get_providers()[0]
        return OcrTerm(engine), {"device": "cuda" if provider.startswith("CUDA") else "cpu", "threads": 1,
                                 "image_side": OCR_SIZE, "models": "PP-OCRv4 det + rec (rapidocr-onnxruntime)"}
    if kind == "jpeg":
        from hpcnft.rewards.jpeg import JpegSize

        return JpegSize(1.0), {"device": "cpu"}  # jpeg_incompressibility; the other sign costs the same
    if kind == "hpsv2":
        from hpcnft.rewards.hpsv2 import HPSv2Scorer

        tokenizer = hpsv2_tokenizer()
        model = random_clip(tower_config(S, kind, tokenizer), dev, SEEDS[kind])
        return HPSv2Scorer(tokenizer, model, dev), {**tower_params(model), "dtype": "fp32", "device": str(dev)}
    if kind not in ("clipscore", "aesthetic"):
        raise ValueError(f"unknown reward term {kind!r} (choose from {', '.join(TERMS)})")
    processor = clip_l_processor()
    model = random_clip(tower_config(S, kind, processor.tokenizer), dev, SEEDS[kind])
    about = {**tower_params(model), "dtype": "fp32", "device": str(dev)}
    if kind == "clipscore":
        from hpcnft.rewards.clipscore import ClipScoreTerm

        return ClipScoreTerm(processor, model, dev), about
    from hpcnft.rewards.aesthetic import AestheticMLP, AestheticTerm

    torch.manual_seed(SEEDS[kind])
    head = AestheticMLP(model.config.projection_dim).to(dev).eval().requires_grad_(False)
    about["head_params"] = sum(p.numel() for p in head.parameters())
    return AestheticTerm(processor, model, head, dev), about
