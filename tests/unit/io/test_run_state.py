"""hpcnft.io.run_state: a checkpoint's copy of run.h5 holds every row, RNG snapshot, attempt, event
and attribute written up to its step, rebuilds a run.h5 the writer carries on with, and a copy
that is missing, damaged, planted with links or of another step is refused with its reason."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from hardening_tools import make_checkpoint, writer_made_run
from hpcnft.algo.checkpoint_parts import checkpoint_parts
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.common import determinism
from hpcnft.io import checkpoint, run_state, runfile
from hpcnft.io.run_writer import RunFileWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process

STEPS = 4  # writer_made_run's rows end at step 4


def _same_content(a: runfile.RunData, b: runfile.RunData, path_a: str, path_b: str) -> None:
    assert a.attrs == b.attrs and a.topology == b.topology and a.attempts == b.attempts
    assert set(a.metrics) == set(b.metrics)
    for key in a.metrics:
        assert a.metrics[key].dtype == b.metrics[key].dtype
        assert np.array_equal(a.metrics[key], b.metrics[key], equal_nan=True), key
    assert a.rng_steps == b.rng_steps and a.rng_steps
    for step in a.rng_steps:
        assert runfile.read_rng(path_a, step) == runfile.read_rng(path_b, step)


@pytest.fixture
def run_h5(tmp_path) -> str:
    path = str(tmp_path / "run.h5")
    writer_made_run(path, steps=STEPS)
    return path


def test_a_snapshot_through_the_open_writer_holds_everything_plus_its_checkpoint_event(run_h5, tmp_path):
    snap = str(tmp_path / "run_state.h5")
    w = RunFileWriter(run_h5, runfile.read_run(run_h5).attrs["config"], "test", NFT_KEYS)
    try:
        w.snapshot(snap, (STEPS, "checkpoint", "checkpoints/step_000004"))
    finally:
        w.close()
    original, copy = runfile.read_run(run_h5), runfile.read_run(snap)
    _same_content(original, copy, run_h5, snap)
    assert isinstance(copy.attrs[run_state.RUN_ID], str) and len(copy.attrs[run_state.RUN_ID]) == 32
    assert copy.events[:-1] == original.events
    assert (copy.events[-1]["step"], copy.events[-1]["kind"], copy.events[-1]["text"]) == \
        (STEPS, "checkpoint", "checkpoints/step_000004")


def test_a_rebuilt_run_file_is_the_copy_and_the_writer_appends_to_it(run_h5, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    w = RunFileWriter(run_h5, "{}", "test", NFT_KEYS)
    w.snapshot(run_state.run_state_path(ckpt))
    w.close()
    rebuilt = str(tmp_path / "rebuilt" / "run.h5")
    os.makedirs(os.path.dirname(rebuilt))
    run_state.rebuild(rebuilt, ckpt)
    assert not os.path.exists(rebuilt + ".rebuild")
    _same_content(runfile.read_run(run_h5), runfile.read_run(rebuilt), run_h5, rebuilt)
    w = RunFileWriter(rebuilt, "{}", "test", NFT_KEYS)
    w.append_metrics(STEPS + 1, {k: 0.25 for k in runfile.PER_STEP_KEYS})
    w.write_rng(STEPS + 1, {0: b"\x07"})
    w.close()
    after = runfile.read_run(rebuilt)
    assert after.metrics["train/grad_norm"][-1].tolist() == [STEPS + 1, 0.25]
    assert after.rng_steps[-1] == STEPS + 1
    assert after.attrs[run_state.RUN_ID] == runfile.read_run(run_h5).attrs[run_state.RUN_ID]


def test_the_writer_gives_a_run_file_one_run_id_for_good(tmp_path):
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    for path in (a, b):
        RunFileWriter(path, "{}", "test", NFT_KEYS).close()
    id_a = runfile.read_run(a).attrs[run_state.RUN_ID]
    assert id_a != runfile.read_run(b).attrs[run_state.RUN_ID]
    RunFileWriter(a, "{}", "test", NFT_KEYS).close()  # reopened: the same run
    assert runfile.read_run(a).attrs[run_state.RUN_ID] == id_a
    with h5py.File(a, "a") as f:  # a file of a version before run ids
        del f.attrs[run_state.RUN_ID]
    RunFileWriter(a, "{}", "test", NFT_KEYS).close()
    assert isinstance(runfile.read_run(a).attrs[run_state.RUN_ID], str)


@pytest.fixture
def ckpt_with_copy(run_h5, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    w = RunFileWriter(run_h5, "{}", "test", NFT_KEYS)
    w.snapshot(run_state.run_state_path(ckpt))
    w.close()
    return ckpt


def _external_link(f: h5py.File) -> None:
    f["metrics/train/elsewhere"] = h5py.ExternalLink("/etc/passwd", "/x")


def _soft_link(f: h5py.File) -> None:
    f["rng/step_9"] = h5py.SoftLink("/rng/step_2")


def _bad_rng(f: h5py.File) -> None:
    f.create_dataset("rng/step_2/rank_7", data=np.zeros(4, dtype=np.float32))


def _no_run_id(f: h5py.File) -> None:
    del f.attrs[run_state.RUN_ID]


def _extra_group(f: h5py.File) -> None:
    f.create_group("payload")


@pytest.mark.parametrize("damage,why", [
    (_external_link, "is a link"), (_soft_link, "is a link"), (_bad_rng, "is not an RNG state"),
    (_no_run_id, "has no run id"), (_extra_group, "unexpected 'payload'")])
def test_a_copy_of_another_shape_is_refused(ckpt_with_copy, damage, why):
    assert run_state.problems(ckpt_with_copy, STEPS) is None
    with h5py.File(run_state.run_state_path(ckpt_with_copy), "a") as f:
        damage(f)
    reason = run_state.problems(ckpt_with_copy, STEPS)
    assert reason and why in reason and reason.startswith("run_state.h5")
    assert len(reason.splitlines()) == 1


def test_a_missing_truncated_linked_or_misplaced_copy_is_refused(ckpt_with_copy, tmp_path):
    path = run_state.run_state_path(ckpt_with_copy)
    assert "ends at step 4, not at the checkpoint's step 6" in run_state.problems(ckpt_with_copy, 6)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    assert "run_state.h5:" in run_state.problems(ckpt_with_copy, STEPS)
    os.remove(path)
    assert run_state.problems(ckpt_with_copy, STEPS) == "run_state.h5 is missing"
    os.symlink(str(tmp_path / "run.h5"), path)
    assert run_state.problems(ckpt_with_copy, STEPS) == "run_state.h5 is not a regular file"


def test_set_aside_renames_and_never_overwrites(tmp_path):
    path = str(tmp_path / "run.h5")
    names = []
    for content in (b"first", b"second"):
        open(path, "wb").write(content)
        names.append(run_state.set_aside(path, "damaged"))
    assert not os.path.exists(path) and names[0] != names[1]
    assert [open(n, "rb").read() for n in names] == [b"first", b"second"]
    assert all(os.path.basename(n).startswith("run.h5.damaged-") for n in names)


def test_commit_puts_the_copy_in_the_checkpoint_and_a_failed_copy_fails_the_checkpoint(run_h5, tmp_path):
    from hardening_tools import tiny_policy

    run_dir = str(tmp_path / "run")
    final = make_checkpoint(run_dir, 1)
    assert not os.path.exists(run_state.run_state_path(final))  # no writer given: no copy
    w = RunFileWriter(run_h5, "{}", "test", NFT_KEYS)
    try:
        policy, opt = tiny_policy()
        checkpoint.save(run_dir, STEPS, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
        final = checkpoint.commit(run_dir, STEPS, checkpoint.TrainState(STEPS, {}), "{}", 2, w.snapshot)
        assert checkpoint.problems(final) is None and run_state.problems(final, STEPS) is None

        def full_disk(path):
            raise runfile.RunFileError(f"{path}: cannot write the run file (only 12 KiB free on its file system)")
        checkpoint.save(run_dir, STEPS + 1, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
        with pytest.raises(checkpoint.CheckpointError, match="only 12 KiB free") as e:
            checkpoint.commit(run_dir, STEPS + 1, checkpoint.TrainState(STEPS + 1, {}), "{}", 2, full_disk)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, STEPS + 1))
        assert not os.path.exists(checkpoint.partial_dir(run_dir, STEPS + 1))
        assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == [1, STEPS]
    finally:
        w.close()
