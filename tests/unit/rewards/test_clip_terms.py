"""hpcnft.rewards.clipscore and .aesthetic against transcriptions of the DiffusionNFT reference
(flow_grpo/clip_scorer.py with torchvision's Resize/CenterCrop/Normalize on tensors,
flow_grpo/aesthetic_scorer.py with the CLIPProcessor's PIL path) on the tiny CLIP ViT-L/14."""
from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from hpcnft.algo.root_config import Config

from hpcnft.models.folders import ModelError
from hpcnft.rewards.config import RewardTermConfig

CPU = torch.device("cpu")
VIT_L_MEAN = [0.48145466, 0.4578275, 0.40821073]
VIT_L_STD = [0.26862954, 0.26130258, 0.27577711]
PROMPTS = ["a photo of a cat sitting on a red chair", "two dogs playing in the snow at sunrise",
           "a bowl of ramen with chopsticks, 4k, highly detailed"]
# (height, width): downscaled (tall), upscaled (wide), and one already at the short edge whose
# crop offset (227 - 224) / 2 = 1.5 rounds to 2 under round() but 1 under floor division.
SHAPES = [(300, 260), (96, 130), (227, 224)]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Config:
    cfg = Config()
    cfg.models.tiny_cache = str(tmp_path_factory.mktemp("tiny-terms"))
    return cfg


@pytest.fixture(scope="module")
def clipscore(cfg):
    from hpcnft.rewards.clipscore import load

    return load(RewardTermConfig(kind="clipscore", name="clipscore"), cfg, CPU)


@pytest.fixture(scope="module")
def aesthetic(cfg):
    from hpcnft.rewards.aesthetic import load

    return load(RewardTermConfig(kind="aesthetic", name="aesthetic"), cfg, CPU)


