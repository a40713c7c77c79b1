"""The reward terms beside PickScore at the bench's shapes, with random weights: each term's own
class (HPSv2Scorer, ClipScoreTerm, AestheticTerm, JpegSize) around a random-weight CLIPModel of
the shapes' config (sd35m: open_clip's ViT-H-14 for HPSv2, openai's ViT-L/14 for CLIP score and
aesthetic), with the tiny models' CLIP tokenizers and processors, whose preprocessing sizes are
the real ones. The towers are float32 on the device, as a job loads them; no perf lever
touches these terms."""
from __future__ import annotations

from hpcnft.bench.shapes import Shapes, _torch

TERMS = ("hpsv2", "clipscore", "aesthetic", "jpeg")
SEEDS = {"hpsv2": 5, "clipscore": 6, "aesthetic": 7}


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
