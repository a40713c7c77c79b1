"""Issue 6 acceptance: the real tiny job through every launcher on a real Slurm cluster, each run
compared bit for bit (every non-perf metric series) with a run of the local spawner.

  1  sbatch slurm/sd3_pickscore.sbatch with the CPU override (--gpus-per-task=0)
  2  sbatch slurm/tiny.sbatch
  3  srun --mpi=pmix -n 3 (directly, srun makes its own allocation)
  4  mpirun without Slurm, and mpirun inside an sbatch allocation (every rank: SLURM_PROCID=0)
  5  hpcnft submit --cluster slurm / --cluster local (submitit)
  6  scontrol requeue of a running job: requeued, resumed, identical to an uninterrupted run
  7  the time-limit signal (--signal=USR2@150): checkpoint, scontrol requeue, exit 75, resume
  8  submitit: a SIGKILLed rank makes the job fail (no hang)
  9  submitit: job._interrupt() (preemption) requeues through submitit; resumed run identical

Test 7, how the signal is made to fire mid-run: Slurm sends the --signal warning from
slurmctld's periodic time-limit check (every ~30 s), as soon as `now + warn_time + 30 s >=
end time`, so with a fixed --time the signal comes anywhere in a 30 s window, possibly before
the ranks have installed their handlers (SIGUSR2's default action kills a process). The job is
therefore submitted with --time=00:10:00 --signal=USR2@150 (far from the limit); once every rank
has logged its start (after installing its handlers), `scontrol update JobId=J TimeLimit=M`
shortens the limit to leave 90-150 s: Slurm's next periodic check (<= ~30 s later) sends
SIGUSR2 to the ranks. As soon as a rank logs the signal, the limit goes back to 10 minutes, so
the requeued attempt is not signalled again. Everything after the signal (checkpoint,
`scontrol requeue` by rank 0, exit 75, the requeue, the resume) is the real path.

Reference runs (local spawner, module fixtures): `hpcnft run tiny --steps 3` for tests 1-5;
one cheaper 40-step run (SHORT_SET) for tests 6, 7 and 9. The tiny models are built once per
session into HPCNFT_CACHE (fixture hpcnft_cache), in this process before any job starts.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import importlib.util

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_hpc_helpers():
    """tests/hpc/conftest.py's helpers, loaded under their own name (several conftest.py files
    share the module name `conftest`, so `from conftest import ...` is not reliable)."""
    spec = importlib.util.spec_from_file_location("hpcnft_hpc_helpers", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_hpc = _load_hpc_helpers()
TERMINAL, _run, _scontrol_fields = _hpc.TERMINAL, _hpc._run, _hpc._scontrol_fields
job_output, job_state, wait = _hpc.job_output, _hpc.job_state, _hpc.wait
from jobs import TINY_STEPS, assert_same_metrics  # noqa: E402  (tests/jobs.py)

from hpcnft.io.runfile import read_run  # noqa: E402

PY = sys.executable
HPCNFT_CMD = f"{shlex.quote(PY)} -m hpcnft"
SD3_SBATCH = ROOT / "slurm" / "sd3_pickscore.sbatch"
TINY_SBATCH = ROOT / "slurm" / "tiny.sbatch"

# wall-clock bounds: generous, because the machine has 2 cores and may be shared
RUN_TIMEOUT = 480          # one 3-step tiny run through any launcher
LONG_TIMEOUT = 720         # a run with a requeue in it

# tests 1-5: `hpcnft run tiny --steps 3`
STEPS3 = TINY_STEPS
# tests 6-9: the cheaper steps of SHORT_SET (conftest); 6, 8 and 9 run SHORT_STEPS (20) and are
# compared with the session's `short_run`. Test 7 runs LONG_STEPS (80): its run must still be going
# when Slurm's periodic check (<= ~30 s after the time-limit update, made once the ranks are up)
# sends the signal; a tiny step takes ~0.45 s on one CPU, so 40 steps could end first.
SHORT_SET, SHORT_STEPS = _hpc.SHORT_SET, _hpc.SHORT_STEPS
LONG_STEPS = 80
# test 7 without periodic checkpoints, so the signal path writes the one it resumes from
# (checkpoint.every is one of the keys the project declares result-neutral: RESUME_MUTABLE_KEYS)
SIGNAL_SET = [o for o in SHORT_SET if not o.startswith("checkpoint.every=")] + ["checkpoint.every=0"]

STEP_RE = re.compile(r"^step (\d+)/(\d+) \|", re.M)


def set_args(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def hpcnft_args(steps: int, overrides: list[str] = ()) -> str:
    """HPCNFT_ARGS for the sbatch scripts."""
    return " ".join(["--steps", str(steps), *set_args(list(overrides))])


# ------------------------------------------------------------------------------------ helpers

def base_env(drop_slurm: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if drop_slurm:  # a run "without Slurm" even when pytest itself runs inside an allocation
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL a process this test started, and its descendants, by pid."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def run_cmd(cmd: list[str], timeout: float, cwd=None, env=None, on_timeout=None) -> tuple[int, str]:
    """Run CMD (stdout+stderr together); on timeout kill it and its children, then fail."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=cwd, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        if on_timeout:
            on_timeout()
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"{shlex.join(map(str, cmd))} still running after {timeout:.0f} s (killed); output:\n"
                    f"{out[-8000:]}")
    return proc.returncode, out


