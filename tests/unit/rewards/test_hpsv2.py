"""hpcnft.rewards.hpsv2 against a plain-torch transcription of open_clip's CLIP forward, its
tokenizer layout and HPSv2's validation transform, on the tiny weights."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from hpcnft.models.folders import ModelError
from hpcnft.rewards.hpsv2 import ARCH_FILE, HPS_CHECKPOINT, build_tiny_hpsv2, hps_pixel_values, load_hpsv2

CPU = torch.device("cpu")
PROMPTS = ["a photo of a cat sitting on a red chair", "a fox", " ".join(["a dragon flying over snowy mountains"] * 12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_hpsv2(str(tmp_path_factory.mktemp("hpsv2") / "hpsv2_tiny"))


@pytest.fixture(scope="module")
def scorer(tiny):
    return load_hpsv2(tiny, CPU)


# ---- the reference, transcribed ------------------------------------------------------------
def reference_preprocess(image: np.ndarray, size: int = 224) -> torch.Tensor:
    """ResizeMaxSize(size, fill=0) on a PIL image, ToTensor, Normalize(OpenAI CLIP mean, std)."""
    img = Image.fromarray(image)
    width, height = img.size
    scale = size / float(max(height, width))
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255
    if scale != 1.0:
        new_h, new_w = (round(d * scale) for d in (height, width))
        x = torch.from_numpy(np.array(img.resize((new_w, new_h), Image.BICUBIC))).permute(2, 0, 1).float() / 255
        pad_h, pad_w = size - new_h, size - new_w
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    return (x - mean) / std


def reference_tokenize(tokenizer, texts: list[str], context_length: int = 77) -> torch.Tensor:
    """open_clip's tokenize(): [SOT] + BPE + [EOT], cut to the context with EOT last, zeros after."""
    sot, eot = tokenizer.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = [sot] + tokenizer.encode(text, add_special_tokens=False) + [eot]
        if len(ids) > context_length:
            ids = ids[:context_length]
            ids[-1] = eot
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def _transformer(x, sd, prefix, layers, heads, attn_mask=None):
    """open_clip's Transformer of ResidualAttentionBlocks (x is [L, N, D], nn.MultiheadAttention)."""
    width = x.shape[-1]
    for i in range(layers):
        p = f"{prefix}.resblocks.{i}."
        h = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps=1e-5)
        a, _ = F.multi_head_attention_forward(
            h, h, h, width, heads, sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"], None, None, False,
            0.0, sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"], training=False, need_weights=False,
            attn_mask=attn_mask)
        x = x + a
        h = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps=1e-5)
        h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])),
                     sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
        x = x + h
    return x


