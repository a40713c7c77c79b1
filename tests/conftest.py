"""Shared fixtures for the whole test tree.

`tiny_models`: the tiny SD3.5 and PickScore folders (tiny_models.md), built once per session
into a temporary folder with hpcnft.models.tiny.ensure_tiny_models (about 8 s on 2 cores, most of it
the first import of diffusers/transformers; later builds in the same process take ~1 s).

`hpcnft_cache`: one HPCNFT_CACHE for the session (tests/integration uses it for every test).

`thread_spy`: replace a module's function by one that records the thread it runs in.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    """(sd35_tiny folder, pickscore_tiny folder)."""
    from hpcnft.models.tiny import ensure_tiny_models

    return ensure_tiny_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def hpcnft_cache(tmp_path_factory):
    """One HPCNFT_CACHE for the whole session, so the tiny models are built once: the jobs
    inherit it (subprocesses, sbatch --export=ALL, submitit, srun and mpirun pass the environment
    on). An HPCNFT_CACHE already set (by the user or another fixture) is kept."""
    old = os.environ.get("HPCNFT_CACHE")
    path = old or str(tmp_path_factory.mktemp("hpcnft-cache"))
    os.environ["HPCNFT_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("HPCNFT_CACHE", None)
    else:
        os.environ["HPCNFT_CACHE"] = old


@pytest.fixture
def thread_spy(monkeypatch):
    """spy(module, name) -> the list of thread names module.name is called in from now on (the
    function still runs); for tests of work moved to worker threads."""
    import threading

    def spy(module, name: str) -> list[str]:
        threads, real = [], getattr(module, name)

        def recording(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, recording)
        return threads
    return spy
