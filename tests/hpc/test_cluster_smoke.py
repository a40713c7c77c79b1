"""The launch paths on a real Slurm cluster: 3 ranks do a gloo all_reduce with rank, world size
and master taken from hpcnft.distributed.detect.detect(os.environ), under plain srun, srun --mpi=pmix and
mpirun inside sbatch (where every rank sees SLURM_PROCID=0); MPI's own rank/size check
detect(). Then slurm/sd3_pickscore.sbatch with the documented CPU override and
slurm/tiny.sbatch through a requeue, each with a stand-in for `hpcnft` (HPCNFT_CMD)."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = shlex.quote(sys.executable)

SMOKE = '''"""all_reduce over gloo; rank/world/master from hpcnft.distributed.detect.detect (stand-in for hpcnft)."""
import datetime, json, os, subprocess, sys, time
from dataclasses import asdict
from pathlib import Path

from hpcnft.distributed.detect import detect

info = detect(os.environ)
truth = {}
if info.launcher in ("openmpi", "pmix"):
    from mpi4py import MPI
    truth = {"mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size()}

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=info.init_method, rank=info.rank,
                        world_size=info.world_size, timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
gathered = [None] * info.world_size
dist.all_gather_object(gathered, info.rank)
dist.destroy_process_group()
keys = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
        "PMIX_RANK", "OMP_NUM_THREADS")
rec = asdict(info) | truth | {"allreduce": t.item(), "gathered": gathered, "argv": sys.argv[1:],
                              "env": {k: os.environ.get(k) for k in keys}}
out = Path(os.environ["SMOKE_OUT"])
out.mkdir(parents=True, exist_ok=True)
(out / f"r{info.rank}-a{info.restart_count}.json").write_text(json.dumps(rec))
print("smoke " + info.describe(), flush=True)
if os.environ.get("SMOKE_REQUEUE") == "1" and info.restart_count == 0:
    if info.rank == 0:  # once every rank has written its record: the requeue kills them all
        deadline = time.monotonic() + 120
        while len(list(out.glob("r*-a0.json"))) < info.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    time.sleep(300)  # the requeue kills this attempt
sys.exit(0 if t.item() == info.world_size * (info.world_size + 1) / 2 else 1)
'''

JOB = """#!/bin/bash
#SBATCH --ntasks=3
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
#SBATCH --output=smoke-%j.out
set -eu
{launch} {py} -m hpcnft_smoke
"""

LAUNCHES = {
    "srun": ("srun --kill-on-bad-exit=1 --mpi=none", "slurm"),
    "srun-pmix": ("srun --kill-on-bad-exit=1 --mpi=pmix -n 3", "pmix"),
    "mpirun": ("mpirun --allow-run-as-root -np 3", "openmpi"),
}


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "hpcnft_smoke.py").write_text(SMOKE)
    return tmp_path


def records(out: Path) -> dict[tuple[int, int], dict]:
    recs = {}
    for p in sorted(out.glob("r*-a*.json")):
        rec = json.loads(p.read_text())
        recs[(rec["rank"], rec["restart_count"])] = rec
    return recs


def check_world(recs: list[dict], launcher: str, job_id: str) -> None:
    assert sorted(r["rank"] for r in recs) == [0, 1, 2]
    for r in recs:
        assert r["launcher"] == launcher, r
        assert r["world_size"] == 3 and r["allreduce"] == 6.0 and r["gathered"] == [0, 1, 2], r
        assert r["job_id"] == job_id
    assert len({(r["master_addr"], r["master_port"]) for r in recs}) == 1


@pytest.mark.parametrize("how", list(LAUNCHES))
def test_launch_paths(slurm_cluster, workdir, how, request):
    launch, launcher = LAUNCHES[how]
    if how != "srun":
        request.getfixturevalue("mpi_available")
    out = workdir / "out"
    job_id, state = slurm_cluster.sbatch_and_wait(JOB.format(launch=launch, py=PY), cwd=workdir,
                                                  env={"SMOKE_OUT": str(out)}, timeout=240)
    assert state == "COMPLETED", slurm_cluster.job_output(job_id)
    recs = list(records(out).values())
    check_world(recs, launcher, job_id)
    for r in recs:
        if how == "mpirun":
            # the case that rank detection must not get wrong: all ranks inherit the batch
            # step's SLURM_PROCID=0 and there is no step of their own
            assert r["env"]["SLURM_PROCID"] == "0" and r["env"]["SLURM_LOCALID"] == "0"
            assert r["env"]["SLURM_STEP_ID"] is None
            assert r["env"]["OMPI_COMM_WORLD_RANK"] == str(r["rank"])
        else:
            assert r["env"]["SLURM_PROCID"] == str(r["rank"]) and r["env"]["SLURM_STEP_ID"] is not None
        if how in ("mpirun", "srun-pmix"):
            assert (r["mpi_rank"], r["mpi_size"]) == (r["rank"], 3)
        assert r["local_rank"] == r["rank"]  # one node


def test_sd3_sbatch_with_cpu_override(slurm_cluster, workdir):
    """The documented CPU route: sbatch --gpus-per-task=0 --export=ALL,RECIPE=...,RUN_DIR=...,..."""
    out, run_dir = workdir / "out", workdir / "run dir"
    job_id, state = slurm_cluster.sbatch_and_wait(
        ROOT / "slurm" / "sd3_pickscore.sbatch", cwd=workdir, timeout=240,
        env={"SMOKE_OUT": str(out), "HPCNFT_CMD": f"{PY} -m hpcnft_smoke"},
        args=["--gpus-per-task=0", f"--export=ALL,RECIPE=tiny,RUN_DIR={run_dir},HPCNFT_ARGS=--steps 3"])
    log = slurm_cluster.job_output(job_id)
    assert state == "COMPLETED", log
    recs = list(records(out).values())
    check_world(recs, "slurm", job_id)
    for r in recs:
        assert r["argv"] == ["run", "tiny", "--run-dir", str(run_dir), "--steps", "3"]
        assert r["env"]["OMP_NUM_THREADS"] == "2"  # --cpus-per-task=2 reached the step
    assert (workdir / f"hpcnft-{job_id}.out").read_text() == log
    copy = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "smoke slurm: rank 2/3" in copy and "exit 0" in copy


def test_tiny_sbatch_requeue_keeps_run_dir(slurm_cluster, workdir):
    """Attempt 1 requeues itself (scontrol requeue); attempt 2 must get the same RUN_DIR."""
    out = workdir / "out"
    job_id, state = slurm_cluster.sbatch_and_wait(
        ROOT / "slurm" / "tiny.sbatch", cwd=workdir, timeout=240,
        env={"SMOKE_OUT": str(out), "SMOKE_REQUEUE": "1", "HPCNFT_CMD": f"{PY} -m hpcnft_smoke",
             "HPCNFT_ARGS": "--steps 2"})
    log = slurm_cluster.job_output(job_id)
    assert state == "COMPLETED", log
    recs = records(out)
    assert sorted(recs) == [(r, a) for r in range(3) for a in (0, 1)], sorted(recs)
    for attempt in (0, 1):
        check_world([recs[(r, attempt)] for r in range(3)], "slurm", job_id)
    run_dirs = {rec["argv"][3] for rec in recs.values()}
    assert run_dirs == {str(workdir / "runs" / job_id)}
    for text in (log, (workdir / "runs" / job_id / "logs" / f"slurm-{job_id}.out").read_text()):
        assert "attempt 1 " in text and "attempt 2 " in text, text
