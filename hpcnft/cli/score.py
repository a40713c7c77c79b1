"""`hpcnft score IMAGE... (--prompt TEXT | --prompts FILE) [--term TERM]... [--recipe R] [--json]`:
score image files with reward terms, each term loaded and called as a reward rank of the recipe
loads and calls it (hpcnft.rewards.registry.load_term, then term(prompts, uint8 images): the
term's own preprocessing), under the recipe's determinism settings and CPU thread count.

A TERM is a term name of the recipe's reward.terms or a kind with its defaults (as for
`hpcnft reward-server`); without --term, every term of the recipe. A run's sample grid
(RUN_DIR/samples/step_*.png) is scored cell by cell, each against the prompt it was generated
from (hpcnft.cli.score_inputs). A file of frames (an animated GIF, a video run's grid step_*.gif)
is scored frame by frame (`FILE@f`), and each video once more with its frames' scores pooled by the
recipe's reward.frame_pooling, as a reward rank scores a video. Prints one line per image and term
(`IMAGE  TERM  SCORE`), or with --json one JSON document; the terms' warnings (an image the OCR
term could not read) go to stderr. A file that is not an image, a missing prompt or one a term
cannot score exits 2 with one line."""
from __future__ import annotations

import json
import sys

from hpcnft.common.errors import EXIT_FAILED, UsageError, one_line


def add_arguments(name: str, p) -> None:
    from hpcnft.common.recipe_files import recipe_names
    from hpcnft.rewards.config import TERM_KINDS

    kinds = ", ".join(k for k in TERM_KINDS if k != "remote")
    p.add_argument("images", nargs="+", metavar="IMAGE",
                   help="image files (PNG, JPEG; an animated GIF frame by frame), or a run's sample grids "
                        "(RUN_DIR/samples/step_*.png, a video run's step_*.gif: each cell scored against the "
                        "prompt it was generated from)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--prompt", help="the prompt of every image file")
    which.add_argument("--prompts", metavar="FILE",
                       help="a prompt file (one prompt a line, or builtin:/csv: as data.train_prompts): one prompt "
                            "for every image file, or one per file in order")
    p.add_argument("--term", dest="terms", action="append", default=[], metavar="TERM",
                   help=f"a term name of the recipe's reward.terms, or a kind ({kinds}); repeatable; "
                        "default: every term of the recipe")
    p.add_argument("--recipe", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file: its terms, "
                        "determinism settings and CPU threads")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the terms' models run")
    p.add_argument("--json", action="store_true",
                   help="one JSON document: {terms, images: [{image, prompt, scores: {term: score}}], warnings}")


def check_prompts(terms: list, items: list) -> None:
    """UsageError where a term could not score an image's prompt (an ocr term: no quoted text)."""
    import importlib

    from hpcnft.common.errors import ConfigError
    from hpcnft.rewards.config import PROMPT_CHECKS

    for term in terms:
        if term.kind in PROMPT_CHECKS:
            check = importlib.import_module(PROMPT_CHECKS[term.kind]).check_prompts
            for item in items:
                try:
                    check([item.prompt], f"the prompt of {item.label}", term.name)
                except ConfigError as e:
                    raise UsageError(str(e).replace("prompt 1 of 1 has", "has")) from None


class ScoringFailed(Exception):
    """A term raised while scoring an image (one line: the term, the image and why)."""


def score_all(loaded: dict, items: list) -> list[dict]:
    """Each image's scores by term, one image at a time (a chunk of one, as a reward rank takes it)."""
    rows = []
    for item in items:
        scores = {}
        for name, term in loaded.items():
            try:
                scores[name] = float(term([item.prompt], item.image[None])[0])
            except Exception as e:  # noqa: BLE001 - one line: the term, the image and why
                raise ScoringFailed(f"term {name!r} failed on {item.label}: {one_line(e)}") from None
        rows.append({"image": item.label, "prompt": item.prompt, "scores": scores})
    return rows


def pooled_videos(rows: list[dict], items: list, pooling: str) -> list[dict]:
    """`rows` with, after each video's frames, the video's row: every term's frame scores pooled
    (reward.frame_pooling), as the reward rank pools a video's."""
    import torch

    from hpcnft.algo.reward import pool_frames

    out: list[dict] = []
    for k, (row, item) in enumerate(zip(rows, items)):
        out.append(row)
        if item.video is not None and (k + 1 == len(items) or items[k + 1].video != item.video):
            frames = [r for r, i in zip(rows, items) if i.video == item.video]
            scores = {t: float(pool_frames(torch.tensor([[r["scores"][t] for r in frames]], dtype=torch.float32),
                                           pooling)[0]) for t in row["scores"]}
            out.append({"image": item.video, "prompt": item.prompt, "scores": scores, "frames": len(frames)})
    return out


def main(name: str, args) -> int:
    import torch

    from hpcnft.algo.root_config import ConfigError, load_config
    from hpcnft.cli.reward_server import load_terms, served_terms
    from hpcnft.cli.score_inputs import inputs
    from hpcnft.common import determinism
    from hpcnft.common.term_warnings import collected
    from hpcnft.rewards.registry import job_terms

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    terms = served_terms(args.terms, cfg, allow_remote=True) if args.terms else job_terms(cfg)
    items = inputs(args.images, args.prompt, args.prompts)
    check_prompts(terms, items)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    determinism.enable(cfg.determinism.enabled, cfg.determinism.cpu_threads, args.device)
    determinism.seed_globals(cfg.train.seed)  # as a reward rank of this config is seeded
    loaded = load_terms(terms, cfg, torch.device(args.device))
    with collected() as warnings:
        try:
            rows = pooled_videos(score_all(loaded, items), items, cfg.reward.frame_pooling)
        except ScoringFailed as e:
            print(f"hpcnft {name}: error: {e}", file=sys.stderr)
            return EXIT_FAILED
    for text in warnings:
        print(f"hpcnft {name}: warning: {text}", file=sys.stderr)
    if args.json:
        print(json.dumps({"terms": list(loaded), "images": rows, "warnings": warnings}, indent=1))
        return 0
    width = max(len(row["image"]) for row in rows)
    for row in rows:
        for term, value in row["scores"].items():
            print(f"{row['image']:<{width}}  {term}  {value:.4f}")
    return 0
