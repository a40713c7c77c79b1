"""The job through submitit (slurm, local or debug), for `hpcnft submit` and `submit(...)` from Python.

Each submitit task is one rank: submitit's TorchDistributedEnvironment exports RANK,
WORLD_SIZE and the master, and the rank runs exactly what `hpcnft run` runs under torchrun.
Preemption and timeouts go through submitit's checkpoint mechanism: the ranks first finish
their iteration and write a checkpoint, then rank 0 hands over to submitit's handler, which
calls `HpcnftJob.checkpoint` and requeues; the requeued job resumes from that checkpoint.

`prepare` checks a submission and creates nothing (`--dry-run` prints its sbatch script or
submitit's parameters); a submission that fails (no Slurm here, sbatch refusing it) is one line
and removes what it made.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from hpcnft.common.errors import EXIT_OK, EXIT_PREEMPTED, UsageError
from hpcnft.distributed.interpreter import SAFE_PATH, python_env

CLUSTERS = ("slurm", "local", "debug")
SLURM_COMMANDS = ("sbatch", "srun")  # submitit submits with sbatch, and refuses to start where srun is missing


class RankFailed(RuntimeError):
    """A rank ended with a non-zero code: submitit reports the job as failed."""


class HpcnftJob(submitit.helpers.Checkpointable):
    """The callable each submitit task runs. `checkpoint` (inherited) resubmits the same call."""

    def __call__(self, recipe: str, overrides: list[str], run_dir: str, steps: int | None) -> int:
        from hpcnft.algo.root_config import load_config
        from hpcnft.distributed.detect import detect
        from hpcnft.run.entry import rank_main

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["HPCNFT_LAUNCHER"] = "submitit"
        cfg = load_config(recipe, overrides, steps=steps, run_dir=run_dir)
        submitit_handler = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue
        code = rank_main(cfg, detect(os.environ), recipe, overrides)
        if code == EXIT_PREEMPTED:
            # Our checkpoint is written and every file closed: now let submitit requeue the job
            # (it does so on global rank 0 and exits; the other ranks just return).
            if callable(submitit_handler):
                submitit_handler(signal.SIGUSR2, None)
            if int(os.environ.get("RANK", "0")) != 0 and os.environ.get("SUBMITIT_EXECUTOR") != "debug":
                # No result for a task of a requeued job: submitit saves whatever __call__ returns
                # as the task's final result, and SystemExit is not caught by it.
                raise SystemExit(code)
            return code
        if code != EXIT_OK:
            raise RankFailed(f"rank {os.environ.get('RANK')} of the hpcnft job exited {code}; "
                             f"see {run_dir}/logs")
        return code


def executor_parameters(cluster: str, nodes: int | str, tasks_per_node: int, gpus_per_node: int, cpus_per_task: int,
                        timeout_min: int, partition: str | None, account: str | None,
                        mem_gb: float | None) -> dict:
    """submitit's AutoExecutor parameters: its generic ones, and Slurm's prefixed `slurm_`."""
    params = dict(nodes=nodes, tasks_per_node=tasks_per_node, cpus_per_task=cpus_per_task,
                  timeout_min=timeout_min, name="hpcnft")
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if mem_gb:
        params["mem_gb"] = mem_gb
    if cluster == "slurm":
        if partition:
            params["slurm_partition"] = partition
        if account:
            params["slurm_account"] = account
        params["slurm_signal_delay_s"] = 120
    return params


def safe_python() -> str:
    """The job's interpreter, without the working directory on its path (distributed.interpreter)."""
    return f"{shlex.quote(sys.executable)} {SAFE_PATH}"


