"""Hardening (issue 8) end to end, on one real tiny run (3 ranks, gloo on CPU) started through
slurm/tiny.sbatch (no Slurm: the script runs `hpcnft run` itself) with a run dir and a prompt
file path full of spaces, quotes, `;`, `$(...)` and backquotes:

* the values arrive intact, nothing is executed, the run completes;
* while it runs, the job's processes listen on the rendezvous port (rank 0) and on gloo's
  ephemeral ports only;
* everything it writes is private to the user (umask 077);
* its checkpoints, with a pickle payload planted in the metadata, a shard or an RNG state, are
  refused by checkpoint.problems() and by a real resume, which skips them with a warning,
  resumes from the clean one and, on a nearly full tmpfs, fails its next checkpoint cleanly:
  exit non-zero naming the path, the last good checkpoint and every row intact;
* its run.h5, damaged, gives exit 0 or one line with exit 2 in show/compare/plot/export.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
from importlib import resources

import psutil
import pytest

from hardening_tools import Payload, free_bytes, fuzz, payload_bytes, small_tmpfs, tmpfs_available
from hpcnft.io import checkpoint
from hpcnft.io.runfile import read_run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Detected pickle protocol")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NASTY = "x; touch MARKER 'q' \"dq\" $(touch M2) `touch M3`"
STEPS = 4


def xargs_quoted(word: str) -> str:
    """One word for the sbatch scripts' HPCNFT_ARGS/HPCNFT_CMD splitting (xargs rules)."""
    return "".join(c if c.isalnum() or c in "/._-=" else "\\" + c for c in word)


def job_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listening(procs: list[psutil.Process]) -> set[tuple]:
    """(pid, name, rank, ip, port) of every LISTEN socket of these processes; rank is the N of a
    rank's process name (hpcnft-rank-N), else None."""
    found = set()
    for p in procs:
        try:
            name = p.name()
            rank = name.rsplit("-", 1)[1] if name.startswith("hpcnft-rank-") else None
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((p.pid, name, rank, c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_models):
    base = tmp_path_factory.mktemp("hardening")
    work = base / "work"
    work.mkdir()
    prompts_dir = base / f"prompts {NASTY}"
    prompts_dir.mkdir()
    prompts = prompts_dir / "train.txt"
    prompts.write_text((resources.files("hpcnft.data") / "tiny_train_prompts.txt").read_text())
    sd3, ps = tiny_models  # the session's tiny models, as model folders (loaded safetensors-only)
    args = ["--steps", str(STEPS), "--set", "checkpoint.every=1", "--set", "checkpoint.keep=4",
            "--set", f"data.train_prompts={prompts}", "--set", f"models.sd3_dir={sd3}",
            "--set", f"models.pickscore_dir={ps}"]
    env = {**os.environ, "RUN_DIR": NASTY, "HPCNFT_CMD": f"{xargs_quoted(sys.executable)} -m hpcnft",
           "HPCNFT_ARGS": " ".join(xargs_quoted(a) for a in args)}
    for k in ("SLURM_JOB_ID", "RANK", "WORLD_SIZE", "MASTER_PORT", "SRUN"):
        env.pop(k, None)
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "slurm", "tiny.sbatch")], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listens: set[tuple] = set()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        listens |= listening(job_tree(proc.pid))
        time.sleep(0.25)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=60)
    return {"base": base, "work": work, "run_dir": str(work / NASTY), "prompts": str(prompts), "args": args,
            "rc": proc.returncode, "out": out, "err": err, "listens": listens}


def test_a_nasty_run_dir_and_prompt_path_work_end_to_end_and_run_nothing(run):
    assert run["rc"] == 0, run["out"][-3000:] + run["err"][-3000:]
    data = read_run(run["run_dir"])
    assert data.metrics["train/nft_loss"][:, 0].tolist() == list(range(1, STEPS + 1))
    assert data.config["data"]["train_prompts"] == run["prompts"]
    assert data.config["run_dir"] == run["run_dir"]
    assert sorted(os.listdir(run["work"])) == [NASTY]  # no MARKER, M2, M3
    assert sorted(os.listdir(run["base"])) == sorted(["work", os.path.basename(os.path.dirname(run["prompts"]))])
    assert "Traceback" not in run["out"] + run["err"]