def _images(shape: tuple[int, int], n: int = 3, seed: int = 0) -> np.ndarray:
    """Smooth random images (so that the resize filter matters) with some noise on top."""
    rng = np.random.default_rng(seed)
    h, w = shape
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(rng.uniform(2, 12) * xx + rng.uniform(2, 12) * yy + rng.uniform(0, 6))
                     for _ in range(3 * n)]).reshape(n, 3, h, w).transpose(0, 2, 3, 1)
    noisy = 127.5 + 110 * base + rng.normal(0, 8, (n, h, w, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# torchvision (>= 0.17) on tensors, transcribed: transforms/functional.py resize, center_crop,
# _compute_resized_output_size; transforms/_functional_tensor.py resize and normalize.
# ---------------------------------------------------------------------------------------
def tv_compute_resized_output_size(image_size, size):
    h, w = image_size
    short, long = (w, h) if w <= h else (h, w)
    requested_new_short = size if isinstance(size, int) else size[0]
    new_short, new_long = requested_new_short, int(requested_new_short * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return [new_h, new_w]


def tv_resize(img, size):  # T.Resize(size): interpolation BILINEAR, antialias True
    output_size = tv_compute_resized_output_size(list(img.shape[-2:]), [size])
    if list(img.shape[-2:]) == output_size:
        return img
    return torch.nn.functional.interpolate(img, size=output_size, mode="bilinear", align_corners=False,
                                           antialias=True)


def tv_center_crop(img, output_size):
    image_height, image_width = img.shape[-2:]
    crop_height, crop_width = output_size
    if crop_width > image_width or crop_height > image_height:
        padding_ltrb = [
            (crop_width - image_width) // 2 if crop_width > image_width else 0,
            (crop_height - image_height) // 2 if crop_height > image_height else 0,
            (crop_width - image_width + 1) // 2 if crop_width > image_width else 0,
            (crop_height - image_height + 1) // 2 if crop_height > image_height else 0,
        ]
        left, top, right, bottom = padding_ltrb
        img = torch.nn.functional.pad(img, [left, right, top, bottom], mode="constant", value=0)
        image_height, image_width = img.shape[-2:]
        if crop_width == image_width and crop_height == image_height:
            return img
    crop_top = int(round((image_height - crop_height) / 2.0))
    crop_left = int(round((image_width - crop_width) / 2.0))
    return img[..., crop_top:crop_top + crop_height, crop_left:crop_left + crop_width]


def tv_normalize(tensor, mean, std):
    tensor = tensor.clone()
    mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


def reference_clip_score(model, processor, prompts, images_nhwc):
    """flow_grpo rewards.clip_score + ClipScorer.__call__ with ViT-L/14's processor config."""
    pixels = torch.tensor(images_nhwc.transpose(0, 3, 1, 2), dtype=torch.uint8) / 255.0
    pixels = tv_normalize(tv_center_crop(tv_resize(pixels, 224), [224, 224]), VIT_L_MEAN, VIT_L_STD)
    texts = processor(text=prompts, padding="max_length", truncation=True, return_tensors="pt")
    outputs = model(pixel_values=pixels, **texts)
    return outputs.logits_per_image.diagonal() / 100


# ---------------------------------------------------------------------------------------
# The CLIPProcessor's PIL path (ViT-L/14 settings) and the aesthetic head, transcribed.
# ---------------------------------------------------------------------------------------
def reference_clip_pixels_pil(images_nhwc):
    out = []
    for im in images_nhwc:
        h, w = im.shape[:2]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = 224, int(224 * long / short)
        new_h, new_w = (new_long, new_short) if w <= h else (new_short, new_long)
        x = np.array(Image.fromarray(im).resize((new_w, new_h), resample=Image.BICUBIC))
        top, left = (new_h - 224) // 2, (new_w - 224) // 2
        x = x[top:top + 224, left:left + 224].astype(np.float64) / 255
        x = (x.astype(np.float32) - np.array(VIT_L_MEAN, np.float32)) / np.array(VIT_L_STD, np.float32)
        out.append(x.transpose(2, 0, 1))
    return torch.from_numpy(np.stack(out))


def reference_aesthetic(model, head_state, images_nhwc):
    """AestheticScorer.__call__: CLIP image features, L2-normalised, through the MLP."""
    pooled = model.vision_model(pixel_values=reference_clip_pixels_pil(images_nhwc)).pooler_output
    embed = model.visual_projection(pooled)
    embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
    width = model.config.projection_dim
    mlp = nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in head_state.items()})
    return mlp.eval()(embed).squeeze(1)


def _tiny_folders(cfg):
    cache = cfg.models.tiny_cache
    return os.path.join(cache, "clip_l_tiny"), os.path.join(cache, "aesthetic_tiny",
                                                            "sac+logos+ava1-l14-linearMSE.pth")


def _tiny_clip(cfg):
    from transformers import CLIPModel, CLIPProcessor

    folder = _tiny_folders(cfg)[0]
    return (CLIPModel.from_pretrained(folder, local_files_only=True).eval(),
            CLIPProcessor.from_pretrained(folder, local_files_only=True, backend="pil"))


# ---------------------------------------------------------------------------------------
# Agreement with the reference
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_clipscore_matches_reference(cfg, clipscore, shape):
    images = _images(shape)
    scores = clipscore(PROMPTS, images)
    model, processor = _tiny_clip(cfg)
    with torch.no_grad():
        expected = reference_clip_score(model, processor, PROMPTS, images)
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores.device == CPU
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)


