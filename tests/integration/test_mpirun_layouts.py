"""A run that Open MPI's mpirun starts again on other world sizes (no Slurm): -np 3 (2+1) for
step 1, -np 2 (1+1) for step 2, -np 5 (4+1) for step 3, under determinism.layout_invariant, is
the local spawner's straight 2+1 run (the session's `invariant_run`, a step longer) bit for bit.
Skips where mpirun or mpi4py is missing (CI has both: tools/local_slurm.sh installs Open MPI)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jobs import INVARIANT_ARGS, non_perf
from hpcnft.io.compare import compare_metrics
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow


def test_mpirun_resumes_a_run_on_other_world_sizes_with_the_straight_runs_bits(invariant_run, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (tools/local_slurm.sh installs Open MPI)")
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    run_dir = str(tmp_path / "run")
    for step, ranks in ((1, 3), (2, 2), (3, 5)):
        r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), sys.executable, "-m",
                            "hpcnft", "run", "tiny", "--steps", str(step), "--run-dir", run_dir, *INVARIANT_ARGS],
                           capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
        assert r.returncode == 0, f"mpirun -np {ranks} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "resuming on another layout: 1 train + 1 reward ranks" in r.stdout
    a, b = non_perf(read_run(invariant_run).metrics), non_perf(read_run(run_dir).metrics)
    result = compare_metrics(a, b, prefix=True)
    assert result.same and result.steps >= 3, "\n".join(str(d) for d in result.divergences)
    attempts = read_run(run_dir).attempts
    assert [(a["launcher"], a["world_size"], a["from_step"]) for a in attempts] == [
        ("openmpi", 3, 0), ("openmpi", 2, 1), ("openmpi", 5, 2)], attempts
