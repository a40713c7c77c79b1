"""Where the tiny models are cached, and how one is built there once, readable without importing
torch (the launcher checks it)."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Callable

SD3_DIRNAME, PICKSCORE_DIRNAME, FLUX_DIRNAME = "sd35_tiny", "pickscore_tiny", "flux1_tiny"
QWEN_IMAGE_DIRNAME, WAN_DIRNAME = "qwen_image_tiny", "wan21_tiny"
# the tiny base models built alone
FAMILY_DIRNAMES = {"flux": FLUX_DIRNAME, "qwen_image": QWEN_IMAGE_DIRNAME, "wan": WAN_DIRNAME}
DONE_MARKER = "BUILD_COMPLETE"


def cache_dir() -> str:
    base = os.environ.get("HPCNFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hpcnft")
    return os.path.join(base, "tiny-models")


def tiny_cache(cfg) -> str:
    """Where this config's tiny models are built: models.tiny_cache, else the default cache."""
    return cfg.models.tiny_cache or cache_dir()


def reads_pickscore_dir(cfg) -> bool:
    """Whether a PickScore term reads models.pickscore_dir (no reward.terms: PickScore alone)."""
    return not cfg.reward.terms or any(t.kind == "pickscore" and not t.model_dir for t in cfg.reward.terms)


def tiny_models_used(cfg) -> tuple[bool, bool]:
    """Which tiny base models a config uses: (the tiny SD3.5 and PickScore, built together; the
    family's own tiny model, FLUX.1-dev's, Qwen-Image's or Wan's: FAMILY_DIRNAMES), where the folder the config
    names is empty. The tiny PickScore only where a
    PickScore term reads models.pickscore_dir (no reward.terms: PickScore alone)."""
    m = cfg.models
    base = base_dir(m)
    tiny_pickscore = reads_pickscore_dir(cfg) and not m.pickscore_dir
    return tiny_pickscore or (m.family == "sd3" and not base), m.family in FAMILY_DIRNAMES and not base


def base_dir(models_cfg) -> str:
    """The base model's folder of models.family (models.sd3_dir, flux_dir, qwen_image_dir or wan_dir)."""
    return getattr(models_cfg, f"{models_cfg.family}_dir")


def built(path: str) -> bool:
    return os.path.exists(os.path.join(path, DONE_MARKER))


def ensure_tiny(cache_dir: str, name: str, build: Callable[[str], None]) -> str:
    """CACHE/NAME built by `build(folder)` on first use. Ranks that start together take a file
    lock so that exactly one builds; a build is moved into place whole, then marked done."""
    final = os.path.join(cache_dir, name)
    done = os.path.join(final, DONE_MARKER)
    if os.path.exists(done):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".build-{name}-") as tmp:
                built = os.path.join(tmp, name)
                os.makedirs(built)
                build(built)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(built, final)
            with open(done, "w") as f:
                f.write("built\n")
    return final