def test_only_the_rendezvous_port_and_gloo_ports_listen(run):
    """the rendezvous listens on MASTER_PORT of the loopback address only: one socket the spawner
    opens (it, and the fork server, hold it until rank 0 serves the TCPStore on it); each rank's
    gloo pairs listen on ephemeral ports of the address its host name resolves to; nothing else
    listens."""
    assert run["rc"] == 0
    listens = run["listens"]
    assert listens, "saw no listening socket at all"
    host_ips = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)} | {"127.0.0.1"}
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    master = re.search(r"master \S+:(\d+)", open(os.path.join(run["run_dir"], "logs", "rank0.log")).read())
    rendezvous = [s for s in listens if s[4] == int(master.group(1))]
    assert [s[2] for s in rendezvous if s[2] is not None] == ["0"], listens
    assert {s[3] for s in rendezvous} == {"127.0.0.1"}, rendezvous
    for pid, name, rank, ip, port in listens - set(rendezvous):
        assert rank in ("0", "1", "2"), f"{name} (pid {pid}, not a rank) listens on {ip}:{port}"
        assert ip in host_ips, f"rank {rank} listens on {ip}:{port}, not on the host's address"
        assert lo <= port <= hi, f"rank {rank} listens on {ip}:{port}, outside the ephemeral range {lo}-{hi}"
    assert {s[2] for s in listens - set(rendezvous)} == {"0", "1", "2"}  # gloo: every rank has its own


def test_everything_the_run_writes_is_private(run):
    assert run["rc"] == 0
    seen = []
    for dirpath, dirnames, filenames in os.walk(run["run_dir"]):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in filenames)]:
            mode = os.stat(name).st_mode & 0o777
            assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
            seen.append(os.path.relpath(name, run["run_dir"]))
    for expected in ("run.h5", "logs/rank0.log", "logs/rank2.log", "logs/slurm-local.out",
                     "checkpoints/step_000004/__0_0.distcp", "checkpoints/step_000004/rng/rank_2.bin",
                     "samples/step_000001.png"):
        assert expected in seen


# -- planted payloads ---------------------------------------------------------------------------
def _byte_item(path: str):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = checkpoint.SafeReader(path).read_metadata()
    fqn = next(k for k, md in meta.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata))
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    return os.path.join(path, info.relative_path), info.offset, info.length


def plant(ckpt: str, where: str, marker: str) -> None:
    if where == "metadata":
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            f.write(payload_bytes(marker))
    elif where == "metadata-nested":
        meta = checkpoint.SafeReader(ckpt).read_metadata()
        meta.planner_data = {"x": Payload(marker)}
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
    elif where == "shard":
        with open(os.path.join(ckpt, "__0_0.distcp"), "wb") as f:
            f.write(payload_bytes(marker))
    elif where == "shard-item":  # at a non-tensor item, where stock DCP unpickles weights_only=False
        file, offset, length = _byte_item(ckpt)
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(payload_bytes(marker).ljust(length, b"\0"))
    else:  # rng/rank_<r>.bin
        with open(os.path.join(ckpt, "rng", f"rank_{where[-1]}.bin"), "wb") as f:
            f.write(payload_bytes(marker))


@pytest.mark.parametrize("where,why", [
    ("metadata", "unreadable DCP metadata (UnpicklingError)"),
    ("metadata-nested", "unreadable DCP metadata (UnpicklingError)"),
    ("shard", "shard __0_0.distcp is shorter than its metadata says"),
    ("shard-item", "is not weights-only data (UnpicklingError)"),
    ("rng-0", "rng/rank_0.bin: refusing to load posix.system"),
    ("rng-2", "rng/rank_2.bin: refusing to load posix.system"),
])
def test_planted_payloads_are_refused_by_problems(run, tmp_path, where, why):
    assert run["rc"] == 0
    ckpt = shutil.copytree(checkpoint.step_dir(run["run_dir"], 1), str(tmp_path / "step_000001"))
    assert checkpoint.problems(ckpt) is None
    marker = str(tmp_path / "MARKER")
    plant(ckpt, where, marker)
    assert why in checkpoint.problems(ckpt)
    assert not os.path.exists(marker)


