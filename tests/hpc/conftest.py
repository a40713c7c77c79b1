"""Fixtures for the hpc tests: a real Slurm cluster (tools/local_slurm.sh), Open MPI, PMIx.

Every test under tests/hpc has the `hpc` marker (tests/conftest.py). Tests take the session fixture
`slurm_cluster`, which skips them with the reason when no cluster answers, and use the helpers
below (also available as methods of the fixture's value). The session's HPCNFT_CACHE is the
fixture `hpcnft_cache` of tests/conftest.py.

    job_id, state = sbatch_and_wait(script, env={"RECIPE": "tiny"}, args=["--gpus-per-task=0"],
                                    cwd=tmp_path, timeout=180)
    assert state == "COMPLETED", job_output(job_id)

Environment knobs:
  HPCNFT_HPC_START=1    start the cluster with tools/local_slurm.sh when it is down (and stop it
                        again at the end of the session); default: skip
  HPCNFT_REQUIRE_HPC=1  fail instead of skipping when no cluster is up (for CI, where a
                        silently skipped hpc suite would hide a broken setup)
  HPCNFT_SLURM_DIR      the cluster directory for HPCNFT_HPC_START (default /tmp/hpcnft-slurm)
  HPCNFT_MULTINODE_SLURM_DIR  the multi-node cluster's directory (default /tmp/hpcnft-slurm-mn)

The multi-node tests use a second cluster of three nodes, each a network namespace with its own
hostname (`HPCNFT_SLURM_NODES=3 tools/local_slurm.sh`, on the ports of MULTINODE_KNOBS, beside
the default one; .ci/run starts both). The module fixture `multinode_cluster` points SLURM_CONF
at it for the tests of its module and restores it afterwards.

sbatch_and_wait polls squeue/scontrol/sacct every 0.5 s rather than using `sbatch --wait`, which
returns up to tens of seconds late (hpc_notes.md §3.6).
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "tools" / "local_slurm.sh"
HERE = Path(__file__).resolve().parent

# states after which a job never runs again (REQUEUED/PREEMPTED jobs go back to PENDING)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
POLL_S = 0.5


# ------------------------------------------------------------------------------------ helpers

def _run(cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def cluster_problem() -> str | None:
    """None when the controller answers and a node is usable, else the reason why not."""
    hint = "start one with: bash tools/local_slurm.sh start"
    if shutil.which("sinfo") is None or shutil.which("scontrol") is None:
        return f"Slurm client tools are not installed ({hint})"
    try:
        # `scontrol ping` answers at once when slurmctld is down; sinfo would retry for ~10 s
        p = _run(["scontrol", "ping"], timeout=15)
        if p.returncode != 0 or " is UP" not in p.stdout:
            first = (p.stdout or p.stderr).strip().splitlines()[:1]
            return f"no Slurm controller answers ({first[0] if first else 'scontrol ping failed'}; {hint})"
        p = _run(["sinfo", "-h", "-o", "%T"], timeout=15)
    except subprocess.TimeoutExpired:
        return f"the Slurm controller did not answer within 15 s ({hint})"
    if p.returncode != 0:
        return f"sinfo failed: {(p.stderr or p.stdout).strip()} ({hint})"
    states = {s.strip().rstrip("*~#$@^-") for s in p.stdout.split()}
    if not states & {"idle", "mixed", "allocated", "completing"}:
        return f"no usable Slurm node (states: {', '.join(sorted(states)) or 'none'})"
    return None


def _squeue_state(job_id: str) -> str | None:
    """The job's state while squeue lists it; None once it is gone or finished."""
    p = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if p.returncode != 0:
        if "Invalid job id" in p.stderr:
            return None
        raise RuntimeError(f"squeue failed: {p.stderr.strip()}")
    lines = p.stdout.split()
    return lines[0].strip() if lines else None


def cluster_queue() -> str:
    """Every job squeue lists with its state and reason, and every node's state: what a job
    that waits too long waits behind."""
    try:
        jobs = _run(["squeue", "-h", "-o", "%i %T %r %N"]).stdout.strip() or "(none)"
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %T %E"]).stdout.strip() or "(none)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(squeue/sinfo failed: {e})"
    return f"jobs (id state reason nodes):\n{jobs}\nnodes (name state reason):\n{nodes}"


def _scontrol_fields(job_id: str) -> dict[str, str]:
    p = _run(["scontrol", "show", "job", "-o", job_id])
    if p.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", p.stdout))


def _sacct_state(job_id: str) -> str | None:
    p = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if p.returncode != 0 or not p.stdout.strip():
        return None
    return p.stdout.strip().splitlines()[-1].split()[0]  # "CANCELLED by 0" -> CANCELLED


def job_state(job_id: str) -> str:
    """Current state of a job: PENDING, RUNNING, COMPLETED, FAILED, ... ("UNKNOWN" if no one knows)."""
    state = _scontrol_fields(job_id).get("JobState")   # knows jobs for MinJobAge after the end
    if not state:
        state = _sacct_state(job_id)                    # accounting knows them for good
    return state or "UNKNOWN"


