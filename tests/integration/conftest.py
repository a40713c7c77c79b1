"""Fixtures for end-to-end runs of the tiny job (helpers live in jobs.py)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """One tiny-model build per session, shared by every run."""
    path = str(tmp_path_factory.mktemp("hpcnft-cache"))
    old = os.environ.get("HPCNFT_CACHE")
    os.environ["HPCNFT_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("HPCNFT_CACHE", None)
    else:
        os.environ["HPCNFT_CACHE"] = old
