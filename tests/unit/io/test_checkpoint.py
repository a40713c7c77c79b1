"""hpcnft.io.checkpoint: what a checkpoint holds is loaded without executing anything (DCP metadata,
shards, RNG states, JSON files are checked first), and a failed save (full disk, failed write)
removes its .partial, names it, and leaves the last good checkpoint."""
from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hardening_tools import make_checkpoint, payload_bytes, small_tmpfs, tiny_policy
from hpcnft.algo.checkpoint_parts import checkpoint_parts
from hpcnft.common import determinism
from hpcnft.io import checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP in one process
              pytest.mark.filterwarnings("ignore:Detected pickle protocol")]  # the planted payloads


def _byte_item(path: str):
    """(shard file, offset, length) of a non-tensor item (an optimizer hyper-parameter)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = checkpoint.SafeReader(path).read_metadata()
    fqn = next(k for k, md in meta.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata))
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    return os.path.join(path, info.relative_path), info.offset, info.length


def _plant_at(file: str, offset: int, length: int, blob: bytes) -> None:
    assert len(blob) <= length
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(blob.ljust(length, b"\0"))


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(str(tmp_path / "run"), 1)


def test_a_clean_checkpoint_passes_and_loads(ckpt):
    assert checkpoint.problems(ckpt) is None
    policy, opt = tiny_policy(seed=1)
    assert checkpoint.load(ckpt, checkpoint_parts(policy, opt), None).step == 1
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # non-tensor items come back (weights-only)


def test_the_evaluation_ema_is_saved_and_loaded(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    policy, opt = tiny_policy(seed=4, eval_ema=True)
    saved = [e.clone() for e in policy.eval_shadow]
    checkpoint.save(run_dir, 1, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
    path = checkpoint.commit(run_dir, 1, checkpoint.TrainState(1, {}), "{}", 2)
    fresh, fresh_opt = tiny_policy(seed=4, eval_ema=True)
    for e in fresh.eval_shadow:
        e.zero_()
    checkpoint.load(path, checkpoint_parts(fresh, fresh_opt), None)
    assert all(torch.equal(a, b) for a, b in zip(fresh.eval_shadow, saved))
    assert not all(torch.equal(a, b) for a, b in zip(fresh.eval_shadow, fresh.shadow))  # its own tensors


def test_stock_dcp_runs_a_payload_planted_in_a_shard_item_but_hpcnft_never_does(ckpt, tmp_path):
    """DCP's DefaultLoadPlanner unpickles non-tensor items with weights_only=False: the control
    shows the planted payload is live; hpcnft's problems() and load() refuse it unexecuted."""
    marker = tmp_path / "MARKER"
    _plant_at(*_byte_item(ckpt), payload_bytes(str(marker)))
    why = checkpoint.problems(ckpt)
    assert why and "is not weights-only data" in why and not marker.exists()
    policy, opt = tiny_policy(seed=1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(ckpt, checkpoint_parts(policy, opt), None)
    assert len(str(e.value).splitlines()) == 1 and ckpt in str(e.value)
    assert not marker.exists()
    # control: the stock reader executes it
    state = checkpoint_parts(policy, opt)
    with pytest.raises(BaseException):
        dcp.load(state, checkpoint_id=ckpt)
    assert marker.exists()


def test_a_shard_replaced_by_a_pickle_is_refused(ckpt, tmp_path):
    marker = tmp_path / "MARKER"
    with open(os.path.join(ckpt, "__0_0.distcp"), "wb") as f:
        f.write(payload_bytes(str(marker)))
    assert "shorter than its metadata says" in checkpoint.problems(ckpt)
    policy, opt = tiny_policy(seed=1)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(ckpt, checkpoint_parts(policy, opt), None)
    assert not marker.exists()


@pytest.mark.parametrize("how", ["whole file", "inside genuine metadata"])
def test_a_metadata_payload_is_refused(ckpt, tmp_path, how):
    marker = tmp_path / "MARKER"
    if how == "whole file":
        blob = payload_bytes(str(marker))
    else:
        from hardening_tools import Payload

        meta = checkpoint.SafeReader(ckpt).read_metadata()
        meta.planner_data = {"x": Payload(str(marker))}
        blob = pickle.dumps(meta)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(blob)
    assert checkpoint.problems(ckpt) == "unreadable DCP metadata (UnpicklingError)"
    with pytest.raises(pickle.UnpicklingError, match="system"):
        checkpoint.SafeReader(ckpt).read_metadata()
    assert not marker.exists()


def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(ckpt):
    meta = checkpoint.SafeReader(ckpt).read_metadata()
    for info in meta.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    assert "outside the checkpoint" in checkpoint.problems(ckpt)


def test_an_rng_state_payload_is_refused(ckpt, tmp_path):
    marker = tmp_path / "MARKER"
    with open(checkpoint.rng_path(ckpt, 0), "wb") as f:
        f.write(payload_bytes(str(marker)))
    why = checkpoint.problems(ckpt)
    assert why.startswith("rng/rank_0.bin:") and "system" in why
    with pytest.raises(pickle.UnpicklingError):
        determinism.restore_rng_state(checkpoint.read_rng(ckpt, 0))
    assert not marker.exists()


@pytest.mark.parametrize("name,content,why", [
    ("trainer_state.json", "[1, 2]", "trainer_state.json is not a JSON object"),
    ("trainer_state.json", '{"step": "1"}', "lacks step"),
    ("config.json", "{", "config.json is unreadable"),
])
def test_checkpoint_json_files_are_validated(ckpt, name, content, why):
    with open(os.path.join(ckpt, name), "w") as f:
        f.write(content)
    assert why in checkpoint.problems(ckpt)


# ---------------------------------------------------------------------------------------------
# failed writes
# ---------------------------------------------------------------------------------------------
def test_a_failed_shard_write_removes_the_partial_and_names_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    good = make_checkpoint(run_dir, 1)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", full)
    policy, opt = tiny_policy(seed=2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(run_dir, 2, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
    assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2) + ": cannot write the checkpoint")
    assert "No space left on device" in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.latest_usable(run_dir, print) == (1, good)


def test_a_failed_commit_removes_the_partial_and_names_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    good = make_checkpoint(run_dir, 1)
    policy, opt = tiny_policy(seed=2)
    checkpoint.save(run_dir, 2, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError, match="step_000002.partial: cannot write the checkpoint"):
        checkpoint.commit(run_dir, 2, checkpoint.TrainState(2, {}), "{}", keep=1)
    monkeypatch.undo()
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.list_checkpoints(run_dir) == [(1, good)] and checkpoint.problems(good) is None
    policy, opt = tiny_policy(seed=3)
    assert checkpoint.load(good, checkpoint_parts(policy, opt), None).step == 1


def test_a_full_tmpfs_fails_a_checkpoint_cleanly(tmp_path):
    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "2m"):
        run_dir = os.path.join(mnt, "run")
        good = make_checkpoint(run_dir, 1, width=256)  # ~1.3 MB: the second one cannot fit
        with pytest.raises(checkpoint.CheckpointError) as e:
            make_checkpoint(run_dir, 2, width=256)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2) + ": cannot write the checkpoint (file "
                                       "system full, ")
        assert len(str(e.value).splitlines()) == 1
        assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
        assert checkpoint.latest_usable(run_dir, print) == (1, good)
        policy, opt = tiny_policy(seed=5, width=256)
        assert checkpoint.load(good, checkpoint_parts(policy, opt), None).step == 1
