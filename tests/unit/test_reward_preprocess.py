"""perf.pickscore_preprocess="device": CLIP's preprocessing as tensor ops lands within about a
grey level of the processor's PIL path, so PickScore barely moves; non-CLIP processors are refused."""
import copy

import pytest
import torch

from hpcnft.models import load_pickscore
from hpcnft.reward import PickScoreScorer, clip_pixel_values


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
