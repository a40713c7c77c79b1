"""The bench's reward-term towers: the real shapes, and the phase's place on the command line."""
import argparse

import pytest
import torch

from hpcnft.bench import terms
from hpcnft.bench.shapes import sd35m_shapes

# open_clip's docs/model_profile.csv (millions of parameters: image tower, text tower, each with
# its projection): ViT-H-14 is the HPSv2 model, ViT-L-14 OpenAI's CLIP ViT-L/14.
OPEN_CLIP_PROFILE = {"ViT-H-14": (632.08, 354.03), "ViT-L-14": (303.97, 123.65)}


@pytest.mark.parametrize("kind, arch", [("hpsv2", "ViT-H-14"), ("clipscore", "ViT-L-14"),
                                        ("aesthetic", "ViT-L-14")])
def test_sd35m_towers_have_the_published_sizes(hpcnft_cache, kind, arch):
    from transformers import CLIPModel

    tokenizer = terms.hpsv2_tokenizer() if kind == "hpsv2" else terms.clip_l_processor().tokenizer
    config = terms.tower_config(sd35m_shapes(), kind, tokenizer)
    with torch.device("meta"):  # shapes only
        model = CLIPModel(config)
    params = terms.tower_params(model)
    vision, text = OPEN_CLIP_PROFILE[arch]
    assert round(params["vision_params"] / 1e6, 2) == vision
    assert round(params["text_params"] / 1e6, 2) == text
    # 224-pixel images in 14-pixel patches, as the terms' preprocessing makes them
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (224, 14)
    # OpenAI's ViT-L/14 uses quick GELU, open_clip's ViT-H-14 the exact one
    want_act = "gelu" if kind == "hpsv2" else "quick_gelu"
    assert config.vision_config.hidden_act == config.text_config.hidden_act == want_act


def test_clip_l_terms_preprocess_at_224(hpcnft_cache):
    ip = terms.clip_l_processor().image_processor
    assert ip.size["shortest_edge"] == 224 and (ip.crop_size["height"], ip.crop_size["width"]) == (224, 224)


def test_reward_terms_is_a_phase_but_not_a_default_one():
    from hpcnft.bench.command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments("bench", p)
    assert "reward_terms" not in p.parse_args([]).phases
    assert p.parse_args(["--phases", "reward_terms"]).phases == ["reward_terms"]


def test_unknown_term_is_named():
    with pytest.raises(ValueError, match="unknown reward term 'nope'"):
        terms.build_term(sd35m_shapes(), "nope", torch.device("cpu"))


def test_the_ocr_terms_bench_images_show_their_prompts_text():
    pytest.importorskip("rapidocr_onnxruntime")
    prompts, images = terms.text_images(3)
    assert images.shape == (3, terms.OCR_SIZE, terms.OCR_SIZE, 3) and images.dtype == torch.uint8
    term, about = terms.build_term(sd35m_shapes(), "ocr", torch.device("cpu"))
    assert about["device"] == "cpu" and about["threads"] == 1
    assert term(prompts, images).tolist() == [1.0, 1.0, 1.0]  # what the bench times is a full read