def test_clipscore_is_exp_logit_scale_times_cosine_over_100(cfg, clipscore):
    images = _images(SHAPES[0])
    model, processor = _tiny_clip(cfg)
    assert math.isclose(model.logit_scale.exp().item(), 100.0, rel_tol=1e-5)  # ViT-L/14's temperature
    pixels = tv_normalize(tv_center_crop(tv_resize(torch.tensor(images.transpose(0, 3, 1, 2)) / 255.0, 224),
                                         [224, 224]), VIT_L_MEAN, VIT_L_STD)
    text = processor(text=PROMPTS, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        img = model.get_image_features(pixel_values=pixels).pooler_output
        txt = model.get_text_features(**text).pooler_output
    cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    torch.testing.assert_close(clipscore(PROMPTS, images), model.logit_scale.exp().detach() * cos / 100,
                               rtol=0, atol=1e-6)


def test_clipscore_pads_prompts_to_77_tokens_and_truncates(clipscore):
    """The pooled end token does not see the padding (causal mask), so the padding shows only in
    the token ids: short prompts are padded to 77, a long one is cut to 77."""
    seen = []
    real = clipscore.model.forward

    def spy(**kw):
        seen.append(tuple(kw["input_ids"].shape))
        return real(**kw)
    clipscore.model.forward = spy
    try:
        clipscore(["a cat", "a red chair"], _images(SHAPES[0], n=2))
        clipscore([" ".join(["a photo of a cat"] * 40)], _images(SHAPES[0], n=1))
    finally:
        del clipscore.model.forward
    assert seen == [(2, 77), (1, 77)]


def test_tiny_clip_has_vit_l_14_layout(cfg, clipscore):
    model, processor = _tiny_clip(cfg)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_act, vision.hidden_act) == ("quick_gelu", "quick_gelu")
    assert (vision.image_size, vision.patch_size, text.max_position_embeddings) == (224, 14, 77)
    assert model.config.projection_dim not in (text.hidden_size, vision.hidden_size)
    ip = processor.image_processor
    assert (ip.size.shortest_edge, ip.crop_size.height, ip.crop_size.width, ip.resample) == (224, 224, 224, 3)
    assert (list(ip.image_mean), list(ip.image_std)) == (VIT_L_MEAN, VIT_L_STD)
    assert processor.tokenizer.pad_token == "<|endoftext|>" and processor.tokenizer.model_max_length == 77


@pytest.mark.parametrize("image_hw,crop", [((5, 4), (8, 7)), ((11, 9), (8, 4)), ((9, 6), (8, 5)),
                                           ((4, 12), (6, 7))])
def test_center_crop_rounds_and_pads_as_torchvision(image_hw, crop):
    from hpcnft.rewards.clipscore import center_crop

    x = torch.arange(2 * 3 * image_hw[0] * image_hw[1], dtype=torch.float32).view(2, 3, *image_hw) + 1
    assert torch.equal(center_crop(x, crop), tv_center_crop(x, list(crop)))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: f"{s[0]}x{s[1]}")
def test_aesthetic_matches_reference(cfg, aesthetic, shape):
    images = _images(shape, seed=1)
    scores = aesthetic(PROMPTS, images)
    model, _ = _tiny_clip(cfg)
    head_state = torch.load(_tiny_folders(cfg)[1], map_location="cpu", weights_only=True)
    with torch.no_grad():
        expected = reference_aesthetic(model, head_state, images)
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores.device == CPU
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)


def test_aesthetic_head_follows_the_clip_projection_width(cfg, aesthetic):
    state = torch.load(_tiny_folders(cfg)[1], map_location="cpu", weights_only=True)
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    assert [tuple(state[f"layers.{i}.weight"].shape) for i in (0, 2, 4, 6, 7)] == \
        [(1024, aesthetic.model.config.projection_dim), (128, 1024), (64, 128), (16, 64), (1, 16)]


# ---------------------------------------------------------------------------------------
# The term contract
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("term", ["clipscore", "aesthetic"])
def test_scores_do_not_depend_on_the_batch(request, term):
    score = request.getfixturevalue(term)
    images = _images(SHAPES[0], seed=2)
    batch = score(PROMPTS, images)
    singles = torch.cat([score([p], torch.from_numpy(images[i:i + 1])) for i, p in enumerate(PROMPTS)])
    torch.testing.assert_close(batch, singles, rtol=0, atol=1e-5)
    assert batch.std() > 1e-4  # the images and prompts do give different scores


