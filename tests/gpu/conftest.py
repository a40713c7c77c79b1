"""GPU tests: every test here has the `gpu` marker (tests/conftest.py) and is skipped when no
CUDA device is present (CI has none; run them on a GPU machine with `pytest -m gpu tests/gpu`)."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    problem = None
    checked = False
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            if not checked:
                problem, checked = _cuda_problem(), True
            if problem:
                item.add_marker(pytest.mark.skip(reason=problem))