def diagnose(run_dir, job_id: str | None = None, lines: int = 25) -> str:
    """What a failing assertion should show: the job's output and the tail of each rank log."""
    parts = []
    if job_id:
        parts.append(f"--- job {job_id} ({job_state(job_id)}) output:\n{job_output(job_id, 8000)}")
    logs = Path(run_dir) / "logs"
    for p in sorted(logs.glob("rank*.log")) if logs.is_dir() else []:
        tail = p.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {p}:\n" + "\n".join(tail))
    return "\n".join(parts) or f"(nothing in {run_dir})"


def last_step(text: str) -> int:
    steps = STEP_RE.findall(text or "")
    return int(steps[-1][0]) if steps else 0


def wait_until(what: str, cond, timeout: float, detail=lambda: "", poll: float = 0.5):
    """Poll cond() until it returns something truthy; fail with `detail()` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{detail()}")
        time.sleep(poll)


def wait_for_job_step(job_id: str, step: int, run_dir, timeout: float = RUN_TIMEOUT) -> int:
    """Wait until the job's output shows `step` (the job must not end first)."""
    def cond():
        got = last_step(job_output(job_id))
        if got >= step:
            return got
        if job_state(job_id) in TERMINAL:
            pytest.fail(f"job {job_id} ended before step {step}\n{diagnose(run_dir, job_id)}")
        return None

    return wait_until(f"step {step} of job {job_id}", cond, timeout, lambda: diagnose(run_dir, job_id))


def sacct_states(job_id: str) -> list[str]:
    """Every attempt's state, requeued ones included (sacct --duplicates)."""
    p = _run(["sacct", "-n", "-X", "-P", "--duplicates", "-j", job_id, "-o", "State"])
    return [line.split()[0] for line in p.stdout.split("\n") if line.strip()]


def check_attempts(run_dir, restarts: list[int], job_id: str | None, launcher: str) -> None:
    data = read_run(str(run_dir))
    got = [int(a["restart_count"]) for a in data.attempts]
    assert got == restarts, f"attempts {data.attempts}"
    for a in data.attempts:
        assert str(a["slurm_job_id"]) == (job_id or ""), a
        assert a["launcher"] == launcher, a
    assert data.topology["launcher"] == launcher, data.topology


def local_reference(tmp_path_factory, name: str, steps: int, overrides: list[str] = ()) -> str:
    """`python -m hpcnft run tiny --steps N [--set ...] --run-dir REF` through the local spawner."""
    run_dir = _hpc.local_run(tmp_path_factory.mktemp(name) / "run", steps, overrides)
    assert read_run(run_dir).topology["launcher"] == "local"
    return run_dir


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module", autouse=True)
def _cluster_and_cache(slurm_cluster, hpcnft_cache):
    """Every test here needs the cluster (skip/fail first, before any reference run) and the
    session's model cache, built here, before any job starts: a cache that ranks build after
    torch.distributed is up ends up incomplete (see test_tiny_models_built_by_a_nonzero_rank)."""
    from hpcnft.models.tiny import ensure_tiny_models
    from hpcnft.models.tiny_cache import cache_dir

    ensure_tiny_models(cache_dir())
    return slurm_cluster