def test_aesthetic_reads_the_head_from_model_dir_by_default(cfg, aesthetic, tmp_path):
    from hpcnft.rewards.aesthetic import load

    clip_dir, head = _tiny_folders(cfg)
    own = shutil.copytree(clip_dir, str(tmp_path / "clip-vit-large-patch14"))
    shutil.copy(head, os.path.join(own, "sac+logos+ava1-l14-linearMSE.pth"))
    term = load(RewardTermConfig(kind="aesthetic", name="aesthetic", model_dir=own), cfg, CPU)
    images = _images(SHAPES[1], seed=3)
    torch.testing.assert_close(term(PROMPTS, images), aesthetic(PROMPTS, images), rtol=0, atol=0)


def test_tiny_builds_are_byte_identical(tmp_path):
    from hpcnft.models.tiny import tree_digest
    from hpcnft.rewards.aesthetic import build_tiny_head
    from hpcnft.rewards.clip_l import build_tiny_clip_l

    digests = []
    for i in range(2):
        folder = tmp_path / str(i)
        folder.mkdir()
        build_tiny_clip_l(str(folder))
        build_tiny_head(str(folder))
        digests.append(tree_digest(str(folder)))
    assert digests[0] == digests[1]


# ---------------------------------------------------------------------------------------
# Bad folders and files: one line naming the key and the path
# ---------------------------------------------------------------------------------------
def _load_error(kind: str, cfg, **settings) -> str:
    from hpcnft.rewards.registry import load_term

    with pytest.raises(ModelError) as e:
        load_term(RewardTermConfig(kind=kind, name=f"my_{kind}", **settings), cfg, CPU)
    assert len(str(e.value).splitlines()) == 1
    return str(e.value)


@pytest.mark.parametrize("kind", ["clipscore", "aesthetic"])
def test_a_missing_model_folder_names_the_key(cfg, tmp_path, kind):
    missing = str(tmp_path / "no-such-clip")
    line = _load_error(kind, cfg, model_dir=missing)
    assert line.startswith(f"reward.terms[my_{kind}].model_dir:") and missing in line


@pytest.mark.parametrize("kind", ["clipscore", "aesthetic"])
def test_a_missing_processor_folder_names_the_key(cfg, clipscore, tmp_path, kind):
    missing = str(tmp_path / "no-such-processor")
    line = _load_error(kind, cfg, model_dir=_tiny_folders(cfg)[0], processor_dir=missing)
    assert line.startswith(f"reward.terms[my_{kind}].processor_dir:") and missing in line


def test_a_folder_without_weights_names_the_key(cfg, clipscore, tmp_path):
    own = shutil.copytree(_tiny_folders(cfg)[0], str(tmp_path / "clip"))
    os.remove(os.path.join(own, "model.safetensors"))
    line = _load_error("clipscore", cfg, model_dir=own)
    assert line.startswith("reward.terms[my_clipscore].model_dir: cannot load") and own in line


def test_a_missing_head_file_names_the_key(cfg, clipscore, tmp_path):
    clip_dir = _tiny_folders(cfg)[0]
    line = _load_error("aesthetic", cfg, model_dir=clip_dir)  # no head inside the CLIP folder
    assert line.startswith("reward.terms[my_aesthetic].weights:")
    assert os.path.join(clip_dir, "sac+logos+ava1-l14-linearMSE.pth") in line
    missing = str(tmp_path / "head.pth")
    line = _load_error("aesthetic", cfg, weights=missing)
    assert line.startswith("reward.terms[my_aesthetic].weights:") and missing in line


def test_a_head_of_another_width_names_the_key(cfg, aesthetic, tmp_path):
    from hpcnft.rewards.aesthetic import AestheticMLP

    wrong = str(tmp_path / "vit-l-head.pth")
    torch.save(AestheticMLP(768).state_dict(), wrong)
    line = _load_error("aesthetic", cfg, weights=wrong)
    assert line.startswith("reward.terms[my_aesthetic].weights:") and wrong in line and "768" in line
