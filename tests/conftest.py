"""Shared fixtures for the whole test tree.

`tiny_models`: the tiny SD3.5 and PickScore folders (tiny_models.md), built once per session
into a temporary folder with hpcnft.tiny.ensure_tiny_models (about 8 s on 2 cores, most of it
the first import of diffusers/transformers; later builds in the same process take ~1 s).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    """(sd35_tiny folder, pickscore_tiny folder)."""
    from hpcnft.tiny import ensure_tiny_models

    return ensure_tiny_models(str(tmp_path_factory.mktemp("tiny")))
