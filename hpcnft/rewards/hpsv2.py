"""HPS v2.1 (Human Preference Score v2.1): open_clip's ViT-H-14 CLIP fine-tuned on human
preferences, run in transformers' CLIPModel.

The checkpoint (HPS_v2.1_compressed.pt) holds {"state_dict": ...} in open_clip's key naming;
`open_clip_to_clip_model` renames and reshapes it for CLIPModel. The score is HPSv2's: image and
text features L2-normalised, score = their dot product (the diagonal of image @ text.T, no logit
scale). Images go through HPSv2's validation transform (longer side to 224 with PIL bicubic, zero
padding to a centred square, OpenAI CLIP mean and std); prompts through CLIP's BPE, 77 tokens.

A model folder holds the checkpoint, CLIP's tokenizer files (vocab.json, merges.txt or
tokenizer.json) and, for other widths than ViT-H-14's, hpsv2_config.json in the format of
open_clip's model_configs (the tiny model has one).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re

import numpy as np
import torch
from PIL import Image

from hpcnft.common.errors import first_line, one_line
from hpcnft.models.folders import ModelError, check_folder
from hpcnft.models.tiny_cache import ensure_tiny, tiny_cache
from hpcnft.rewards.base import as_uint8_numpy

HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"
ARCH_FILE = "hpsv2_config.json"
TINY_DIRNAME = "hpsv2_tiny"
TOKENIZER_REQUIRED = ("tokenizer.json|vocab.json",)

# open_clip's model_configs/ViT-H-14.json.
VIT_H_14 = {
    "embed_dim": 1024,
    "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
}
# open_clip's CLIPVisionCfg / CLIPTextCfg defaults for the fields this model reads.
VISION_DEFAULTS = {"image_size": 224, "layers": 12, "width": 768, "head_width": 64, "patch_size": 16, "mlp_ratio": 4.0}
TEXT_DEFAULTS = {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12, "mlp_ratio": 4.0}
OPEN_CLIP_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which open_clip's LayerNorm keeps

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ----------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------
def resize_longest_and_pad(image: Image.Image, size: int) -> Image.Image:
    """HPSv2's ResizeMaxSize: the longer side to `size` (bicubic, aspect kept, sides rounded
    with Python's round), then zero padding to size x size, the odd pixel right and below.
    Where the longer side already is `size` the reference skips both steps, leaving a non-square
    input the model cannot take; here such an image is padded all the same."""
    width, height = image.size
    scale = size / float(max(height, width))
    if scale != 1.0:
        image = image.resize((round(width * scale), round(height * scale)), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), (0, 0, 0))
    canvas.paste(image, ((size - image.width) // 2, (size - image.height) // 2))
    return canvas


def hps_pixel_values(images: np.ndarray, size: int) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float32 [n, 3, size, size]: ResizeMaxSize, ToTensor, Normalize."""
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    out = []
    for im in images:
        square = np.asarray(resize_longest_and_pad(Image.fromarray(im), size))
        x = torch.from_numpy(square.copy()).permute(2, 0, 1).float().div(255)
        out.append((x - mean) / std)
    return torch.stack(out)


def hps_score(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """Row i of image @ text.T at column i, for L2-normalised features: the cosine of pair i."""
    image_features = torch.nn.functional.normalize(image_features, dim=-1)
    text_features = torch.nn.functional.normalize(text_features, dim=-1)
    return (image_features * text_features).sum(-1)


# ----------------------------------------------------------------------------------------
# open_clip -> transformers
# ----------------------------------------------------------------------------------------
_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")
_BLOCK_PARTS = {
    "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
    "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
}
_RENAMED = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
# open_clip multiplies by these ([width, embed_dim]); a Linear's weight is the transpose.
_PROJECTIONS = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}


