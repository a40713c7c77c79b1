"""The job's reward from its terms (reward.terms): which terms score a chunk, and the training
reward made of their scores.

A chunk's scores are a float32 table [n, T], one column per term: the training terms for a
rollout chunk, every term (eval-only ones too) for an evaluation chunk. The training reward of
a sample is reward.scale * sum_t weight_t * score_t: the official DiffusionNFT code's sum of
weighted scores (`multi_score`'s "avg"), no per-term normalisation; the advantages normalise
the sum per prompt group as before.

A video family's chunk is frames [n, F, H, W, 3]: every term scores each frame as an image (with
its video's prompt) and the video's score is its frames' pooled by reward.frame_pooling."""
from __future__ import annotations

import torch

from hpcnft.algo.root_config import Config
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.registry import job_terms, load_term, training_terms


def term_columns(cfg: Config) -> dict[str, list[RewardTermConfig]]:
    """The terms of each request kind's columns, in order."""
    return {"rollout": training_terms(cfg), "eval": job_terms(cfg)}


def reply_columns(cfg: Config) -> dict[int, int]:
    """Scores per image in a reward reply, by request kind (the reward service's `columns`)."""
    from hpcnft.distributed.reward_service import EVAL, ROLLOUT

    cols = term_columns(cfg)
    return {ROLLOUT: len(cols["rollout"]), EVAL: len(cols["eval"])}


def training_reward(scores: torch.Tensor, cfg: Config) -> torch.Tensor:
    """[n, T] training-term scores -> [n] float32: scale * sum of weight * score."""
    weights = torch.tensor([t.weight for t in training_terms(cfg)], dtype=scores.dtype)
    return cfg.reward.scale * (scores * weights).sum(dim=-1)


def load_terms(cfg: Config, device: torch.device) -> dict[str, object]:
    """name -> loaded term, for every term of the job (loaded once even if several columns use it)."""
    return {t.name: load_term(t, cfg, device) for t in job_terms(cfg)}


def make_score_fn(cfg: Config, terms: dict[str, object]):
    """(kind, step, images, sample ids) -> float32 [n, T]. A rank scores with its own copy of the
    prompt files, against the prompt each sample was generated from (PromptStream.for_samples)."""
    from hpcnft.algo.prompts import read_prompt_file, train_stream
    from hpcnft.distributed.reward_service import EVAL

    stream = train_stream(cfg)
    eval_prompts = read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
    cfg.reward.check_prompts(stream.prompts, eval_prompts)  # under a launcher, the first check of them
    p, g = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    columns = term_columns(cfg)

    def score(kind: int, step: int, images: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if kind == EVAL:
            prompts, names = [eval_prompts[i] for i in ids], [t.name for t in columns["eval"]]
        else:
            prompts, names = stream.for_samples(step, ids, p, g), [t.name for t in columns["rollout"]]
        if images.dim() == 5:  # videos: each frame scored as an image, then pooled per video
            return torch.stack([score_videos(terms[name], prompts, images, cfg.reward.frame_pooling) for name in names],
                               dim=1)
        return torch.stack([terms[name](prompts, images).to(torch.float32).cpu() for name in names], dim=1)

    return score


def score_videos(term, prompts: list[str], videos: torch.Tensor, how: str) -> torch.Tensor:
    """A term's float32 [n] scores of videos [n, F, H, W, 3]: each frame scored as an image with its
    video's prompt, the frames' scores pooled per video (reward.frame_pooling)."""
    n, f = videos.shape[:2]
    frame_prompts = [p for p in prompts for _ in range(f)]
    return pool_frames(term(frame_prompts, videos.flatten(0, 1)).to(torch.float32).cpu().reshape(n, f), how)


def pool_frames(scores: torch.Tensor, how: str) -> torch.Tensor:
    """[n, F] frame scores -> [n] video scores (reward.frame_pooling)."""
    if how == "min":
        return scores.amin(dim=1)
    if how == "max":
        return scores.amax(dim=1)
    return scores.mean(dim=1)
