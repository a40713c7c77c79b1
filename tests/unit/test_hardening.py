"""Hardening (issue 8), in process: hostile files are refused without running anything, damaged
run files and standards end in exit 0 or one line with exit 2, config values are typed and
bounded, reward messages are bounded, and failed writes (full disk, read-only file system)
leave the last good checkpoint and every row already written intact.

The end-to-end versions (a real tiny run's checkpoints, resume, ports, permissions) are in
tests/integration/test_hardening_runs.py."""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hardening_tools import fuzz, payload_bytes, remount_read_only, small_tmpfs
from hpcnft import checkpoint, determinism, runfile
from hpcnft.cli import UsageError
from hpcnft.config import ConfigError, load_config
from hpcnft.reward_service import (DONE, ERROR, EVAL, MAX_CHUNK, MAX_SIDE, ROLLOUT, SNAPSHOT, RewardServiceError,
                                   validate_header)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP in one process
              pytest.mark.filterwarnings("ignore:Detected pickle protocol")]  # the planted payloads


# =============================================================================================
# (a) (b) (d) checkpoints: metadata, shards and RNG states execute nothing
# =============================================================================================
def _tiny_policy(seed: int = 0, width: int = 32):
    """A Linear layer dressed as hpcnft's Policy (trainable params, old-policy shadow) + AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    policy = types.SimpleNamespace(transformer=model, trainable_names=names, trainable=params,
                                   shadow=[p.detach().clone() for p in params])
    opt = torch.optim.AdamW(params, lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return policy, opt


def _checkpoint(run_dir: str, step: int, seed: int = 0, width: int = 32, keep: int = 2) -> str:
    policy, opt = _tiny_policy(seed, width)
    checkpoint.save(run_dir, step, policy, opt, None, True, 0, determinism.capture_rng_state())
    return checkpoint.commit(run_dir, step, checkpoint.TrainState(step, 4 * step, {}), '{"steps": 3}', keep)


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
    return _checkpoint(str(tmp_path / "run"), 1)


def test_a_clean_checkpoint_passes_and_loads(ckpt):
    assert checkpoint.problems(ckpt) is None
    policy, opt = _tiny_policy(seed=1)
    assert checkpoint.load(ckpt, policy, opt, None).step == 1
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # non-tensor items come back (weights-only)


def test_stock_dcp_runs_a_payload_planted_in_a_shard_item_but_hpcnft_never_does(ckpt, tmp_path):
    """DCP's DefaultLoadPlanner unpickles non-tensor items with weights_only=False: the control
    shows the planted payload is live; hpcnft's problems() and load() refuse it unexecuted."""
    marker = tmp_path / "MARKER"
    _plant_at(*_byte_item(ckpt), payload_bytes(str(marker)))
    why = checkpoint.problems(ckpt)
    assert why and "is not weights-only data" in why and not marker.exists()
    policy, opt = _tiny_policy(seed=1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(ckpt, policy, opt, None)
    assert len(str(e.value).splitlines()) == 1 and ckpt in str(e.value)
    assert not marker.exists()
    # control: the stock reader executes it
    state = checkpoint._state(policy, opt)
    with pytest.raises(BaseException):
        dcp.load(state, checkpoint_id=ckpt)
    assert marker.exists()


def test_a_shard_replaced_by_a_pickle_is_refused(ckpt, tmp_path):
    marker = tmp_path / "MARKER"
    with open(os.path.join(ckpt, "__0_0.distcp"), "wb") as f:
        f.write(payload_bytes(str(marker)))
    assert "shorter than its metadata says" in checkpoint.problems(ckpt)
    policy, opt = _tiny_policy(seed=1)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(ckpt, policy, opt, None)
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


# =============================================================================================
# (c) model folders: safetensors only
# =============================================================================================
@pytest.fixture(scope="module")
def hostile_models(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-models")
    sd3, ps = (shutil.copytree(p, str(base / os.path.basename(p))) for p in tiny_models)
    return sd3, ps, base


def _plant_bin(folder: str, bin_name: str, marker: str, keep_safetensors: bool) -> None:
    torch.save({"weight": torch.zeros(1), "x": __import__("hardening_tools").Payload(marker)},
               os.path.join(folder, bin_name))
    if not keep_safetensors:
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                os.rename(os.path.join(folder, name), os.path.join(folder, name + ".away"))


def _restore(folder: str, bin_name: str) -> None:
    os.remove(os.path.join(folder, bin_name))
    for name in os.listdir(folder):
        if name.endswith(".away"):
            os.rename(os.path.join(folder, name), os.path.join(folder, name[:-len(".away")]))


@pytest.mark.parametrize("keep_safetensors", [False, True], ids=["bin-only", "bin-and-safetensors"])
@pytest.mark.parametrize("part,bin_name", [("transformer", "diffusion_pytorch_model.bin"),
                                           ("text_encoder", "pytorch_model.bin"),
                                           ("pickscore", "pytorch_model.bin")])
def test_model_folder_pickles_are_never_loaded(hostile_models, part, bin_name, keep_safetensors):
    from hpcnft.models import ModelError, load_pickscore, load_sd3_pipeline

    sd3, ps, base = hostile_models
    marker = str(base / f"MARKER-{part}-{keep_safetensors}")
    folder = ps if part == "pickscore" else os.path.join(sd3, part)
    _plant_bin(folder, bin_name, marker, keep_safetensors)
    try:
        load = (lambda: load_pickscore(ps, ps, torch.device("cpu"))) if part == "pickscore" else \
            (lambda: load_sd3_pipeline(sd3, torch.float32, torch.device("cpu")))
        if keep_safetensors:
            load()  # the safetensors weights load; the .bin beside them is ignored
        else:
            with pytest.raises(ModelError) as e:
                load()
            key = "models.pickscore_dir" if part == "pickscore" else "models.sd3_dir"
            assert str(e.value).startswith(f"{key}: cannot load") and len(str(e.value).splitlines()) == 1
            assert "safetensors" in str(e.value)
    finally:
        _restore(folder, bin_name)
    assert not os.path.exists(marker)


# =============================================================================================
# run files and standards from elsewhere: fuzz (a worker subprocess calls hpcnft.cli.main)
# =============================================================================================
def writer_made_run(path: str, steps: int = 4) -> None:
    """A run file laid out by hpcnft's own writer exactly as a run writes it."""
    cfg = load_config("tiny", steps=steps)
    w = runfile.RunFileWriter(path, cfg.to_json(), "test")
    w.set_topology({"world_size": 3, "train_ranks": [0, 1], "reward_ranks": [2], "hosts": ["h"] * 3})
    w.truncate_after(-1)
    w.add_attempt({"started": "now", "from_step": 0, "slurm_job_id": "", "restart_count": 0})
    w.event(0, "start", "local launch, world 3")
    for step in range(1, steps + 1):
        values = {k: step + i / 7 for i, k in enumerate(runfile.PER_STEP_KEYS)}
        values["train/nft_loss"] = float("nan") if step == 2 else 60.0 + step
        if step % 2 == 0:
            values.update({k: 0.1 * step for k in runfile.EVAL_KEYS})
        w.append_metrics(step, values)
        if step % 2 == 0:
            w.write_rng(step, {r: determinism.capture_rng_state() for r in range(3)})
            w.event(step, "checkpoint", f"checkpoints/step_{step:06d}")
    w.event(steps, "done", "finished")
    w.close()


def test_fuzzed_run_files_and_standards_end_in_exit_0_or_one_line(tmp_path):
    src = str(tmp_path / "src" / "run.h5")
    os.makedirs(os.path.dirname(src))
    writer_made_run(src)
    work = tmp_path / "fuzz"
    work.mkdir()
    t0 = time.monotonic()
    result = fuzz(src, str(work), n=400, budget_s=15.0, seed=8)  # ~250 cases on 2 busy cores
    print(f"{len(result['cases'])} fuzz cases in {time.monotonic() - t0:.1f} s")
    assert result["died"] is None, result["died"]
    assert len(result["cases"]) >= 50, f"only {len(result['cases'])} cases in {time.monotonic() - t0:.0f} s"
    assert not result["problems"], "\n\n".join(result["problems"][:5])


def test_a_fifo_is_refused_rather_than_read(tmp_path):
    """A FIFO named run.h5 or *.json would block an open() forever."""
    from hardening_tools import call_cli

    fifo = tmp_path / "run.h5"
    os.mkfifo(fifo)
    std = tmp_path / "std.json"
    os.mkfifo(std)
    for argv in (["show", str(fifo)], ["compare", str(std), str(fifo)], ["compare", str(fifo), str(fifo)]):
        rc, _, err, tb = call_cli(argv)
        assert tb is None and rc == 2 and "not a regular file" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(runfile.RunFileError, match="not a regular file"):
        runfile.RunFileWriter(str(fifo), "{}", "x")


# =============================================================================================
# config values and paths: typed, bounded, never interpreted by a shell
# =============================================================================================
NASTY = "x; touch MARKER 'q' \"dq\" $(touch M2) `touch M3` | cat"


def test_nasty_strings_are_plain_values(tmp_path):
    cfg = load_config("tiny", [f"data.train_prompts={tmp_path}/{NASTY}/p.txt"], run_dir=str(tmp_path / NASTY))
    assert cfg.data.train_prompts == f"{tmp_path}/{NASTY}/p.txt"
    assert cfg.run_dir == str(tmp_path / NASTY)


def test_a_nasty_prompt_path_is_refused_in_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from hpcnft import cli

    monkeypatch.chdir(tmp_path)
    umask = os.umask(0o022)
    try:
        rc = cli.main(["run", "tiny", "--run-dir", NASTY, "--set", f"data.train_prompts=/nonexistent/{NASTY}"])
    finally:
        os.umask(umask)  # `hpcnft run` sets the configured umask for its process
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "data.train_prompts" in err
    assert os.listdir(tmp_path) == []  # no run dir, no MARKER, M2 or M3


@pytest.mark.parametrize("item,message", [
    ("umask=\"999\"", "umask: expected an octal mask"),
    ("umask=77", "umask: expected a string"),
    ("layout.timeout_s=inf", "layout.timeout_s: must be a finite number"),
    ("layout.timeout_s=1e9", "layout.timeout_s: must be <= 86400"),
    ("rollout.height=16384", "rollout.height: must be <= 8192"),
    ("rollout.batch_size=99999", "rollout.batch_size: must be <= 4096"),
    ("run_dir=\"a\\u0000b\"", "run_dir: must not contain NUL"),
    ("data.eval_prompts=\"a\\nb\"", "data.eval_prompts: must not contain NUL or newline"),
    ("steps=\"3; rm -rf /\"", "steps: expected an integer"),
])
def test_config_values_are_typed_and_bounded(item, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("tiny", [item])


def test_a_chunk_the_reward_service_would_refuse_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.batch_size: a chunk of"):
        load_config("sd35m_pickscore", ["rollout.height=8192", "rollout.width=8192", "rollout.batch_size=8"])


def test_umask_is_a_config_value():
    assert load_config("tiny").umask == "077"
    assert load_config("tiny", ["umask=027"]).umask == "027"  # a bare word: the string "027"


def test_requeue_passes_the_job_id_as_one_argument(tmp_path, monkeypatch):
    from hpcnft.preempt import requeue

    fake = tmp_path / "scontrol"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    job = "123; touch MARKER $(touch M2)"
    assert requeue(job, types.SimpleNamespace(info=lambda *a: None)) == f"requeued Slurm job {job}"
    assert json.loads((tmp_path / "argv.json").read_text()) == ["requeue", job]
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "M2").exists()


_LATE_SIGNAL = r"""
import logging, signal, sys
from hpcnft.preempt import PreemptFlag
flag = PreemptFlag("SIGUSR2", True, logging.getLogger("t"))
if sys.argv[1] == "retired":
    flag.retire()
# What CPython does when it shuts down: a signal with a Python handler goes back to its default.
for s in (signal.SIGUSR2, signal.SIGTERM):
    if callable(signal.getsignal(s)):
        signal.signal(s, signal.SIG_DFL)
signal.raise_signal(signal.SIGUSR2)
signal.raise_signal(signal.SIGTERM)
print("finished")
"""


def test_a_retired_preempt_flag_lets_a_late_signal_pass_through_shutdown():
    import signal

    done = subprocess.run([sys.executable, "-c", _LATE_SIGNAL, "retired"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr
    killed = subprocess.run([sys.executable, "-c", _LATE_SIGNAL, "active"], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGUSR2  # what a rank without retire() meets


def test_run_rank_retires_its_preempt_flag_on_every_way_out(tmp_path):
    import signal

    from hpcnft.launch import detect
    from hpcnft.loop import EXIT_BAD_INPUT
    from hpcnft.runner import run_rank

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        cfg = load_config("tiny", [f"models.sd3_dir={tmp_path / 'missing'}"], run_dir=str(tmp_path / "run"))
        from hpcnft.distributed import free_port

        launch = detect({"MASTER_PORT": str(free_port())})  # not 29500, which another job may hold
        assert run_rank(cfg, launch, "tiny") == EXIT_BAD_INPUT  # out early: a missing model folder
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # preempt.handle_sigterm
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_slurms_own_sigterm_leaves_the_requeue_to_slurm():
    from hpcnft.preempt import leave_requeue_to_slurm

    assert leave_requeue_to_slurm("SIGUSR2", "SIGUSR2") is None  # the time-limit warning: requeue
    assert leave_requeue_to_slurm("", "SIGUSR2") is None  # the reward rank's signal: requeue
    assert leave_requeue_to_slurm("SIGTERM", "SIGTERM") is None  # SIGTERM as the configured warning
    why = leave_requeue_to_slurm("SIGTERM", "SIGUSR2")  # scancel, scontrol requeue, time limit
    assert why.startswith("SIGTERM: Slurm is ending the job") and "not requeued" in why


def test_run_file_is_closed_before_the_job_is_requeued(monkeypatch, capsys):
    from hpcnft import runner

    order = []
    writer = types.SimpleNamespace(close=lambda: order.append("close"))

    def fake_requeue(job, log):
        order.append(f"requeue {job}")
        return f"requeued Slurm job {job}" if job == "7" else f"scontrol requeue {job} failed: Invalid job id"
    monkeypatch.setattr(runner, "requeue", fake_requeue)
    runner.close_then_requeue(writer, "7")
    assert order == ["close", "requeue 7"]  # Slurm kills the job's processes right after a requeue
    assert "hpcnft: requeued Slurm job 7" in capsys.readouterr().out
    order.clear()
    runner.close_then_requeue(writer, "")  # not under Slurm, or SIGTERM: close only
    assert order == ["close"]
    runner.close_then_requeue(None, "8")
    assert capsys.readouterr().err.strip() == "hpcnft: scontrol requeue 8 failed: Invalid job id"


@pytest.mark.parametrize("script", ["sd3_pickscore.sbatch", "tiny.sbatch"])
def test_sbatch_scripts_pass_a_nasty_run_dir_and_prompt_path_intact(tmp_path, script):
    fake = tmp_path / "fake_hpcnft"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "RUN_DIR": NASTY,
           "HPCNFT_CMD": str(fake), "HPCNFT_ARGS": f"--steps 1 --set 'data.train_prompts=/p/{NASTY.replace(chr(39), '')}'"}
    r = subprocess.run(["bash", os.path.join(ROOT, "slurm", script)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[2:4] == ["--run-dir", str(work / NASTY)]
    assert argv[4:] == ["--steps", "1", "--set", f"data.train_prompts=/p/{NASTY.replace(chr(39), '')}"]
    assert sorted(os.listdir(work)) == [NASTY]  # the run dir only: no MARKER, M2, M3


# =============================================================================================
# reward service messages
# =============================================================================================
@pytest.mark.parametrize("header", [
    [ROLLOUT, 1, MAX_CHUNK + 1, 64, 64, 0], [ROLLOUT, 1, 1, MAX_SIDE + 1, 64, 0], [EVAL, 1, 1, 64, 1 << 40, 0],
    [ROLLOUT, 1, MAX_CHUNK, MAX_SIDE, MAX_SIDE, 0],  # each bound alone is fine, together 800 GB
    [ROLLOUT, 1, -1, 64, 64, 0], [ROLLOUT, 1, 4, -64, 64, 0], [ROLLOUT, 1, 0, 64, 64, 0], [ROLLOUT, -5, 4, 64, 64, 0],
    [ROLLOUT, 1, 1 << 62, 1 << 62, 1 << 62, 0],
    [0, 1, 4, 64, 64, 0], [99, 1, 4, 64, 64, 0], [-1, 0, 0, 0, 0, 0], [DONE, 3, 7, 0, 0, 0],
    [ROLLOUT, 1, 4, 64, 64], [ROLLOUT, 1, 4, 64, 64, 0, 0],
])
def test_a_malformed_request_is_an_error_before_any_allocation(header):
    with pytest.raises(RewardServiceError, match="malformed request"):
        validate_header(header)


@pytest.mark.parametrize("header", [[ROLLOUT, 1, 8, 512, 512, 0], [EVAL, 0, 4, 64, 64, 0], [DONE, 3, 0, 0, 0, 0],
                                    [DONE, 3, 1, 0, 0, 0], [ERROR, 0, 0, 0, 0, 0], [SNAPSHOT, 2, 0, 0, 0, 0]])
def test_well_formed_requests_pass(header):
    validate_header(header)


# =============================================================================================
# full disks and read-only file systems
# =============================================================================================
def test_a_failed_shard_write_removes_the_partial_and_names_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    good = _checkpoint(run_dir, 1)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", full)
    policy, opt = _tiny_policy(seed=2)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(run_dir, 2, policy, opt, None, True, 0, determinism.capture_rng_state())
    assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2) + ": cannot write the checkpoint")
    assert "No space left on device" in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.latest_usable(run_dir, print) == (1, good)


def test_a_failed_commit_removes_the_partial_and_names_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    good = _checkpoint(run_dir, 1)
    policy, opt = _tiny_policy(seed=2)
    checkpoint.save(run_dir, 2, policy, opt, None, True, 0, determinism.capture_rng_state())

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError, match="step_000002.partial: cannot write the checkpoint"):
        checkpoint.commit(run_dir, 2, checkpoint.TrainState(2, 8, {}), "{}", keep=1)
    monkeypatch.undo()
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.list_checkpoints(run_dir) == [(1, good)] and checkpoint.problems(good) is None
    policy, opt = _tiny_policy(seed=3)
    assert checkpoint.load(good, policy, opt, None).step == 1


def test_run_file_write_failures_name_the_file_and_keep_the_rows(tmp_path, monkeypatch):
    path = str(tmp_path / "run.h5")
    w = runfile.RunFileWriter(path, "{}", "x")
    w.append_metrics(1, {"train/nft_loss": 1.5})
    import h5py

    real_resize = h5py.Dataset.resize

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(h5py.Dataset, "resize", full)
    with pytest.raises(runfile.RunFileError) as e:
        w.append_metrics(2, {"train/nft_loss": 2.5})
    assert str(e.value).startswith(f"{path}: cannot write the run file") and "No space left" in str(e.value)
    monkeypatch.setattr(h5py.Dataset, "resize", real_resize)
    w.close()
    assert runfile.read_run(path).metrics["train/nft_loss"].tolist() == [[1.0, 1.5]]


def test_a_full_tmpfs_fails_run_file_appends_cleanly(tmp_path):
    """Real ENOSPC from a 1200 KiB tmpfs, in a subprocess (an HDF5 crash must not take pytest)."""
    mnt = str(tmp_path / "mnt")
    code = f"""
import sys
from hpcnft.runfile import RunFileWriter, RunFileError, PER_STEP_KEYS, read_run
p = {mnt + '/run.h5'!r}
w = RunFileWriter(p, "{{}}", "x")
done = 0
try:
    for step in range(1, 100000):
        w.append_metrics(step, {{k: float(step) for k in PER_STEP_KEYS}})
        w.event(step, "checkpoint", "x" * 900)
        if step % 50 == 0:
            w.write_rng(step, {{0: bytes(12000)}})
        done = step
except RunFileError as e:
    print("ERROR", e)
try:
    w.close()
except RunFileError as e:
    print("CLOSE", e)
run = read_run(p)
rows = run.metrics["train/nft_loss"]
print("DONE", done, len(rows), int(rows[done - 1, 0]), len(run.events))
"""
    with small_tmpfs(mnt, "1200k"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr  # no h5py release tracebacks
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"ERROR {mnt}/run.h5: cannot write the run file (")
    assert "No space left on device" in lines[0] or "KiB free" in lines[0]
    _, done, n_rows, last_step, n_events = lines[-1].split()
    assert int(done) > 10 and int(n_rows) >= int(done) and int(last_step) == int(done)
    assert int(n_events) >= int(done)


def test_a_full_tmpfs_fails_a_checkpoint_cleanly(tmp_path):
    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "2m"):
        run_dir = os.path.join(mnt, "run")
        good = _checkpoint(run_dir, 1, width=256)  # ~1.3 MB: the second one cannot fit
        with pytest.raises(checkpoint.CheckpointError) as e:
            _checkpoint(run_dir, 2, width=256)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2) + ": cannot write the checkpoint (file "
                                       "system full, ")
        assert len(str(e.value).splitlines()) == 1
        assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
        assert checkpoint.latest_usable(run_dir, print) == (1, good)
        policy, opt = _tiny_policy(seed=5, width=256)
        assert checkpoint.load(good, policy, opt, None).step == 1