def open_clip_to_clip_model(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip OpenAI-style ViT CLIP state_dict in CLIPModel's naming: each block's fused
    attn.in_proj splits into q, k, v (open_clip stacks them in that order), the projections are
    transposed, everything else is renamed. Raises KeyError on a key it does not know."""
    out = {}
    for key, value in state_dict.items():
        block = _BLOCK.fullmatch(key)
        if block:
            tower = "vision_model" if block[1] else "text_model"
            prefix, part = f"{tower}.encoder.layers.{block[2]}.", block[3]
            if part in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = part.rsplit("_", 1)[1]
                for name, chunk in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{name}_proj.{kind}"] = chunk
            elif part in _BLOCK_PARTS:
                out[prefix + _BLOCK_PARTS[part]] = value
            else:
                raise KeyError(key)
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _PROJECTIONS:
            out[_PROJECTIONS[key]] = value.t()
        elif key != "attn_mask":  # a causal-mask buffer some open_clip versions save; CLIPModel builds its own
            raise KeyError(key)
    return out


def shape_mismatch(expected: dict[str, torch.Size], given: dict[str, torch.Tensor]) -> str:
    """'' when `given` has exactly `expected`'s keys and shapes, else what differs first."""
    missing = [k for k in expected if k not in given]
    if missing:
        return f"{len(missing)} weights missing, e.g. {missing[0]}"
    unexpected = [k for k in given if k not in expected]
    if unexpected:
        return f"{len(unexpected)} unexpected weights, e.g. {unexpected[0]}"
    for k, shape in expected.items():
        if given[k].shape != shape:
            return f"{k} is {tuple(given[k].shape)}, the architecture needs {tuple(shape)}"
    return ""


def _with_defaults(cfg: dict, defaults: dict, where: str) -> dict:
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not supported")
    return {**defaults, **cfg}


def clip_config(model_cfg: dict, bos_token_id: int, eos_token_id: int, pad_token_id: int):
    """CLIPConfig for an open_clip model config (model_configs/*.json layout). GELU (not quick
    GELU) and LayerNorm eps 1e-5, as open_clip's ViT-H-14. `eos_token_id` is where CLIPModel
    pools the text (its first occurrence); open_clip pools at argmax(ids), the same token when
    the end token has the tokenizer's largest id, as CLIP's has."""
    from transformers import CLIPConfig

    v = _with_defaults(model_cfg["vision_cfg"], VISION_DEFAULTS, "vision_cfg")
    t = _with_defaults(model_cfg["text_cfg"], TEXT_DEFAULTS, "text_cfg")
    common = dict(hidden_act="gelu", layer_norm_eps=OPEN_CLIP_LAYER_NORM_EPS)
    vision = dict(hidden_size=v["width"], intermediate_size=int(v["width"] * v["mlp_ratio"]),
                  num_hidden_layers=v["layers"], num_attention_heads=v["width"] // v["head_width"],
                  patch_size=v["patch_size"], image_size=v["image_size"], **common)
    text = dict(hidden_size=t["width"], intermediate_size=int(t["width"] * t["mlp_ratio"]),
                num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                max_position_embeddings=t["context_length"], vocab_size=t["vocab_size"],
                bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **common)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=model_cfg["embed_dim"])