@pytest.fixture(scope="module")
def ref3(tiny_run) -> str:
    """`hpcnft run tiny --steps 3` through the local spawner: the session's shared run."""
    assert read_run(tiny_run.run_dir).topology["launcher"] == "local"
    return tiny_run.run_dir


@pytest.fixture(scope="module")
def ref_short(short_run) -> str:
    return short_run



@pytest.fixture
def jobs():
    """Slurm job ids a test started; any still queued at the end are cancelled."""
    ids: list[str] = []
    yield ids
    for j in ids:
        if job_state(j) not in TERMINAL:
            _run(["scancel", j])


def sbatch_job(cluster, script, run_dir, steps, overrides=(), args=(), cwd=None, extra_env=None) -> str:
    env = {"RUN_DIR": str(run_dir), "HPCNFT_ARGS": hpcnft_args(steps, list(overrides)), "HPCNFT_CMD": HPCNFT_CMD}
    env.update(extra_env or {})
    return cluster.submit(script, env=env, args=list(args), cwd=cwd)


# ------------------------------------------------------------------------- 1, 2: the sbatch scripts

def test_sd3_sbatch_cpu_override_identical(slurm_cluster, ref3, tmp_path, jobs):
    """The real job script with the documented CPU override; RECIPE/RUN_DIR/HPCNFT_ARGS via --export."""
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit(
        SD3_SBATCH, env={"HPCNFT_CMD": HPCNFT_CMD}, cwd=tmp_path,
        args=["--gpus-per-task=0", f"--export=ALL,RECIPE=tiny,RUN_DIR={run_dir},HPCNFT_ARGS=--steps {STEPS3}"])
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert_same_metrics(ref3, str(run_dir))
    check_attempts(run_dir, [0], job, "slurm")
    assert read_run(str(run_dir)).topology["world_size"] == 3


def test_tiny_sbatch_identical(slurm_cluster, ref3, tmp_path, jobs):
    run_dir = tmp_path / "run"
    job = sbatch_job(slurm_cluster, TINY_SBATCH, run_dir, STEPS3, cwd=tmp_path)
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert_same_metrics(ref3, str(run_dir))
    check_attempts(run_dir, [0], job, "slurm")
    assert (tmp_path / f"hpcnft-tiny-{job}.out").exists()


# ------------------------------------------------------------------------------ 3, 4: srun and mpirun

def test_srun_pmix_identical(slurm_cluster, mpi_available, ref3, tmp_path):
    """srun --mpi=pmix -n 3 straight from the shell (srun makes its own allocation)."""
    run_dir = tmp_path / "run"
    name = f"hpcnft-pmix-{uuid.uuid4().hex[:8]}"
    code, out = run_cmd(["srun", "--mpi=pmix", "-n", "3", "--cpus-per-task=1", "--kill-on-bad-exit=1",
                         f"--job-name={name}", "--time=00:15:00",
                         PY, "-m", "hpcnft", "run", "tiny", "--steps", STEPS3, "--run-dir", run_dir],
                        timeout=RUN_TIMEOUT, cwd=tmp_path, env=base_env(),
                        on_timeout=lambda: _run(["scancel", f"--name={name}"]))
    assert code == 0, f"srun exited {code}:\n{out[-6000:]}\n{diagnose(run_dir)}"
    assert_same_metrics(ref3, str(run_dir))
    data = read_run(str(run_dir))
    launcher = data.topology["launcher"]
    # launch.detect: PMIX_RANK (+ the MPI world size) comes before SLURM_PROCID
    assert launcher in ("pmix", "slurm") and launcher != "none", data.topology
    print(f"srun --mpi=pmix: launcher {launcher!r}")
    assert len(data.attempts) == 1 and str(data.attempts[0]["slurm_job_id"]).isdigit(), data.attempts