def test_resume_skips_planted_checkpoints_and_a_full_disk_fails_the_next_one_cleanly(run, tmp_path):
    """Checkpoints 4, 3, 2 carry payloads (metadata, shard item, RNG state), 1 is clean. The
    resume to step 5 (past the run's 4: a run at its end is finished before any rank starts)
    warns about and skips 4..2, resumes from 1 bit for bit, then finds its file system full when
    it checkpoints step 2: exit 1 naming the partial checkpoint, no .partial left, checkpoint 1
    still usable, every row written so far readable. (Where no tmpfs can be mounted, the resume
    runs on the ordinary disk and completes.)"""
    assert run["rc"] == 0
    original = read_run(run["run_dir"]).metrics["train/nft_loss"]
    markers = {w: str(tmp_path / f"MARKER-{w}") for w in ("metadata", "shard-item", "rng-0")}
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run["run_dir"]) for f in fs)
    mnt = str(tmp_path / "mnt")
    full_disk = tmpfs_available(mnt)
    with small_tmpfs(mnt, f"{size // 1024 + 1024}k") if full_disk else contextlib.nullcontext():
        run_dir = shutil.copytree(run["run_dir"], os.path.join(mnt, NASTY))
        for step, where in ((4, "metadata"), (3, "shard-item"), (2, "rng-0")):
            plant(checkpoint.step_dir(run_dir, step), where, markers[where])
        if full_disk:
            with open(os.path.join(mnt, "filler"), "wb") as f:  # leave ~440 KiB: less than the shards
                f.write(b"\0" * max(0, free_bytes(mnt) - (440 << 10)))
        r = subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--run-dir", run_dir,
                            *[a if a != str(STEPS) else str(STEPS + 1) for a in run["args"]]],
                           cwd=run["work"], capture_output=True, text=True, timeout=600)
        err = r.stderr
        assert "Traceback" not in err and "Traceback" not in r.stdout and "UserWarning" not in err
        log = open(os.path.join(run_dir, "logs", "rank0.log")).read()
        for step, why in ((4, "unreadable DCP metadata"), (3, "is not weights-only data"), (2, "rng/rank_0.bin")):
            assert f"skipping checkpoint {checkpoint.step_dir(run_dir, step)}: " in log and why in log
        data = read_run(run_dir)
        assert any(e["kind"] == "warning" and "skipping checkpoint" in e["text"] for e in data.events)
        rows = data.metrics["train/nft_loss"]
        if full_disk:
            assert r.returncode == 1, r.stdout[-2000:] + err[-3000:]
            partial = checkpoint.partial_dir(run_dir, 2)
            assert f"{partial}: cannot write the checkpoint (file system full" in err, err[-3000:]
            assert not os.path.exists(partial)
            assert checkpoint.problems(checkpoint.step_dir(run_dir, 1)) is None
            assert rows.tolist() == original[:2].tolist()  # step 1 kept, step 2 recomputed bit for bit
        else:
            assert r.returncode == 0, r.stdout[-2000:] + err[-3000:]
            assert rows[:STEPS].tolist() == original.tolist() and len(rows) == STEPS + 1
    assert not any(os.path.exists(m) for m in markers.values())
    assert sorted(os.listdir(run["work"])) == [NASTY]


# -- the real run.h5, damaged -------------------------------------------------------------------
def test_fuzzed_copies_of_the_real_run_file(run, tmp_path):
    assert run["rc"] == 0
    result = fuzz(os.path.join(run["run_dir"], "run.h5"), str(tmp_path), n=40, seed=11)
    assert result["died"] is None, result["died"]
    assert len(result["cases"]) == 40
    assert not result["problems"], "\n\n".join(result["problems"][:5])


@pytest.mark.parametrize("damage,command", [("truncate", "show"), ("flip-superblock", "compare"),
                                            ("other-schema", "plot"), ("fifo", "export-metrics")])
def test_damaged_run_files_through_real_processes(run, tmp_path, damage, command):
    import h5py
    import numpy as np

    good = os.path.join(run["run_dir"], "run.h5")
    bad = str(tmp_path / "run.h5")
    data = open(good, "rb").read()
    if damage == "truncate":
        open(bad, "wb").write(data[:len(data) // 3])
    elif damage == "flip-superblock":
        open(bad, "wb").write(data[:20] + bytes([data[20] ^ 0x10]) + data[21:])
    elif damage == "fifo":
        os.mkfifo(bad)
    else:
        with h5py.File(bad, "w") as f:
            f.attrs["schema"] = 7
            f["metrics/x"] = np.zeros((2, 2))
    argv = {"show": ["show", bad], "compare": ["compare", good, bad],
            "plot": ["plot", bad, "-o", str(tmp_path / "p.png")],
            "export-metrics": ["export-metrics", bad, "--csv", str(tmp_path / "m.csv")]}[command]
    r = subprocess.run([sys.executable, "-m", "hpcnft", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and bad in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