# ----------------------------------------------------------------------------------------
# The term
# ----------------------------------------------------------------------------------------
class HPSv2Scorer:
    """HPS v2.1 of (prompt, image) pairs, in float32."""

    def __init__(self, tokenizer, model, device: torch.device):
        self.tokenizer, self.model, self.device = tokenizer, model, device
        self.image_size = model.config.vision_config.image_size
        self.context_length = model.config.text_config.max_position_embeddings

    def text_ids(self, prompts: list[str]) -> torch.Tensor:
        """[SOT, BPE..., EOT] padded to the full context as open_clip's tokenizer does; a long
        prompt is cut so that EOT stays last. No attention mask: under the causal mask nothing
        after EOT reaches the pooled EOT state, as in open_clip."""
        return self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.context_length,
                              return_tensors="pt")["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: list[str], images) -> torch.Tensor:
        images = as_uint8_numpy(images)
        if len(prompts) != len(images):
            raise ValueError(f"hpsv2: {len(prompts)} prompts for {len(images)} images")
        pixels = hps_pixel_values(images, self.image_size).to(self.device)
        ids = self.text_ids(prompts).to(self.device)
        m = self.model
        image_features = m.visual_projection(m.vision_model(pixel_values=pixels).pooler_output)
        text_features = m.text_projection(m.text_model(input_ids=ids).pooler_output)
        return hps_score(image_features, text_features).float().cpu()


def _read_checkpoint(key: str, path: str) -> dict[str, torch.Tensor]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ModelError(f"{key}: {path!r} holds more than tensors, torch.load(weights_only=True) refuses it "
                         f"({first_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - any reader failure becomes one line
        raise ModelError(f"{key}: cannot read {path!r} ({one_line(e)})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ModelError(f"{key}: {path!r} is not an HPS checkpoint (a dict with a 'state_dict')")
    return checkpoint["state_dict"]


def _read_arch(key: str, folder: str) -> tuple[dict, str]:
    """The folder's hpsv2_config.json, else ViT-H-14 (the released HPS v2.1)."""
    path = os.path.join(folder, ARCH_FILE)
    if not os.path.exists(path):
        return VIT_H_14, f"ViT-H-14 (no {ARCH_FILE})"
    try:
        with open(path) as f:
            return json.load(f), path
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{key}: cannot read {path!r} ({one_line(e)})") from None


def load_hpsv2(model_dir: str, device: torch.device, weights: str = "", processor_dir: str = "",
               key: str = "reward.terms[hpsv2]") -> HPSv2Scorer:
    """The scorer from a model folder. `weights` is the checkpoint's path, relative to the folder
    unless absolute (default HPS_v2.1_compressed.pt there); `processor_dir` the tokenizer's folder
    (default the model folder). `key` names the term in error lines."""
    from transformers import CLIPModel, CLIPTokenizer
    from transformers.initialization import no_init_weights

    check_folder(f"{key}.model_dir", model_dir, ())
    weights_key = f"{key}.weights" if weights else f"{key}.model_dir"
    checkpoint = os.path.join(model_dir, weights or HPS_CHECKPOINT)
    if not os.path.isfile(checkpoint):
        raise ModelError(f"{weights_key}: checkpoint {checkpoint!r} does not exist")
    tokenizer_key, tokenizer_dir = (f"{key}.processor_dir", processor_dir) if processor_dir else \
        (f"{key}.model_dir", model_dir)
    check_folder(tokenizer_key, tokenizer_dir, TOKENIZER_REQUIRED)
    try:
        tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{tokenizer_key}: cannot load the tokenizer in {tokenizer_dir!r} ({one_line(e)})") from None
    if tokenizer.eos_token_id != max(tokenizer.get_vocab().values()):
        raise ModelError(f"{tokenizer_key}: the end token of {tokenizer_dir!r} is not its largest id, "
                         "where open_clip pools the text")

    model_cfg, arch = _read_arch(f"{key}.model_dir", model_dir)
    try:
        config = clip_config(model_cfg, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{key}.model_dir: {arch} is not a supported open_clip ViT config ({one_line(e)})") from None
    if len(tokenizer) > config.text_config.vocab_size:
        raise ModelError(f"{tokenizer_key}: the tokenizer in {tokenizer_dir!r} has {len(tokenizer)} tokens, "
                         f"the text tower {config.text_config.vocab_size}")
    try:
        state = open_clip_to_clip_model(_read_checkpoint(weights_key, checkpoint))
    except KeyError as e:
        raise ModelError(f"{weights_key}: {checkpoint!r} has a weight an open_clip ViT CLIP does not ({e})") from None
    with no_init_weights(), torch.device(device):  # every weight is loaded next
        model = CLIPModel(config)
    mismatch = shape_mismatch({k: v.shape for k, v in model.state_dict().items()}, state)
    if mismatch:
        raise ModelError(f"{weights_key}: {checkpoint!r} does not fit {arch}: {mismatch}")
    model.load_state_dict(state, strict=True)
    return HPSv2Scorer(tokenizer, model.eval().requires_grad_(False), device)


# ----------------------------------------------------------------------------------------
# The tiny model
# ----------------------------------------------------------------------------------------
TINY_VISION = {"image_size": 224, "layers": 2, "width": 64, "head_width": 16, "patch_size": 14}
TINY_TEXT = {"context_length": 77, "width": 32, "heads": 4, "layers": 2}
TINY_EMBED_DIM = 32


def tiny_open_clip_state_dict(model_cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in open_clip's layout for `model_cfg`. LayerNorm gains and every bias are
    random too, so a weight put in the wrong place changes the scores."""
    g = torch.Generator().manual_seed(seed)
    v = {**VISION_DEFAULTS, **model_cfg["vision_cfg"]}
    t = {**TEXT_DEFAULTS, **model_cfg["text_cfg"]}
    embed = model_cfg["embed_dim"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd: dict[str, torch.Tensor] = {}

    def layer_norm(name: str, width: int) -> None:
        sd[f"{name}.weight"] = 1 + randn(width, std=0.1)
        sd[f"{name}.bias"] = randn(width, std=0.1)

    def blocks(prefix: str, width: int, layers: int, mlp_ratio: float) -> None:
        hidden = int(width * mlp_ratio)
        for i in range(layers):
            p = f"{prefix}.resblocks.{i}"
            layer_norm(f"{p}.ln_1", width)
            sd[f"{p}.attn.in_proj_weight"] = randn(3 * width, width, std=width ** -0.5)
            sd[f"{p}.attn.in_proj_bias"] = randn(3 * width, std=0.02)
            sd[f"{p}.attn.out_proj.weight"] = randn(width, width, std=width ** -0.5)
            sd[f"{p}.attn.out_proj.bias"] = randn(width, std=0.02)
            layer_norm(f"{p}.ln_2", width)
            sd[f"{p}.mlp.c_fc.weight"] = randn(hidden, width, std=width ** -0.5)
            sd[f"{p}.mlp.c_fc.bias"] = randn(hidden, std=0.02)
            sd[f"{p}.mlp.c_proj.weight"] = randn(width, hidden, std=hidden ** -0.5)
            sd[f"{p}.mlp.c_proj.bias"] = randn(width, std=0.02)

    w, patch = v["width"], v["patch_size"]
    sd["visual.conv1.weight"] = randn(w, 3, patch, patch, std=(3 * patch * patch) ** -0.5)
    sd["visual.class_embedding"] = randn(w, std=w ** -0.5)
    sd["visual.positional_embedding"] = randn((v["image_size"] // patch) ** 2 + 1, w, std=w ** -0.5)
    layer_norm("visual.ln_pre", w)
    blocks("visual.transformer", w, v["layers"], v["mlp_ratio"])
    layer_norm("visual.ln_post", w)
    sd["visual.proj"] = randn(w, embed, std=w ** -0.5)
    w = t["width"]
    sd["token_embedding.weight"] = randn(t["vocab_size"], w, std=0.02)
    sd["positional_embedding"] = randn(t["context_length"], w, std=0.01)
    blocks("transformer", w, t["layers"], t["mlp_ratio"])
    layer_norm("ln_final", w)
    sd["text_projection"] = randn(w, embed, std=w ** -0.5)
    sd["logit_scale"] = torch.tensor(math.log(1 / 0.07))  # open_clip's initial value; the score does not use it
    return sd


def build_tiny_hpsv2(folder: str, seed: int = 0) -> str:
    """Write a tiny HPS folder: HPS_v2.1_compressed.pt in open_clip's layout, hpsv2_config.json
    with its widths, and the project's tiny CLIP tokenizer."""
    from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS
    from hpcnft.models.tiny_tokenizers import finish_tokenizer_dir, make_clip_tokenizer

    os.makedirs(folder, exist_ok=True)
    tokenizer = make_clip_tokenizer(folder, PROMPTS + [CHAR_COVERAGE])
    finish_tokenizer_dir(folder)
    model_cfg = {"embed_dim": TINY_EMBED_DIM, "vision_cfg": dict(TINY_VISION),
                 "text_cfg": {**TINY_TEXT, "vocab_size": len(tokenizer)}}
    with open(os.path.join(folder, ARCH_FILE), "w") as f:
        json.dump(model_cfg, f, indent=2, sort_keys=True)
    torch.save({"state_dict": tiny_open_clip_state_dict(model_cfg, seed)}, os.path.join(folder, HPS_CHECKPOINT))
    return folder


def load(term, cfg, device: torch.device) -> HPSv2Scorer:
    """The term's folder (model_dir, weights, processor_dir), else the tiny HPS model."""
    model_dir = term.model_dir or ensure_tiny(tiny_cache(cfg), TINY_DIRNAME, build_tiny_hpsv2)
    return load_hpsv2(model_dir, device, weights=term.weights, processor_dir=term.processor_dir,
                      key=f"reward.terms[{term.name or term.kind}]")


def build_tiny(term, cfg) -> None:
    """The tiny HPS model where the term names no folder (registry.build_tiny_models)."""
    if not term.model_dir:
        ensure_tiny(tiny_cache(cfg), TINY_DIRNAME, build_tiny_hpsv2)
