"""The `[reward]` section and its terms (`[[reward.terms]]`), and the kinds of term: which module
loads each (hpcnft.rewards.registry imports it only when a term of that kind is used, so this
module, and with it the config, imports no torch)."""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass

from hpcnft.common.config import setting
from hpcnft.common.errors import ConfigError

# kind -> the module whose load(term, cfg, device) makes its RewardTerm
MODULES = {
    "pickscore": "hpcnft.rewards.pickscore",
    "hpsv2": "hpcnft.rewards.hpsv2",
    "clipscore": "hpcnft.rewards.clipscore",
    "aesthetic": "hpcnft.rewards.aesthetic",
    "jpeg_compressibility": "hpcnft.rewards.jpeg",
    "jpeg_incompressibility": "hpcnft.rewards.jpeg",
    "ocr": "hpcnft.rewards.ocr",
    "remote": "hpcnft.rewards.remote",
}
TERM_KINDS = tuple(MODULES)
# What a kind needs beyond hpcnft's own dependencies: kind -> (its extra, the modules it imports)
EXTRAS = {"ocr": ("ocr", ("rapidocr_onnxruntime", "onnxruntime", "Levenshtein"))}
# Kinds that read something of every prompt: kind -> the torch-free module whose
# check_prompts(prompts, key, term) refuses a prompt the kind cannot score
PROMPT_CHECKS = {"ocr": "hpcnft.rewards.ocr_text"}
# Kinds whose models come with their package: no model_dir, processor_dir or weights
BUNDLED = ("ocr",)
TERM_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
# A remote term's token_env: the variable holding its shared secret. Only HPCNFT_ names, so that a
# recipe from elsewhere cannot send another secret of the environment (a cloud key) to its url.
REWARD_TOKEN_ENV = "HPCNFT_REWARD_TOKEN"
TOKEN_ENV = re.compile(r"HPCNFT_[A-Z0-9_]{1,100}")


FRAME_POOLINGS = ("mean", "min", "max")


@dataclass
class RewardTermConfig:
    """One reward term (`[[reward.terms]]` in a recipe); see docs/rewards.md."""
    kind: str = setting("pickscore", "what scores the images (docs/rewards.md describes each kind)", choices=TERM_KINDS)
    name: str = setting("", "the metric name (`rollout/reward/<name>/*`, `eval/<name>_*`; lower-case letters, "
                            "digits and _); empty: the kind")
    weight: float = setting(1.0, "the term's weight in the training reward")
    eval_only: bool = setting(False, "scored at evaluation only, not part of the training reward")
    model_dir: str = setting("", "the term's model folder; empty: the kind's tiny model (ocr: none, its models come "
                                 "with its extra)")
    processor_dir: str = setting("", "the term's processor (tokenizer) folder; empty: the kind's own (mostly `model_dir`)")
    weights: str = setting("", "a checkpoint file the kind needs beside its folder (hpsv2, aesthetic)")
    url: str = setting("", "remote: the scorer's http:// or https:// URL (`hpcnft reward-server`)", on_resume="warn")
    timeout_s: float = setting(60.0, "remote: seconds to wait for a reply", on_resume="warn")
    retry_for_s: float = setting(
        300.0, "remote: seconds a request keeps retrying a server that is down, restarting or busy (backoff with "
        "jitter) before the job stops with a checkpoint of the steps done (exit 69); with `timeout_s`, less than "
        "`layout.timeout_s`", on_resume="warn")
    retries: int = setting(-1, "remote: the most retries of a request within `retry_for_s` (-1: no such limit)",
                           on_resume="warn")
    token_env: str = setting(
        REWARD_TOKEN_ENV, "remote: the environment variable (`HPCNFT_...`) holding the server's shared secret; "
        "\"\": send none", on_resume="warn")


