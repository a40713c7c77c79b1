"""The job through submitit (slurm, local or debug), for `hpcnft submit` and `submit(...)` from Python.

Each submitit task is one rank: submitit's TorchDistributedEnvironment exports RANK,
WORLD_SIZE and the master, and the rank runs exactly what `hpcnft run` runs under torchrun.
Preemption and timeouts go through submitit's checkpoint mechanism: the ranks first finish
their iteration and write a checkpoint, then rank 0 hands over to submitit's handler, which
calls `HpcnftJob.checkpoint` and requeues; the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import os
import shlex
import signal
import sys

import submitit

from hpcnft.common.errors import EXIT_OK, EXIT_PREEMPTED, UsageError
from hpcnft.distributed.interpreter import SAFE_PATH, python_env

CLUSTERS = ("slurm", "local", "debug")


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


def make_executor(cluster: str, folder: str, nodes: int, tasks_per_node: int, gpus_per_node: int,
                  cpus_per_task: int, timeout_min: int, partition: str | None, account: str | None,
                  mem_gb: float | None):
    if cluster not in CLUSTERS:
        raise UsageError(f"--cluster: {cluster!r} is not one of {', '.join(CLUSTERS)}")
    # the job's interpreter runs without the working directory on its path (distributed.interpreter)
    safe = f"{shlex.quote(sys.executable)} {SAFE_PATH}"
    python = {f"{cluster}_python": safe} if cluster in ("slurm", "local") else {}
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, **python)
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
    executor.update_parameters(**params)
    return executor


def submit(recipe: str = "tiny", cluster: str = "slurm", overrides: list[str] | None = None,
           run_dir: str | None = None, steps: int | None = None, nodes: int = 1, tasks_per_node: int = 3,
           gpus_per_node: int = 0, cpus_per_task: int = 1, timeout_min: int = 60, partition: str | None = None,
           account: str | None = None, mem_gb: float | None = None, folder: str | None = None):
    """Submit the job; returns the submitit Job. The run dir is fixed here, so every requeue
    of the job writes to (and resumes from) the same one."""
    from hpcnft.algo.root_config import ConfigError, load_config
    from hpcnft.io.rundir_lock import check_free
    from hpcnft.run.rundir import default_run_dir, preflight

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
    preflight(cfg, None if cluster == "debug" else nodes * tasks_per_node)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    folder = folder or os.path.join(run_dir, "submitit")
    # The job inherits this environment (Slurm exports it): where hpcnft is found only through the
    # working directory, its folder goes on PYTHONPATH, since the job's interpreter runs with -P.
    os.environ.update(python_env(os.environ))
    executor = make_executor(cluster, folder, nodes, tasks_per_node, gpus_per_node, cpus_per_task, timeout_min,
                             partition, account, mem_gb)
    return executor.submit(HpcnftJob(), recipe, overrides, run_dir, steps)
