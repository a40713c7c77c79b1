"""hpcnft.run.entry.take_run_dir: rank 0 takes the run dir and every rank gets the same outcome
(exit code and line), whatever goes wrong on rank 0. The outcomes are checked on a one-rank gloo
group in this process; that a failure on rank 0 reaches the other ranks (rather than leaving them
in a collective) with two gloo ranks in two processes (tests/integration/test_run_dir_lock.py
refuses a job of three)."""
from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import pytest


def _rank(rank: int, store: str, run_dir: str, fault: str, out) -> None:
    import torch.distributed as dist

    from hpcnft.run import entry

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if fault == "crash":
        def crash(*_args, **_kwargs):
            raise RuntimeError("lock service fell over")
        entry.lock_run_dir = crash  # a failure of a kind the lock does not expect
    notes: list[str] = []
    lock, refusal = entry.take_run_dir(SimpleNamespace(run_dir=run_dir), rank, notes)
    out.put((rank, lock is not None, refusal))
    if lock:
        lock.release()
    dist.destroy_process_group()


def outcomes(tmp_path, run_dir: str, fault: str = "") -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), run_dir, fault, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, locked, refusal = out.get(timeout=120)
        results[rank] = (locked, refusal)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store1'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def take(run_dir: str):
    from hpcnft.run.entry import take_run_dir

    notes: list[str] = []
    lock, refusal = take_run_dir(SimpleNamespace(run_dir=run_dir), 0, notes)
    return lock, refusal, notes


def test_rank_0_holds_a_free_run_dir(tmp_path, one_rank):
    from hpcnft.io.rundir_lock import parse_holder

    lock, refusal, notes = take(str(tmp_path / "run"))
    assert refusal is None and notes == []
    assert parse_holder((tmp_path / "run" / ".lock").read_text()).pid == os.getpid()
    lock.release()


def test_a_run_dir_in_use_is_refused_with_exit_2(tmp_path, one_rank):
    from hpcnft.io.rundir_lock import acquire

    run_dir = str(tmp_path / "run")
    held = acquire(run_dir, pytest.fail)
    try:
        lock, (code, line), _ = take(run_dir)
    finally:
        held.release()
    assert lock is None and code == 2
    assert line.startswith(f"run dir {run_dir} is in use by pid {os.getpid()} on host ")


def test_a_lock_file_that_is_not_a_file_is_bad_input(tmp_path, one_rank):
    os.makedirs(tmp_path / "run" / ".lock")
    lock, refusal, _ = take(str(tmp_path / "run"))
    assert lock is None
    assert refusal == (2, f"run dir {tmp_path / 'run'}: .lock is not a regular file; remove it")


def test_a_taken_over_lock_is_noted_for_rank_0s_log(tmp_path, one_rank):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").write_text("pid=999999999\nhost=gone\n")
    lock, refusal, notes = take(str(tmp_path / "run"))
    assert refusal is None and len(notes) == 1 and "was held by pid 999999999 on host gone" in notes[0]
    lock.release()


def test_an_unexpected_failure_on_rank_0_reaches_every_rank(tmp_path):
    got = outcomes(tmp_path, str(tmp_path / "run"), fault="crash")
    assert got[0] == got[1] == (False, (1, f"rank 0: cannot take run dir {tmp_path / 'run'}: "
                                          "RuntimeError: lock service fell over"))