def test_a_read_only_run_dir_is_refused_naming_the_path(tmp_path):
    from hpcnft.cli_run import check_run_dir

    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "4m"):
        run_dir = os.path.join(mnt, "run")
        good = _checkpoint(run_dir, 1)
        h5 = os.path.join(run_dir, "run.h5")
        writer_made_run(h5, steps=2)
        remount_read_only(mnt)
        with pytest.raises(UsageError, match="is not writable"):
            check_run_dir(run_dir)
        with pytest.raises(runfile.RunFileError) as e:
            runfile.RunFileWriter(h5, "{}", "x")
        assert str(e.value).startswith(h5) and len(str(e.value).splitlines()) == 1
        with pytest.raises(checkpoint.CheckpointError, match="Read-only file system") as e:
            _checkpoint(run_dir, 2)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2))
        assert checkpoint.problems(good) is None
        assert len(runfile.read_run(h5).metrics["train/nft_loss"]) == 2


def test_a_preempt_signal_is_kept_when_its_log_line_fails():
    import logging
    import signal

    from hpcnft.preempt import PreemptFlag

    class Broken(logging.Handler):
        def handle(self, record):  # a write that fails outright (not through handleError)
            raise RuntimeError("reentrant call inside <_io.BufferedWriter>")

    log = logging.getLogger("hpcnft-test-broken-log")
    log.handlers[:], log.propagate = [Broken()], False
    previous = signal.getsignal(signal.SIGUSR2)
    flag = PreemptFlag("SIGUSR2", False, log)
    try:
        with pytest.raises(RuntimeError, match="reentrant"):
            signal.raise_signal(signal.SIGUSR2)
        assert flag.requested and flag.signal_name == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, previous)
