"""Prompt files: one prompt per line, a path or a file shipped in hpcnft/data (no torch here, so
the run-file tools can read a run's prompts and start fast)."""
from __future__ import annotations

import os
from importlib import resources


class PromptFileError(Exception):
    pass


def read_prompt_file(spec: str, key: str) -> list[str]:
    """A path, or `builtin:NAME` for a file shipped in hpcnft/data; one prompt per line."""
    if spec.startswith("builtin:"):
        res = resources.files("hpcnft.data") / spec[len("builtin:"):]
        if not res.is_file():
            raise PromptFileError(f"{key}: no built-in prompt file {spec!r}")
        text = res.read_text(encoding="utf-8")
    else:
        if os.path.isdir(spec):
            raise PromptFileError(f"{key}: {spec!r} is a directory, not a prompt file")
        if not os.path.isfile(spec):
            raise PromptFileError(f"{key}: prompt file {spec!r} does not exist")
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PromptFileError(f"{key}: cannot read prompt file {spec!r} ({e})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptFileError(f"{key}: prompt file {spec!r} is empty")
    return prompts