def job_output(job_id: str, limit: int = 20000) -> str:
    """The tail of the job's stdout file (for assertion messages)."""
    path = _scontrol_fields(job_id).get("StdOut")
    if not path:
        return f"(no output file known for job {job_id})"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return text[-limit:]


def submit(script: str | os.PathLike, env: Mapping[str, str] | None = None,
           args: Iterable[str] = (), cwd: str | os.PathLike | None = None) -> str:
    """sbatch SCRIPT and return the job id. SCRIPT is a path, or the text of a script (a string
    starting with "#!"). The job gets this process's environment plus ENV (--export=ALL, so
    values may hold commas), with the repository root first on PYTHONPATH."""
    cwd = Path(cwd) if cwd is not None else Path(tempfile.mkdtemp(prefix="hpcnft-job-"))
    if isinstance(script, str) and script.startswith("#!"):
        fd, name = tempfile.mkstemp(prefix="job-", suffix=".sbatch", dir=cwd)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        script = name
    job_env = dict(os.environ)
    job_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([job_env["PYTHONPATH"]] if job_env.get("PYTHONPATH") else []))
    job_env.update(env or {})
    p = _run(["sbatch", "--parsable", "--export=ALL", *args, str(script)], cwd=cwd, env=job_env)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} {script} failed: {p.stderr.strip()}")
    return p.stdout.strip().split(";")[0]


def wait(job_id: str, timeout: float = 180) -> str:
    """Wait until the job has ended for good (requeues included); returns its final state.
    On timeout the job is cancelled and TimeoutError raised."""
    deadline = time.monotonic() + timeout
    state = None
    while True:
        try:
            state = _squeue_state(job_id)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # a busy controller: ask again
            state = f"unknown ({e})"
        if state is None:
            break
        if time.monotonic() > deadline:
            queue = cluster_queue()  # before the cancel: why it waited, and behind what
            _run(["scancel", job_id])
            raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s (cancelled); "
                               f"{queue}\noutput:\n{job_output(job_id)}")
        time.sleep(POLL_S)
    # squeue no longer lists it: the final state is in scontrol (MinJobAge) or, a moment
    # later, in accounting
    for _ in range(60):
        state = job_state(job_id)
        if state in TERMINAL:
            return state
        time.sleep(POLL_S)
    return state


def wait_for_state(job_id: str, states: Iterable[str], timeout: float = 60) -> str:
    """Poll until the job is in one of STATES (e.g. RUNNING); returns it or raises TimeoutError."""
    want = set(states)
    deadline = time.monotonic() + timeout
    while True:
        state = job_state(job_id)
        if state in want:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} is {state}, not {sorted(want)}, after {timeout:.0f} s")
        time.sleep(POLL_S)


def sbatch_and_wait(script: str | os.PathLike, env: Mapping[str, str] | None = None,
                    args: Iterable[str] = (), timeout: float = 180,
                    cwd: str | os.PathLike | None = None) -> tuple[str, str]:
    """Submit SCRIPT (see submit) and wait for its end (see wait): returns (job_id, state)."""
    job_id = submit(script, env=env, args=args, cwd=cwd)
    return job_id, wait(job_id, timeout=timeout)


class SlurmCluster:
    """What the `slurm_cluster` fixture yields: the helpers above as methods."""

    submit = staticmethod(submit)
    wait = staticmethod(wait)
    wait_for_state = staticmethod(wait_for_state)
    sbatch_and_wait = staticmethod(sbatch_and_wait)
    job_state = staticmethod(job_state)
    job_output = staticmethod(job_output)

    @staticmethod
    def scancel(job_id: str, *args: str) -> None:
        _run(["scancel", *args, job_id])

    @staticmethod
    def has_mpi() -> bool:
        return shutil.which("mpirun") is not None


# ------------------------------------------------------------------------------ short runs
# The interrupted runs (requeue, preemption, a lost node): a cheaper step (4 samples), a
# checkpoint every step, no periodic eval, no PNG grids; 20 steps, so that a run is still going
# when it is interrupted at step 2. Their uninterrupted reference is one session-wide run.
SHORT_SET = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "eval.every=0",
             "checkpoint.every=1", "logging.sample_grid_every=0"]
SHORT_STEPS = 20


