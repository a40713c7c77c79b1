"""The job's reward terms from its config, each loaded by its kind's module (which module that
is: `MODULES`, in hpcnft.rewards.config, the one list of kinds).

Each kind's module has `load(term, cfg, device) -> RewardTerm` (term: a RewardTermConfig; an
empty model_dir means the kind's tiny model, built into the tiny-model cache on first use).
Modules are imported only when a term of their kind is used, so no kind's dependencies weigh
on a job that does not score it."""
from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from hpcnft.rewards.config import MODULES, RewardTermConfig


def job_terms(cfg) -> list[RewardTermConfig]:
    """The configured terms, each with its name filled in; PickScore alone when none are."""
    terms = cfg.reward.terms or [RewardTermConfig(kind="pickscore")]
    return [replace(t, name=t.name or t.kind) for t in terms]


def training_terms(cfg) -> list[RewardTermConfig]:
    return [t for t in job_terms(cfg) if not t.eval_only]


def load_term(term: RewardTermConfig, cfg, device: torch.device):
    return importlib.import_module(MODULES[term.kind]).load(term, cfg, device)


def build_tiny_models(cfg) -> None:
    """Build the tiny model of every term that names no folder. Called before the process group
    exists: with a group up, transformers' save_pretrained writes nothing on ranks other than 0."""
    for term in job_terms(cfg):
        build = getattr(importlib.import_module(MODULES[term.kind]), "build_tiny", None)
        if build is not None:
            build(term, cfg)


def tiny_term_builders() -> dict[str, object]:
    """Folder name -> builder(folder) of every term's tiny model (`hpcnft make-tiny`)."""
    from hpcnft.rewards import aesthetic, clip_l, hpsv2

    return {clip_l.CLIP_L_TINY: clip_l.build_tiny_clip_l, aesthetic.AESTHETIC_TINY: aesthetic.build_tiny_head,
            hpsv2.TINY_DIRNAME: hpsv2.build_tiny_hpsv2}


