"""Shared fixtures and the test tiers for the whole test tree.

Tiers (README, Testing): a test marked `slow` (end-to-end tiny jobs), `hpc` (the local Slurm
cluster: everything under tests/hpc) or `gpu` (CUDA: everything under tests/gpu) runs only when
asked for, with `-m` or by naming its file; every other test is in the `default` tier, which a
plain `python3 -m pytest` runs. `-m "default or slow or hpc or gpu"` runs them all (CI).

`tiny_models`: the tiny SD3.5 and PickScore folders (tiny_models.md), built once per session
into a temporary folder with hpcnft.models.tiny.ensure_tiny_models (about 8 s on 2 cores, most of it
the first import of diffusers/transformers; later builds in the same process take ~1 s).

`hpcnft_cache`: one HPCNFT_CACHE for the session (tests/integration and tests/hpc use it for every
test).

`tiny_run`, `tiny_run_again`: the embedded default job, 3 steps, started once per session and
shared by every test that only reads a finished run (see below).

Parallel workers (pytest-xdist, `-n 3 --dist loadgroup`, as CI runs every tier): the tests of a
module stay on one worker (their module fixtures run once), every hpc test on one, in turn
(`worker_group`), and the session's shared runs and tiny model cache are made once for all
workers (`shared_result`). The hpc tests wait on Slurm most of their time, their jobs using
about half a core: with three workers the other two keep both cores busy meanwhile.

`thread_spy`: replace a module's function by one that records the thread it runs in.
"""
from __future__ import annotations

import os

import pytest

from jobs import INVARIANT_ARGS, INVARIANT_STEPS, FinishedRun, shared_result, start_tiny_run

from tiers import COUNTS, TIERS


def pytest_configure(config):
    config.addinivalue_line("markers", "default: the default tier (every test not marked slow, hpc or gpu)")
    # Without -m: a plain `pytest` (the tree of pyproject's testpaths) runs the default tier; files
    # or tests named on the command line run whatever their tier.
    if not config.option.markexpr and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.option.markexpr = "default"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before `-m` selects: every test under tests/hpc is `hpc`, under tests/gpu `gpu`, and a
    test of no tier is `default`."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    folders = {here / "hpc": pytest.mark.hpc, here / "gpu": pytest.mark.gpu}
    for item in items:
        parents = Path(str(item.fspath)).resolve().parents
        for folder, mark in folders.items():
            if folder in parents:
                item.add_marker(mark)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.default)
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))
    if config.args_source != pytest.Config.ArgsSource.ARGS:  # the whole tree: the README's counts hold it
        config.stash[COUNTS] = {**{tier: sum(1 for item in items if item.get_closest_marker(tier))
                                   for tier in ("default", *TIERS)}, "all": len(items)}


def worker_group(item) -> str:
    """The tests xdist keeps on one worker, in turn: every hpc test (both clusters' tests wait
    on Slurm; a worker of their own lets the others fill the cores), and otherwise each
    module's (their module fixtures run once)."""
    module = item.nodeid.split("::")[0]
    return "hpc" if item.get_closest_marker("hpc") is not None else module


@pytest.fixture(autouse=True)
def no_wandb_service_left_behind():
    """wandb run in a test's own process exports WANDB_SERVICE (its service's socket); jobs
    started by later tests would inherit it and talk to that service instead of their own."""
    before = os.environ.get("WANDB_SERVICE")
    yield
    if before is None:
        os.environ.pop("WANDB_SERVICE", None)
    else:
        os.environ["WANDB_SERVICE"] = before


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
    path = old or shared_result(tmp_path_factory, "hpcnft-cache", str)
    os.environ["HPCNFT_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("HPCNFT_CACHE", None)
    else:
        os.environ["HPCNFT_CACHE"] = old


# -- the shared tiny run (tests/jobs.py: TINY_STEPS, TINY_ARGS and why) -------------------
@pytest.fixture(scope="session")
def tiny_run(hpcnft_cache, tmp_path_factory) -> FinishedRun:
    return FinishedRun(*shared_result(tmp_path_factory, "tiny-run", lambda d: start_tiny_run(str(d / "run"))))


@pytest.fixture(scope="session")
def tiny_run_again(hpcnft_cache, tmp_path_factory) -> FinishedRun:
    """The same command once more, into another run dir (bit-identical runs)."""
    return FinishedRun(*shared_result(tmp_path_factory, "tiny-run-again", lambda d: start_tiny_run(str(d / "run"))))


# determinism.layout_invariant's tiny run straight on 2+1 (tests/jobs.py: INVARIANT_ARGS), which
# the runs resumed on other layouts are held to: test_layout_invariance, and mpirun's in tests/hpc
@pytest.fixture(scope="session")
def invariant_run(hpcnft_cache, tmp_path_factory) -> str:
    def make(folder):
        return start_tiny_run(str(folder / "run"), INVARIANT_STEPS, INVARIANT_ARGS).run_dir
    return shared_result(tmp_path_factory, "invariant-run", make)


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