def start_local_run(run_dir, steps: int, overrides: list[str] = ()) -> subprocess.Popen:
    """Start `python -m hpcnft run tiny --steps N [--set ...] --run-dir RUN_DIR` through the local
    spawner (no Slurm variables, even inside an allocation); `finish_local_run` waits for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    sets = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", str(steps), *sets, "--run-dir",
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    proc.run_dir = str(run_dir)
    return proc


def stop_local_run(proc: subprocess.Popen) -> None:
    """Kill a run `start_local_run` started that is still going, ranks and all (its session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def finish_local_run(proc: subprocess.Popen) -> str:
    """The run dir of a run `start_local_run` started, once it has finished; fails the test on a
    non-zero exit."""
    out, _ = proc.communicate(timeout=720)
    if proc.returncode != 0:
        pytest.fail(f"reference run failed ({proc.returncode}):\n{out[-6000:]}")
    return proc.run_dir


def local_run(run_dir, steps: int, overrides: list[str] = ()) -> str:
    return finish_local_run(start_local_run(run_dir, steps, overrides))


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def short_run(hpcnft_cache, tmp_path_factory) -> str:
    """The uninterrupted SHORT_STEPS run of SHORT_SET, through the local spawner."""
    return local_run(tmp_path_factory.mktemp("short-run") / "run", SHORT_STEPS, SHORT_SET)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running cluster (skips the test with the reason when there is none)."""
    problem = cluster_problem()
    started = False
    slurm_dir = os.environ.get("HPCNFT_SLURM_DIR", "/tmp/hpcnft-slurm")
    if problem and os.environ.get("HPCNFT_HPC_START") == "1":
        p = _run(["bash", str(LOCAL_SLURM), slurm_dir, "start"], timeout=600)
        if p.returncode != 0:
            pytest.fail(f"tools/local_slurm.sh start failed:\n{p.stderr[-3000:]}")
        started = True
        problem = cluster_problem()
    if problem:
        if os.environ.get("HPCNFT_REQUIRE_HPC") == "1":
            pytest.fail(f"HPCNFT_REQUIRE_HPC=1 but {problem}")
        pytest.skip(problem)
    try:
        yield SlurmCluster()
    finally:
        if started:
            _run(["bash", str(LOCAL_SLURM), slurm_dir, "stop"], timeout=120)


MULTINODE_NODES = 3
# the multi-node cluster's knobs for tools/local_slurm.sh: its own ports, no /etc/slurm link
MULTINODE_KNOBS = {"HPCNFT_SLURM_NODES": str(MULTINODE_NODES), "SLURM_CTLD_PORT": "7817", "SLURM_SLURMD_PORT": "7818",
                   "SLURM_DBD_PORT": "7819", "SLURM_MYSQL_PORT": "7830", "LINK_ETC": "0", "SLURMD_TIMEOUT": "20"}


def multinode_problem(nodes: int = MULTINODE_NODES) -> str | None:
    """None when the cluster SLURM_CONF names answers with NODES usable nodes, else why not."""
    problem = cluster_problem()
    if problem:
        return problem
    p = _run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
    usable = {line.split()[0] for line in p.stdout.splitlines()
              if line.split()[1].rstrip("*~#$@^-") in ("idle", "mixed", "allocated", "completing")}
    if len(usable) < nodes:
        return f"the multi-node cluster has {len(usable)} usable node(s), not {nodes}"
    return None


@pytest.fixture(scope="module")
def multinode_cluster():
    """The multi-node cluster (skips, or fails under HPCNFT_REQUIRE_HPC=1, when it is not up; starts
    it under HPCNFT_HPC_START=1). SLURM_CONF points at it while the module's tests run."""
    slurm_dir = Path(os.environ.get("HPCNFT_MULTINODE_SLURM_DIR", "/tmp/hpcnft-slurm-mn"))
    knobs = dict(os.environ, **MULTINODE_KNOBS)
    patch = pytest.MonkeyPatch()
    patch.setenv("SLURM_CONF", str(slurm_dir / "etc" / "slurm.conf"))
    hint = (f"start it with: {' '.join(f'{k}={v}' for k, v in MULTINODE_KNOBS.items())} "
            f"bash tools/local_slurm.sh {slurm_dir} start")
    problem = multinode_problem() if (slurm_dir / "etc" / "slurm.conf").exists() else f"no cluster in {slurm_dir}"
    started = False
    if problem and os.environ.get("HPCNFT_HPC_START") == "1":
        p = _run(["bash", str(LOCAL_SLURM), str(slurm_dir), "start"], timeout=600, env=knobs)
        if p.returncode != 0:
            patch.undo()
            pytest.fail(f"the multi-node cluster did not start:\n{p.stderr[-3000:]}")
        started = True
        problem = multinode_problem()
    if problem:
        patch.undo()
        if os.environ.get("HPCNFT_REQUIRE_HPC") == "1":
            pytest.fail(f"HPCNFT_REQUIRE_HPC=1 but {problem} ({hint})")
        pytest.skip(f"{problem} ({hint})")
    try:
        yield SlurmCluster()
    finally:
        patch.undo()
        if started:
            _run(["bash", str(LOCAL_SLURM), str(slurm_dir), "stop"], timeout=120, env=knobs)


@pytest.fixture(scope="session")
def mpi_available(slurm_cluster):
    """Open MPI's mpirun and mpi4py, as the MPI launch tests need them."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (tools/local_slurm.sh installs Open MPI)")
    try:
        importlib.import_module("mpi4py")
    except ImportError:
        pytest.skip("mpi4py not installed")
    return True