def reference_encode_image(sd, cfg, pixels):
    v = cfg["vision_cfg"]
    width = v["width"]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=v["patch_size"])
    x = x.reshape(x.shape[0], width, -1).permute(0, 2, 1)
    x = torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, width), x], dim=1)
    x = x + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (width,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], eps=1e-5)
    x = _transformer(x.permute(1, 0, 2), sd, "visual.transformer", v["layers"], width // v["head_width"])
    pooled = x.permute(1, 0, 2)[:, 0]
    pooled = F.layer_norm(pooled, (width,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"], eps=1e-5)
    return pooled @ sd["visual.proj"]


def reference_encode_text(sd, cfg, text):
    t = cfg["text_cfg"]
    width, ctx = t["width"], t["context_length"]
    x = sd["token_embedding.weight"][text] + sd["positional_embedding"]
    mask = torch.full((ctx, ctx), float("-inf")).triu_(1)
    x = _transformer(x.permute(1, 0, 2), sd, "transformer", t["layers"], t["heads"], attn_mask=mask).permute(1, 0, 2)
    x = F.layer_norm(x, (width,), sd["ln_final.weight"], sd["ln_final.bias"], eps=1e-5)
    return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ sd["text_projection"]


def reference_hps(folder: str, tokenizer, prompts: list[str], images: np.ndarray) -> torch.Tensor:
    """HPSv2's score: the diagonal of normalised image features @ normalised text features.T."""
    sd = torch.load(os.path.join(folder, HPS_CHECKPOINT), weights_only=True)["state_dict"]
    with open(os.path.join(folder, ARCH_FILE)) as f:
        cfg = json.load(f)
    with torch.no_grad():
        pixels = torch.stack([reference_preprocess(im) for im in images])
        image_features = F.normalize(reference_encode_image(sd, cfg, pixels), dim=-1)
        text_features = F.normalize(reference_encode_text(sd, cfg, reference_tokenize(tokenizer, prompts)), dim=-1)
        return torch.diagonal(image_features @ text_features.T)


def _images(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("h,w", [(96, 160), (300, 257), (224, 224)])
def test_scores_match_open_clip_transcription(tiny, scorer, h, w):
    images = _images(3, h, w)
    got = scorer(PROMPTS, images)
    want = reference_hps(tiny, scorer.tokenizer, PROMPTS, images)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got, want)
    assert want.std() > 1e-3  # the pairs score differently, so a swapped row would show


def test_long_prompt_is_cut_with_end_token_last(scorer):
    ids = scorer.text_ids(PROMPTS)
    assert torch.equal(ids.argmax(-1), reference_tokenize(scorer.tokenizer, PROMPTS).argmax(-1))
    assert ids[2, -1] == scorer.tokenizer.eos_token_id


def test_batch_of_three_equals_three_batches_of_one(scorer):
    images = _images(3, 128, 200, seed=1)
    together = scorer(PROMPTS, torch.from_numpy(images))
    alone = torch.cat([scorer(PROMPTS[i:i + 1], images[i:i + 1]) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("h,w", [(96, 160), (161, 97), (500, 90)])
def test_non_square_images_are_resized_and_centred_on_zero_padding(h, w):
    images = _images(2, h, w, seed=2)
    got = hps_pixel_values(images, 224)
    assert got.shape == (2, 3, 224, 224)
    assert torch.equal(got, torch.stack([reference_preprocess(im) for im in images]))


def test_longer_side_already_224_is_padded_without_resizing():
    """The reference leaves such an image unpadded (a shape the model cannot take); it is padded."""
    image = _images(1, 224, 120, seed=3)
    got = hps_pixel_values(image, 224)[0]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    plain = (torch.from_numpy(image[0]).permute(2, 0, 1).float() / 255 - mean) / std
    assert torch.equal(got[:, :, 52:172], plain)
    black = (0 - mean) / std
    assert torch.equal(got[:, :, :52], black.expand(3, 224, 52))
    assert torch.equal(got[:, :, 172:], black.expand(3, 224, 52))


def test_load_builds_the_tiny_model_for_an_empty_model_dir(tmp_path):
    from hpcnft.algo.root_config import Config
    from hpcnft.rewards.config import RewardTermConfig
    from hpcnft.rewards.hpsv2 import TINY_DIRNAME, load

    cfg = Config()
    cfg.models.tiny_cache = str(tmp_path)
    term = load(RewardTermConfig(kind="hpsv2"), cfg, CPU)
    assert os.path.exists(os.path.join(tmp_path, TINY_DIRNAME, HPS_CHECKPOINT))
    assert term(["a fox"], _images(1, 64, 64)).shape == (1,)


def test_tiny_builds_are_byte_identical(tiny, tmp_path):
    from hpcnft.models.tiny import tree_digest

    assert tree_digest(build_tiny_hpsv2(str(tmp_path / "again"))) == tree_digest(tiny)


def open_clip_vit_h_14_shapes() -> dict[str, tuple[int, ...]]:
    """The parameter shapes of open_clip's CLIP for model_configs/ViT-H-14.json (embed_dim 1024;
    vision width 1280, 32 layers, patch 14, image 224; text width 1024, 24 layers, ctx 77)."""
    shapes = {"visual.conv1.weight": (1280, 3, 14, 14), "visual.class_embedding": (1280,),
              "visual.positional_embedding": (16 * 16 + 1, 1280), "visual.proj": (1280, 1024),
              "token_embedding.weight": (49408, 1024), "positional_embedding": (77, 1024),
              "text_projection": (1024, 1024), "logit_scale": ()}
    for name, width in (("visual.ln_pre", 1280), ("visual.ln_post", 1280), ("ln_final", 1024)):
        shapes.update({f"{name}.weight": (width,), f"{name}.bias": (width,)})
    for prefix, width, layers in (("visual.transformer", 1280, 32), ("transformer", 1024, 24)):
        for i in range(layers):
            p = f"{prefix}.resblocks.{i}."
            shapes.update({p + "ln_1.weight": (width,), p + "ln_1.bias": (width,), p + "ln_2.weight": (width,),
                           p + "ln_2.bias": (width,), p + "attn.in_proj_weight": (3 * width, width),
                           p + "attn.in_proj_bias": (3 * width,), p + "attn.out_proj.weight": (width, width),
                           p + "attn.out_proj.bias": (width,), p + "mlp.c_fc.weight": (4 * width, width),
                           p + "mlp.c_fc.bias": (4 * width,), p + "mlp.c_proj.weight": (width, 4 * width),
                           p + "mlp.c_proj.bias": (width,)})
    return shapes


def test_vit_h_14_checkpoint_fits_the_clip_config_without_a_config_file():
    from transformers import CLIPModel

    from hpcnft.rewards.hpsv2 import VIT_H_14, clip_config, open_clip_to_clip_model, shape_mismatch

    config = clip_config(VIT_H_14, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    with torch.device("meta"):
        model = CLIPModel(config)
    state = open_clip_to_clip_model({k: torch.empty(s, device="meta") for k, s in open_clip_vit_h_14_shapes().items()})
    assert shape_mismatch({k: v.shape for k, v in model.state_dict().items()}, state) == ""
    for tower in (config.vision_config, config.text_config):  # head_width 80 -> 16 heads; text heads 16
        assert tower.num_attention_heads == 16
        assert (tower.hidden_act, tower.layer_norm_eps) == ("gelu", 1e-5)  # open_clip: nn.GELU, nn.LayerNorm


# ---- bad input: one line naming the key and the path ---------------------------------------
def _one_line_error(call, *needles: str) -> str:
    with pytest.raises(ModelError) as e:
        call()
    text = str(e.value)
    assert len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text
    return text


def test_missing_folder_and_missing_checkpoint(tiny, tmp_path):
    gone = str(tmp_path / "nowhere")
    _one_line_error(lambda: load_hpsv2(gone, CPU), "reward.terms[hpsv2].model_dir", gone)
    folder = shutil.copytree(tiny, str(tmp_path / "no-ckpt"))
    os.remove(os.path.join(folder, HPS_CHECKPOINT))
    _one_line_error(lambda: load_hpsv2(folder, CPU, key="reward.terms[hps]"), "reward.terms[hps].model_dir",
                    os.path.join(folder, HPS_CHECKPOINT))
    _one_line_error(lambda: load_hpsv2(tiny, CPU, weights="other.pt"), "reward.terms[hpsv2].weights",
                    os.path.join(tiny, "other.pt"))
    no_tok = str(tmp_path / "no-tokenizer")
    os.makedirs(no_tok)
    _one_line_error(lambda: load_hpsv2(tiny, CPU, processor_dir=no_tok), "reward.terms[hpsv2].processor_dir", no_tok)


def test_bad_checkpoints(tiny, tmp_path):
    import hardening_tools

    sd = torch.load(os.path.join(tiny, HPS_CHECKPOINT), weights_only=True)["state_dict"]
    path = str(tmp_path / "bad.pt")

    marker = str(tmp_path / "MARKER")
    torch.save({"state_dict": sd, "x": hardening_tools.Payload(marker)}, path)
    _one_line_error(lambda: load_hpsv2(tiny, CPU, weights=path), "reward.terms[hpsv2].weights", path, "weights_only")
    assert not os.path.exists(marker)

    torch.save(sd, path)
    _one_line_error(lambda: load_hpsv2(tiny, CPU, weights=path), path, "'state_dict'")

    torch.save({"state_dict": {**sd, "visual.head.weight": torch.zeros(1)}}, path)
    _one_line_error(lambda: load_hpsv2(tiny, CPU, weights=path), path, "visual.head.weight")

    torch.save({"state_dict": {k: v for k, v in sd.items() if k != "ln_final.bias"}}, path)
    _one_line_error(lambda: load_hpsv2(tiny, CPU, weights=path), path, "text_model.final_layer_norm.bias")

    no_arch = shutil.copytree(tiny, str(tmp_path / "no-arch"))
    os.remove(os.path.join(no_arch, ARCH_FILE))  # the released architecture is assumed, the tiny weights do not fit
    _one_line_error(lambda: load_hpsv2(no_arch, CPU), "ViT-H-14", os.path.join(no_arch, HPS_CHECKPOINT))