def test_mpirun_without_slurm_identical(mpi_available, ref3, tmp_path):
    run_dir = tmp_path / "run"
    code, out = run_cmd(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3",
                         PY, "-m", "hpcnft", "run", "tiny", "--steps", STEPS3, "--run-dir", run_dir],
                        timeout=RUN_TIMEOUT, cwd=tmp_path, env=base_env(drop_slurm=True))
    assert code == 0, f"mpirun exited {code}:\n{out[-6000:]}\n{diagnose(run_dir)}"
    assert_same_metrics(ref3, str(run_dir))
    check_attempts(run_dir, [0], None, "openmpi")


MPIRUN_IN_SBATCH = """#!/bin/bash
#SBATCH --ntasks=3
#SBATCH --cpus-per-task=1
#SBATCH --time=00:15:00
#SBATCH --output=mpirun-%j.out
set -eu
export PYTHONUNBUFFERED=1
# each rank first shows what it sees: Open MPI's rank, and the batch step's SLURM_PROCID
mpirun --allow-run-as-root -np 3 bash -c \\
  'echo "rank-env ompi=$OMPI_COMM_WORLD_RANK procid=${{SLURM_PROCID:-unset}}"; exec "$@"' _ \\
  {py} -m hpcnft run tiny --steps {steps} --run-dir {run_dir}
"""


def test_mpirun_inside_sbatch_identical(slurm_cluster, mpi_available, ref3, tmp_path, jobs):
    """mpirun in an --ntasks=3 allocation: every rank inherits SLURM_PROCID=0 of the batch step."""
    run_dir = tmp_path / "run"
    script = MPIRUN_IN_SBATCH.format(py=shlex.quote(PY), steps=STEPS3, run_dir=shlex.quote(str(run_dir)))
    job = slurm_cluster.submit(script, cwd=tmp_path)
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    out = job_output(job)
    assert state == "COMPLETED", diagnose(run_dir, job)
    seen = sorted(re.findall(r"^rank-env ompi=(\d) procid=(\S+)$", out, re.M))
    assert seen == [("0", "0"), ("1", "0"), ("2", "0")], out[-3000:]
    assert_same_metrics(ref3, str(run_dir))
    check_attempts(run_dir, [0], job, "openmpi")


# ----------------------------------------------------------------------------------- 5: hpcnft submit

@pytest.mark.parametrize("cluster", ["slurm", "local"])
def test_hpcnft_submit_identical(slurm_cluster, ref3, tmp_path, cluster):
    run_dir = tmp_path / "run"
    job_ids: list[str] = []

    def cancel():
        for j in job_ids:
            _run(["scancel", j])

    cmd = [PY, "-m", "hpcnft", "submit", "tiny", "--cluster", cluster, "--steps", STEPS3, "--run-dir", run_dir,
           "--wait"]
    # the job id is needed to cancel it if `--wait` hangs: watch the output as it comes
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env=base_env(drop_slurm=True), start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                m = re.match(r"submitted job (\S+) ", line)
                if m and cluster == "slurm":
                    job_ids.append(m.group(1))
        else:
            kill_tree(proc.pid)
            cancel()
            pytest.fail(f"hpcnft submit --wait still running after {RUN_TIMEOUT} s:\n{''.join(lines)}\n"
                        f"{diagnose(run_dir)}")
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            cancel()
    out = "".join(lines)
    assert code == 0, f"hpcnft submit exited {code}:\n{out}\n{diagnose(run_dir)}"
    m = re.search(r"^submitted job (\S+) \| run dir (.+)$", out, re.M)
    assert m and m.group(2) == str(run_dir), out
    assert re.search(r"^job \S+ finished: ", out, re.M), out
    assert_same_metrics(ref3, str(run_dir))
    check_attempts(run_dir, [0], m.group(1) if cluster == "slurm" else None, "submitit")


# -------------------------------------------------------------------------------- 6: scontrol requeue

