"""Fixtures for end-to-end runs of the tiny job (helpers live in jobs.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(hpcnft_cache):
    """Every run shares the session's HPCNFT_CACHE (tests/conftest.py): one tiny-model build."""
    return hpcnft_cache