class _ScriptOnly(submitit.SlurmExecutor):
    """Slurm's executor used only to write its sbatch script: it needs no srun here, submits nothing."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def sbatch_script(folder: str, params: dict) -> str:
    """The sbatch script submitit writes for these AutoExecutor parameters, converted as it converts them."""
    executor = _ScriptOnly(folder, python=safe_python())
    prefix = "slurm_"
    generic = executor._convert_parameters({k: v for k, v in params.items() if not k.startswith(prefix)})
    specific = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
    executor.update_parameters(**generic, **specific)
    return executor._make_submission_file_text(executor._submitit_command_str, "")


@dataclass
class Submission:
    """A submission checked and ready, nothing created yet: `preview` is what `--dry-run` prints,
    `submit` queues it."""
    recipe: str
    overrides: list[str]
    run_dir: str
    steps: int | None
    cluster: str
    folder: str
    params: dict

    def preview(self) -> str:
        if self.cluster == "slurm":
            return sbatch_script(self.folder, self.params)
        return "".join(f"{key} = {value!r}\n" for key, value in
                       [("cluster", self.cluster), ("folder", self.folder), *sorted(self.params.items())])

    def submit(self):
        """Queue the job; returns the submitit Job. A submission that fails leaves nothing on disk."""
        if self.cluster == "slurm":
            missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
            if missing:
                raise UsageError(f"--cluster slurm: no Slurm here ({' and '.join(missing)} not on PATH); "
                                 f"nothing was submitted (--dry-run prints the sbatch script)")
        made = _NewPaths(self.folder, self.run_dir)
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        said = io.StringIO()
        # The job inherits this environment (Slurm exports it): where hpcnft is found only through the
        # working directory, its folder goes on PYTHONPATH, since the job's interpreter runs with -P.
        os.environ.update(python_env(os.environ))
        python = {f"{self.cluster}_python": safe_python()} if self.cluster in ("slurm", "local") else {}
        try:
            executor = submitit.AutoExecutor(folder=self.folder, cluster=self.cluster, **python)
            executor.update_parameters(**self.params)
            with contextlib.redirect_stderr(said):  # submitit prints a failed sbatch's stderr, then raises it
                job = executor.submit(HpcnftJob(), self.recipe, self.overrides, self.run_dir, self.steps)
        except BaseException as e:
            made.remove()
            if isinstance(e, (FailedJobError, FailedSubmissionError)):
                lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # the last says why
                why = lines[-1].removeprefix("sbatch: error: ") if lines else type(e).__name__
                raise UsageError(f"--cluster {self.cluster}: sbatch failed, nothing was submitted: {why}") from None
            raise
        sys.stderr.write(said.getvalue())
        return job


class _NewPaths:
    """The folders a submission is about to create and what they hold now, so that a failed
    submission removes exactly what it made: new files in submitit's folder, then the new folders
    that are left empty."""

    def __init__(self, folder: str, run_dir: str):
        self.folder = folder
        self.held = set(os.listdir(folder)) if os.path.isdir(folder) else None
        self.new_dirs = [p for d in (folder, run_dir) for p in _missing(d)]

    def remove(self) -> None:
        if self.held is None:
            shutil.rmtree(self.folder, ignore_errors=True)
        elif os.path.isdir(self.folder):
            for name in set(os.listdir(self.folder)) - self.held:
                path = os.path.join(self.folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        for path in sorted(set(self.new_dirs), key=len, reverse=True):  # the deepest first
            try:
                os.rmdir(path)
            except OSError:  # not empty (another process wrote there) or already gone: left as it is
                pass


def _missing(path: str) -> list[str]:
    """`path` and those of its parents that do not exist."""
    out = []
    while not os.path.lexists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def node_counts(nodes: int | str) -> range:
    """`--nodes`: N, or a range MIN-MAX that Slurm may allocate (and a requeue may change)."""
    text = str(nodes).strip()
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    low, high = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or low < 1 or high < low:
        raise UsageError(f"--nodes: expected a node count N or a range MIN-MAX (as sbatch's), got {text!r}")
    return range(low, high + 1)


def prepare(recipe: str = "tiny", cluster: str = "slurm", overrides: list[str] | None = None,
            run_dir: str | None = None, steps: int | None = None, nodes: int | str = 1, tasks_per_node: int = 3,
            gpus_per_node: int = 0, cpus_per_task: int = 1, timeout_min: int = 60, partition: str | None = None,
            account: str | None = None, mem_gb: float | None = None, folder: str | None = None) -> Submission:
    """Check a submission without creating anything: the cluster, the config, the run dir (free,
    and a run in it resumable with this config), the inputs. The run dir is fixed here, so every
    requeue of the job writes to (and resumes from) the same one."""
    from hpcnft.algo.root_config import ConfigError, load_config
    from hpcnft.io.rundir_lock import check_free
    from hpcnft.run.rundir import check_input, default_run_dir, preflight

    if cluster not in CLUSTERS:
        raise UsageError(f"--cluster: {cluster!r} is not one of {', '.join(CLUSTERS)}")
    overrides = list(overrides or [])
    run_dir = os.path.abspath(run_dir or default_run_dir(recipe))
    try:
        cfg = load_config(recipe, overrides, steps=steps, run_dir=run_dir)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        check_free(run_dir)  # a run dir in use is refused now, not when the job starts
    except OSError as e:
        raise UsageError(f"run dir {run_dir!r}: cannot read its lock file: {e.strerror or e}") from None
    counts = node_counts(nodes)
    if cluster != "debug":  # every allocation the range allows (a requeue may get another) must run
        for n in counts[1:]:
            try:
                check_input(cfg, n * tasks_per_node)
            except UsageError as e:
                raise UsageError(f"--nodes {nodes}: on {n} nodes, {e}") from None
    preflight(cfg, None if cluster == "debug" else counts[0] * tasks_per_node)
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    params = executor_parameters(cluster, counts[0] if len(counts) == 1 else span, tasks_per_node, gpus_per_node,
                                 cpus_per_task, timeout_min, partition, account, mem_gb)
    return Submission(recipe, overrides, run_dir, steps, cluster,
                      os.path.abspath(folder or os.path.join(run_dir, "submitit")), params)


def submit(recipe: str = "tiny", cluster: str = "slurm", overrides: list[str] | None = None,
           run_dir: str | None = None, steps: int | None = None, nodes: int | str = 1, tasks_per_node: int = 3,
           gpus_per_node: int = 0, cpus_per_task: int = 1, timeout_min: int = 60, partition: str | None = None,
           account: str | None = None, mem_gb: float | None = None, folder: str | None = None):
    """Check and submit the job (`prepare`, then `Submission.submit`); returns the submitit Job."""
    return prepare(recipe, cluster, overrides, run_dir, steps, nodes, tasks_per_node, gpus_per_node, cpus_per_task,
                   timeout_min, partition, account, mem_gb, folder).submit()