def test_scontrol_requeue_resumes_identical(slurm_cluster, ref_short, tmp_path, jobs):
    run_dir = tmp_path / "run"
    job = sbatch_job(slurm_cluster, TINY_SBATCH, run_dir, SHORT_STEPS, SHORT_SET, cwd=tmp_path)
    jobs.append(job)
    at = wait_for_job_step(job, 2, run_dir)
    assert at < SHORT_STEPS, f"the run was already at step {at} of {SHORT_STEPS}: nothing left to requeue"
    p = _run(["scontrol", "requeue", job])
    assert p.returncode == 0, p.stderr
    state = wait(job, timeout=LONG_TIMEOUT)
    out = job_output(job)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert "attempt 1 " in out and "attempt 2 " in out, out[-4000:]
    assert "REQUEUED" in sacct_states(job), sacct_states(job)
    check_attempts(run_dir, [0, 1], job, "slurm")
    data = read_run(str(run_dir))
    assert "resume" in [e["kind"] for e in data.events], data.events
    # Slurm's SIGTERM may reach the ranks before its kill: then they checkpoint and leave the
    # requeue to Slurm (no second `scontrol requeue` of a job already being requeued)
    req = [e["text"] for e in data.events if e["kind"] == "requeue"]
    assert all(t.startswith("SIGTERM: Slurm is ending the job") for t in req), req
    assert_same_metrics(ref_short, str(run_dir))


# ------------------------------------------------------------------------ 7: the time-limit signal

def rank_logs(run_dir) -> dict[int, str]:
    logs = Path(run_dir) / "logs"
    return {int(p.stem[4:]): p.read_text(errors="replace") for p in logs.glob("rank*.log")} if logs.is_dir() else {}


def ranks_up(run_dir, world: int = 3) -> bool:
    """Every rank has logged its start, which it does after installing its signal handlers."""
    logs = rank_logs(run_dir)
    return all(re.search(rf"INFO rank {r} of {world} ", logs.get(r, "")) for r in range(world))


def signal_logged(run_dir) -> bool:
    return any("received SIGUSR2" in text for text in rank_logs(run_dir).values())


