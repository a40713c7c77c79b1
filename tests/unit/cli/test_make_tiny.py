"""`hpcnft make-tiny DIR` writes every tiny model, the reward terms' included, and each folder
loads as the model_dir of its term."""
from __future__ import annotations

import os

import numpy as np
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.cli.main import main
from hpcnft.models.loading import load_base_pipeline
from hpcnft.rewards.aesthetic import HEAD_FILE
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.registry import load_term


def test_make_tiny_writes_every_model_and_the_terms_load_from_it(tmp_path, capsys):
    out = str(tmp_path / "tiny")
    assert main(["make-tiny", out]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = sorted(os.path.basename(line.split()[0]) for line in lines)
    assert names == ["aesthetic_tiny", "clip_l_tiny", "flux1_tiny", "hpsv2_tiny", "pickscore_tiny", "qwen_image_tiny",
                     "sd35_tiny", "wan21_tiny"]
    assert all(len(line.split("sha256 ")[1]) == 64 for line in lines)
    flux = load_base_pipeline(load_config("tiny_flux"), f"{out}/flux1_tiny", torch.float32, torch.device("cpu"))
    assert type(flux).__name__ == "FluxPipeline" and flux.transformer.config.guidance_embeds
    qwen = load_base_pipeline(load_config("tiny_qwen_image"), f"{out}/qwen_image_tiny", torch.float32,
                              torch.device("cpu"))
    assert type(qwen).__name__ == "QwenImagePipeline"
    wan = load_base_pipeline(load_config("tiny_wan"), f"{out}/wan21_tiny", torch.float32, torch.device("cpu"))
    assert type(wan).__name__ == "WanPipeline" and type(wan.vae).__name__ == "AutoencoderKLWan"
    cfg = load_config("tiny")
    images = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    for term in (RewardTermConfig(kind="pickscore", model_dir=f"{out}/pickscore_tiny"),
                 RewardTermConfig(kind="hpsv2", model_dir=f"{out}/hpsv2_tiny"),
                 RewardTermConfig(kind="clipscore", model_dir=f"{out}/clip_l_tiny"),
                 RewardTermConfig(kind="aesthetic", model_dir=f"{out}/clip_l_tiny",
                                  weights=f"{out}/aesthetic_tiny/{HEAD_FILE}")):
        scores = load_term(term, cfg, torch.device("cpu"))(["a red cube", "a cat"], images)
        assert scores.shape == (2,) and torch.isfinite(scores).all(), term.kind