@dataclass
class RewardConfig:
    frame_pooling: str = setting("mean", "a video's score from its frames' (every term scores each frame as an "
                                 "image): their `mean`, `min` or `max`", choices=FRAME_POOLINGS)
    scale: float = setting(1.0, "training reward = scale × Σ weight × term over the training terms (−1: a control "
                                "run that should lower it); `eval/<term>_*` report the plain term")
    terms: list[RewardTermConfig] = setting(
        [], "the reward terms, each a table (`[[reward.terms]]`, keys below; see [Reward terms](rewards.md)); "
        "empty: PickScore alone, from `models.pickscore_dir`")

    def check(self) -> None:
        names = []
        for i, t in enumerate(self.terms):
            key = f"reward.terms[{i}]"
            if t.kind not in TERM_KINDS:
                raise ConfigError(f"{key}.kind: {t.kind!r} is not one of {', '.join(TERM_KINDS)}")
            name = t.name or t.kind
            if not TERM_NAME.fullmatch(name):
                raise ConfigError(f"{key}.name: {name!r} must be lower-case letters, digits and _ (a metric name)")
            if name in names:
                raise ConfigError(f"{key}.name: {name!r} names two terms (give each its own name)")
            names.append(name)
            if not math.isfinite(t.weight):
                raise ConfigError(f"{key}.weight: must be a finite number, got {t.weight!r}")
            if not (math.isfinite(t.timeout_s) and t.timeout_s > 0):
                raise ConfigError(f"{key}.timeout_s: must be > 0, got {t.timeout_s!r}")
            if not (math.isfinite(t.retry_for_s) and t.retry_for_s >= 0):
                raise ConfigError(f"{key}.retry_for_s: must be a number of seconds >= 0, got {t.retry_for_s!r}")
            if t.retries < -1:
                raise ConfigError(f"{key}.retries: must be >= 0, or -1 for no limit, got {t.retries!r}")
            if t.token_env and not TOKEN_ENV.fullmatch(t.token_env):
                raise ConfigError(f"{key}.token_env: {t.token_env!r} must name an environment variable HPCNFT_... "
                                  "(upper-case letters, digits and _), or be \"\" to send no token")
            if t.kind == "remote" and not re.match(r"https?://", t.url):
                raise ConfigError(f"{key}.url: a remote term needs an http:// or https:// URL, got {t.url!r}")
            for field in ("model_dir", "processor_dir", "weights"):
                if t.kind in BUNDLED and getattr(t, field):
                    raise ConfigError(f"{key}.{field}: the {t.kind} term's models come with its extra "
                                      f"(hpcnft[{EXTRAS[t.kind][0]}]); leave it empty")
        if self.terms and all(t.eval_only for t in self.terms):
            raise ConfigError("reward.terms: every term is eval_only, nothing would be trained on")

    def remote_wait_s(self) -> float:
        """The longest the remote terms may take over one chunk: each one's attempt, and its
        retries where it has any."""
        return sum(t.timeout_s + (t.retry_for_s if t.retries != 0 else 0.0)
                   for t in self.terms if t.kind == "remote")

    def check_prompts(self, train: list[str], evaluation: list[str]) -> None:
        """ConfigError (one line) where a term could not score a prompt it will get: an `ocr`
        term one without double-quoted text. Training terms score the training and the
        evaluation prompts, eval_only ones the evaluation prompts."""
        for t in self.terms:
            if t.kind in PROMPT_CHECKS:
                check = importlib.import_module(PROMPT_CHECKS[t.kind]).check_prompts
                if not t.eval_only:
                    check(train, "data.train_prompts", t.name or t.kind)
                check(evaluation, "data.eval_prompts", t.name or t.kind)

    def missing_extra(self) -> str | None:
        """Why a configured term could not load here (its extra is not installed), or None."""
        for t in self.terms:
            extra = EXTRAS.get(t.kind)
            missing = [m for m in extra[1] if importlib.util.find_spec(m) is None] if extra else []
            if missing:
                return (f"reward term {t.name or t.kind!r} (kind {t.kind!r}) needs the {extra[0]!r} extra, and "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here: "
                        f"pip install 'hpcnft[{extra[0]}]'")
        return None