def elapsed_s(job_id: str) -> int:
    """The job's RunTime ([D-]HH:MM:SS) in seconds."""
    run_time = _scontrol_fields(job_id).get("RunTime", "0:0:0")
    days, _, hms = run_time.rpartition("-")
    h, m, s = ([0, 0] + [int(x) for x in hms.split(":")])[-3:]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def test_time_limit_signal_checkpoints_requeues_resumes(slurm_cluster, tmp_path, jobs, request):
    """--signal=USR2@150 through Slurm's time-limit warning (see the module doc for the
    TimeLimit update that makes it fire now); the run checkpoints, requeues itself, resumes."""
    run_dir = tmp_path / "run"
    # Attempt 1 runs its 3 ranks on one CPU: twice the wall time per step, so that the run
    # outlasts Slurm's signal window (<= ~30 s) on an idle machine too (no effect on results:
    # one thread per rank, deterministic mode). The requeued attempt runs free.
    throttle = tmp_path / "one_cpu_in_attempt_1.sh"
    throttle.write_text('#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then exec taskset -c 0 "$@"; fi\n'
                        'exec "$@"\n')
    throttle.chmod(0o755)
    # the uninterrupted reference meanwhile, on the core attempt 1 leaves free
    reference = _hpc.start_local_run(tmp_path / "reference", LONG_STEPS, SIGNAL_SET)
    request.addfinalizer(lambda: _hpc.stop_local_run(reference))
    job = sbatch_job(slurm_cluster, TINY_SBATCH, run_dir, LONG_STEPS, SIGNAL_SET, cwd=tmp_path,
                     args=["--time=00:10:00", "--signal=USR2@150"],
                     extra_env={"HPCNFT_CMD": f"{shlex.quote(str(throttle))} {HPCNFT_CMD}"})
    jobs.append(job)

    def up():
        if job_state(job) in TERMINAL:
            pytest.fail(f"job {job} ended before its ranks came up\n{diagnose(run_dir, job)}")
        return ranks_up(run_dir)

    wait_until(f"the ranks of job {job} to start", up, RUN_TIMEOUT, lambda: diagnose(run_dir, job))
    # leave 90-150 s: less than the 150 s of --signal, so the next periodic check (<= ~30 s)
    # signals; more than enough to checkpoint and requeue before the limit itself
    minutes = math.ceil((elapsed_s(job) + 90) / 60)
    p = _run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])
    assert p.returncode == 0, p.stderr
    t_update = time.monotonic()
    try:
        def signalled():
            if signal_logged(run_dir):
                return "logged by a rank"
            state = job_state(job)
            return state if (state == "PENDING" or state in TERMINAL) else None

        how = wait_until("Slurm's SIGUSR2 (time-limit warning)", signalled, 120, lambda: diagnose(run_dir, job))
        delay = time.monotonic() - t_update
    finally:
        # back to 10 minutes: the requeued attempt must not be signalled (or killed) again
        restored = _run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"])
    assert how != "COMPLETED", f"the run ended before Slurm's signal; raise LONG_STEPS\n{diagnose(run_dir, job)}"
    state = wait(job, timeout=LONG_TIMEOUT)
    out = job_output(job)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert restored.returncode == 0, restored.stderr
    data = read_run(str(run_dir))
    kinds = [e["kind"] for e in data.events]
    sig = [e for e in data.events if e["kind"] == "signal"]
    req = [e for e in data.events if e["kind"] == "requeue"]
    assert sig and sig[0]["text"].startswith("SIGUSR2"), data.events
    step = sig[0]["step"]
    # rank 0 records the request, closes run.h5, then requeues (sacct's REQUEUED below is the outcome)
    assert req and req[0]["text"] == f"requeue of Slurm job {job} requested" and req[0]["step"] == step, data.events
    assert 0 < step < LONG_STEPS
    # checkpoint.every=0: the checkpoint it resumed from is the one the signal path wrote
    ckpts = [e["text"] for e in data.events if e["kind"] == "checkpoint"]
    assert ckpts[0].endswith(f"step_{step:06d}"), ckpts
    assert "resume" in kinds and kinds[-1] == "done", kinds
    assert "attempt 1 " in out and "attempt 2 " in out, out[-4000:]
    states = sacct_states(job)
    assert "REQUEUED" in states, states
    check_attempts(run_dir, [0, 1], job, "slurm")
    assert data.attempts[1]["from_step"] == step, data.attempts
    assert_same_metrics(_hpc.finish_local_run(reference), str(run_dir))
    # exit 75 of the preempted ranks: srun reports it, unless Slurm's requeue killed a rank
    # first (it SIGKILLs the step right after `scontrol requeue`, while ranks shut down)
    exits = re.findall(r"srun: error: \S+: tasks? ([\d,-]+): (Exited with exit code \d+|Killed)", out)
    said = f"hpcnft: preempted at step {step}" in out  # printed by rank 0 right before its requeue
    print(f"time-limit signal {delay:.1f} s after the TimeLimit update ({how}); checkpointed and requeued at "
          f"step {step}; rank 0's 'preempted' line in the job log: {said}; attempt 1's ranks: {exits}")
    assert all(e in ("Exited with exit code 75", "Killed") for _, e in exits), exits


# ------------------------------------------------------------------------------------ 8, 9: submitit

def submitit_stdout(job, task: int = 0) -> str:
    try:
        return job._sub_jobs[task].paths.stdout.read_text(errors="replace")
    except (OSError, IndexError, AttributeError):
        return ""


def submitit_logs(job) -> str:
    parts = []
    for t in range(3):
        try:
            sub = job._sub_jobs[t]
            for p in (sub.paths.stdout, sub.paths.stderr):
                parts.append(f"--- {p}:\n" + p.read_text(errors="replace")[-3000:])
        except (OSError, IndexError, AttributeError):
            pass
    return "\n".join(parts)


