"""Fixtures for end-to-end runs of the tiny job (helpers live in tests/jobs.py; the shared
`tiny_run` in tests/conftest.py)."""
from __future__ import annotations

import pytest

from jobs import TINY_ARGS, hpcnft, shared_result


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(hpcnft_cache):
    """Every run shares the session's HPCNFT_CACHE (tests/conftest.py): one tiny-model build."""
    return hpcnft_cache


def finished_run(folder, recipe: str, *args: str) -> str:
    run_dir = str(folder / "run")
    hpcnft("run", recipe, "--steps", "3", "--run-dir", run_dir, *args)
    return run_dir


@pytest.fixture(scope="session")
def tiny_fp16_run(tmp_path_factory) -> str:
    """`hpcnft run tiny_fp16 --steps 3`: its standard's command, with the overflowing first step."""
    return shared_result(tmp_path_factory, "tiny-fp16-run", lambda d: finished_run(d, "tiny_fp16"))


@pytest.fixture(scope="session")
def tiny_flux_run(tmp_path_factory) -> str:
    """`hpcnft run tiny_flux --steps 3` with a checkpoint after every step: the FLUX.1 twin of
    `tiny_run`, for the FLUX job's tests and export."""
    return shared_result(tmp_path_factory, "tiny-flux-run", lambda d: finished_run(d, "tiny_flux", *TINY_ARGS))


@pytest.fixture(scope="session")
def tiny_qwen_image_run(tmp_path_factory) -> str:
    """`hpcnft run tiny_qwen_image --steps 3` with a checkpoint after every step: the Qwen-Image twin."""
    return shared_result(tmp_path_factory, "tiny-qwen-image-run",
                         lambda d: finished_run(d, "tiny_qwen_image", *TINY_ARGS))


@pytest.fixture(scope="session")
def tiny_wan_run(tmp_path_factory) -> str:
    """`hpcnft run tiny_wan --steps 3` with a checkpoint after every step: the video twin of
    `tiny_run`, for the Wan job's tests."""
    return shared_result(tmp_path_factory, "tiny-wan-run", lambda d: finished_run(d, "tiny_wan", *TINY_ARGS))


@pytest.fixture(scope="session")
def tiny_ema_run(tmp_path_factory) -> str:
    """`hpcnft run tiny --steps 2` evaluating the evaluation EMA of theta (eval.policy="ema", the
    official recipe's): the end-of-run evaluation and checkpoint at step 2, for export's tests."""
    def make(folder) -> str:
        run_dir = str(folder / "run")
        hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir, "--set", "eval.policy=ema")
        return run_dir
    return shared_result(tmp_path_factory, "tiny-ema-run", make)
