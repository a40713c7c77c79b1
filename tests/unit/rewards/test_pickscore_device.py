"""perf.pickscore_preprocess="device": CLIP's preprocessing as tensor ops lands within about a
grey level of the processor's PIL path, so PickScore barely moves; non-CLIP processors are refused."""
import copy

import pytest
import torch

from hpcnft.rewards.pickscore import PickScoreScorer, clip_pixel_values
from hpcnft.models.loading import load_pickscore


def _smooth(n, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 12, 12, generator=g) * 255
    up = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    return up.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


@pytest.fixture(scope="module")
def scorer(tiny_models):
    processor, model = load_pickscore(tiny_models[1], tiny_models[1], torch.device("cpu"))
    return PickScoreScorer(processor, model, torch.device("cpu"))


@pytest.mark.parametrize("h,w", [(512, 512), (384, 512), (512, 320)])
def test_device_pixels_are_within_a_grey_level_of_pil(scorer, h, w):
    images = _smooth(6, h, w)
    scorer.preprocess_on_device = False
    pil = scorer.pixel_values(images)
    scorer.preprocess_on_device = True
    dev = scorer.pixel_values(images)
    assert dev.shape == pil.shape == (6, 3, 224, 224)
    std = torch.tensor(scorer.processor.image_processor.image_std).view(1, 3, 1, 1)
    grey_levels = ((dev - pil) * std * 255).abs()
    assert grey_levels.max() <= 1.5 and grey_levels.mean() < 0.3


def test_device_preprocessing_barely_moves_the_score(scorer):
    images = _smooth(8, 512, 512, seed=1)
    prompts = [f"a photo number {i}" for i in range(8)]
    scorer.preprocess_on_device = False
    pil = scorer(prompts, images)
    scorer.preprocess_on_device = True
    dev = scorer(prompts, images)
    assert not torch.equal(dev, pil)  # a different path ...
    assert (dev - pil).abs().max() < 0.05 * pil.std()  # ... well inside the spread of the scores


def test_a_processor_that_is_not_clips_is_refused(scorer):
    ip = copy.deepcopy(scorer.processor.image_processor)
    ip.do_center_crop = False
    with pytest.raises(ValueError, match="pickscore_preprocess"):
        clip_pixel_values(_smooth(1, 64, 64), ip, torch.device("cpu"))


def test_device_path_gives_the_text_tower_one_shape_and_the_same_score(scorer):
    """Prompts of any length reach the text tower as 77 tokens on the device path (one shape, so
    attention kernels are planned once), and the score moves by rounding only: CLIP's causal mask
    keeps the padding after the end token away from the pooled end-token embedding."""
    short, long = ["a cat"] * 2, ["a very long prompt about a red house on a green hill at dawn"] * 2
    seen = []
    original = scorer.model.get_text_features

    def spy(**kw):
        seen.append(tuple(kw["input_ids"].shape))
        return original(**kw)
    images = _smooth(2, 256, 256, seed=2)
    scorer.model.get_text_features = spy
    try:
        scorer.preprocess_on_device = False
        ref = [scorer(p, images) for p in (short, long)]
        scorer.preprocess_on_device = True
        padded = [scorer(p, images) for p in (short, long)]
    finally:
        del scorer.model.get_text_features
    assert seen[0][1] < seen[1][1] < 77  # the reference pads to each batch's longest prompt
    assert seen[2] == seen[3] == (2, 77)
    assert scorer.text_tokens(short)["input_ids"].shape == (2, 77)
    # the image path differs too (tensor ops against PIL): compare through the text tower alone
    for p in (short, long):
        scorer.preprocess_on_device = False
        loose = scorer.model.get_text_features(**scorer.text_tokens(p))
        scorer.preprocess_on_device = True
        fixed = scorer.model.get_text_features(**scorer.text_tokens(p))
        loose, fixed = (t if isinstance(t, torch.Tensor) else t.pooler_output for t in (loose, fixed))
        torch.testing.assert_close(fixed, loose, atol=1e-5, rtol=1e-5)
    for r, q in zip(ref, padded):
        assert (r - q).abs().max() < 0.05 * r.std().clamp_min(1e-3) + 1e-4