def wait_for_submitit_step(job, step: int, run_dir, timeout: float = RUN_TIMEOUT) -> int:
    def cond():
        got = last_step(submitit_stdout(job))
        if got >= step:
            return got
        if job.done(force_check=False) or job_state(job.job_id) in TERMINAL:
            pytest.fail(f"submitit job {job.job_id} ended before step {step}\n{submitit_logs(job)}\n"
                        f"{diagnose(run_dir)}")
        return None

    return wait_until(f"step {step} of submitit job {job.job_id}", cond, timeout,
                      lambda: submitit_logs(job) + "\n" + diagnose(run_dir))


def listpids(job_id: str) -> list[dict]:
    """`scontrol listpids JOB` on this (the only) node: PID, JOBID, STEPID, LOCALID, GLOBALID."""
    p = _run(["scontrol", "listpids", job_id])
    rows = []
    for line in p.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) == 5 and cols[0].isdigit():
            rows.append(dict(zip(("pid", "job", "step", "local", "global"), cols)))
    return rows


def test_submitit_killed_rank_fails_without_hang(slurm_cluster, tmp_path, jobs):
    import submitit

    from hpcnft.run.submit import submit

    run_dir = tmp_path / "run"
    job = submit("tiny", cluster="slurm", overrides=SHORT_SET, steps=40, run_dir=str(run_dir),
                        folder=str(tmp_path / "submitit"))
    jobs.append(job.job_id)
    wait_for_submitit_step(job, 1, run_dir)
    # rank 1 = global task 1 of step 0 (submitit's srun); the task is the python process itself
    rows = [r for r in listpids(job.job_id) if r["step"] == "0" and r["global"] == "1"]
    victims = [int(r["pid"]) for r in rows
               if "submitit" in " ".join(psutil.Process(int(r["pid"])).cmdline())]
    assert victims, f"no rank-1 process in scontrol listpids {job.job_id}: {listpids(job.job_id)}"
    os.kill(victims[0], signal.SIGKILL)
    t_kill = time.monotonic()
    def ended():
        job.watcher.update()  # job.done(force_check=True) does not pass the force on to the tasks
        return job.done()

    wait_until(f"submitit to see job {job.job_id} end after its rank 1 was killed", ended, 240,
               lambda: submitit_logs(job) + "\n" + diagnose(run_dir), poll=1.0)
    took = time.monotonic() - t_kill
    with pytest.raises((submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError)) as e:
        job.results()
    assert "RankFailed" in str(e.value) or "rank" in str(e.value).lower(), str(e.value)
    job.watcher.update()
    assert job.state == "FAILED", (job.state, submitit_logs(job))
    assert job_state(job.job_id) == "FAILED"
    print(f"submitit reported the failure {took:.1f} s after SIGKILL of rank 1 (pid {victims[0]})")


STALE = {}


