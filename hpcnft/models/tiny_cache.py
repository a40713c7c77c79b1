"""Where the tiny models are cached, readable without importing torch (the launcher checks it)."""
from __future__ import annotations

import os

SD3_DIRNAME, PICKSCORE_DIRNAME = "sd35_tiny", "pickscore_tiny"
DONE_MARKER = "BUILD_COMPLETE"


def cache_dir() -> str:
    base = os.environ.get("HPCNFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hpcnft")
    return os.path.join(base, "tiny-models")


def built(path: str) -> bool:
    return os.path.exists(os.path.join(path, DONE_MARKER))