def test_submitit_interrupt_requeues_and_resumes_identical(slurm_cluster, ref_short, tmp_path, jobs):
    from hpcnft.run.submit import submit

    run_dir = tmp_path / "run"
    job = submit("tiny", cluster="slurm", overrides=SHORT_SET, steps=SHORT_STEPS, run_dir=str(run_dir),
                        folder=str(tmp_path / "submitit"))
    jobs.append(job.job_id)
    at = wait_for_submitit_step(job, 2, run_dir)
    assert at < SHORT_STEPS - 2, f"the run was already at step {at} of {SHORT_STEPS}"
    job._interrupt()  # submitit's preemption: scancel --signal SIGTERM, then --signal USR2

    def requeued():
        f = _scontrol_fields(job.job_id)
        return f.get("Restarts", "0") not in ("0", "") or None

    wait_until(f"submitit to requeue job {job.job_id}", requeued, 180,
               lambda: submitit_logs(job) + "\n" + diagnose(run_dir))
    # while the job waits to run again: do tasks 1 and 2 already claim to be done?
    STALE["pending"] = {t: job._sub_jobs[t].paths.result_pickle.exists() for t in (1, 2)}
    STALE["state"] = job_state(job.job_id)
    wait_until(f"submitit job {job.job_id} to finish", lambda: job.done(), LONG_TIMEOUT,
               lambda: submitit_logs(job) + "\n" + diagnose(run_dir), poll=2.0)
    # only once Slurm has seen every task end are all result files from the last attempt
    # (see test_submitit_preempted_tasks_leave_no_stale_result)
    wait_until(f"job {job.job_id} to end in Slurm", lambda: job_state(job.job_id) in TERMINAL, 120)
    results = job.results()
    assert results == [0, 0, 0], (results, submitit_logs(job))
    STALE["completions"] = {t: submitit_stdout(job, t).count("Job completed successfully") for t in (0, 1, 2)}
    # submitit's state comes from sacct, which can lag behind scontrol's view of the job

    def completed():
        job.watcher.update()
        return job.state == "COMPLETED" or None
    wait_until(f"sacct to report job {job.job_id} COMPLETED", completed, 60, lambda: job.state, poll=2.0)
    print(f"submitit job {job.job_id}: result files of tasks 1, 2 while the job waited for its rerun: "
          f"{STALE['pending']} (state {STALE['state']}); 'Job completed successfully' per task: "
          f"{STALE['completions']}; final results {results}")
    out0 = submitit_stdout(job, 0)
    assert re.search(rf"Requeued job {job.job_id} \(3 remaining timeouts\)", out0), out0[-4000:]  # preempted
    check_attempts(run_dir, [0, 1], job.job_id, "submitit")
    data = read_run(str(run_dir))
    kinds = [e["kind"] for e in data.events]
    assert "signal" in kinds and "resume" in kinds, data.events
    assert "requeue" not in kinds, "under submitit, submitit requeues (not hpcnft's scontrol): " + str(data.events)
    assert_same_metrics(ref_short, str(run_dir))


def test_submitit_preempted_tasks_leave_no_stale_result():
    """Observed by test_submitit_interrupt_requeues_and_resumes_identical (run it in the same
    session): right after submitit requeued the job, do tasks 1 and 2 have result files? They
    should not: the job is not done, and `job.results()` called as the rerun ends may return
    the first attempt's 75 for them (their new result files are written after task 0's)."""
    if "completions" not in STALE:
        pytest.skip("needs test_submitit_interrupt_requeues_and_resumes_identical in this session")
    # submitit logs "Job completed successfully" just before it writes a task's result file:
    # once per task (the last attempt), not also for the preempted attempt
    assert STALE["completions"] == {0: 1, 1: 1, 2: 1}, STALE


# ------------------------------------------------------------------------------------ regressions

def test_tiny_models_built_by_a_nonzero_rank(slurm_cluster, hpcnft_cache, tmp_path):
    """What happens on a fresh HPCNFT_CACHE under srun, sbatch, mpirun, torchrun or hpcnft submit
    whenever the rank that takes the cache's build lock is not rank 0. Made deterministic here:
    rank 0 sees the session's (complete) cache, ranks 1 and 2 a fresh one, which they build."""
    from hpcnft.models.folders import PICKSCORE_REQUIRED, SD3_REQUIRED, check_folder

    fresh, run_dir = tmp_path / "fresh-cache", tmp_path / "run"
    wrapper = ('[ "$SLURM_PROCID" = 0 ] || export HPCNFT_CACHE="$FRESH_CACHE"; exec "$@"')
    env = base_env() | {"FRESH_CACHE": str(fresh)}
    code, out = run_cmd(["srun", "-n", "3", "--kill-on-bad-exit=1", "--time=00:10:00", "bash", "-c", wrapper, "_",
                         PY, "-m", "hpcnft", "run", "tiny", "--steps", "1", *set_args(SHORT_SET),
                         "--run-dir", run_dir], timeout=RUN_TIMEOUT, cwd=tmp_path, env=env)
    assert code == 0, f"exit {code}:\n{out[-3000:]}"
    check_folder("models.sd3_dir", str(fresh / "tiny-models" / "sd35_tiny"), SD3_REQUIRED)
    check_folder("models.pickscore_dir", str(fresh / "tiny-models" / "pickscore_tiny"), PICKSCORE_REQUIRED)
