"""`hpcnft submit` and `hpcnft.submit(...)`: the job through submitit (slurm, local or debug).

Each submitit task is one rank: submitit's TorchDistributedEnvironment exports RANK,
WORLD_SIZE and the master, and the rank runs exactly what `hpcnft run` runs under torchrun.
Preemption and timeouts go through submitit's checkpoint mechanism: the ranks first finish
their iteration and write a checkpoint, then rank 0 hands over to submitit's handler, which
calls `HpcnftJob.checkpoint` and requeues; the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import submitit

from hpcnft.cli.main import UsageError

CLUSTERS = ("slurm", "local", "debug")


class RankFailed(RuntimeError):
    """A rank ended with a non-zero code: submitit reports the job as failed."""


class HpcnftJob(submitit.helpers.Checkpointable):
    """The callable each submitit task runs. `checkpoint` (inherited) resubmits the same call."""

    def __call__(self, recipe: str, overrides: list[str], run_dir: str, steps: int | None) -> int:
        from hpcnft.common.config import load_config
        from hpcnft.dist.launch import detect
        from hpcnft.algo.iteration import EXIT_OK, EXIT_PREEMPTED
        from hpcnft.run.job import run_rank

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["HPCNFT_LAUNCHER"] = "submitit"
        cfg = load_config(recipe, overrides, steps=steps, run_dir=run_dir)
        submitit_handler = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue
        code = run_rank(cfg, detect(os.environ), recipe)
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
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
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
    from hpcnft.cli.run import default_run_dir, preflight
    from hpcnft.common.config import ConfigError, load_config

    overrides = list(overrides or [])
    run_dir = os.path.abspath(run_dir or default_run_dir(recipe))
    try:
        cfg = load_config(recipe, overrides, steps=steps, run_dir=run_dir)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    preflight(cfg)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    folder = folder or os.path.join(run_dir, "submitit")
    executor = make_executor(cluster, folder, nodes, tasks_per_node, gpus_per_node, cpus_per_task, timeout_min,
                             partition, account, mem_gb)
    return executor.submit(HpcnftJob(), recipe, overrides, run_dir, steps)


def add_arguments(name: str, p) -> None:
    from hpcnft.cli.run import add_arguments as add_run_arguments

    add_run_arguments("run", p)
    p.add_argument("--cluster", default="slurm", help="slurm, local or debug (in this process)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=3, help="ranks per node (default 3: 2 train + 1 reward)")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--time", type=int, default=60, metavar="MINUTES", help="time limit")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--mem-gb", type=float)
    p.add_argument("--folder", help="submitit's folder (default RUN_DIR/submitit)")
    p.add_argument("--wait", action="store_true", help="follow the job until it ends")


def main(name: str, args) -> int:
    job = submit(args.recipe, args.cluster, args.overrides, args.run_dir, args.steps, args.nodes,
                 args.tasks_per_node, args.gpus_per_node, args.cpus_per_task, args.time, args.partition,
                 args.account, args.mem_gb, args.folder)
    run_dir = job.submission().args[2] if hasattr(job, "submission") else args.run_dir
    print(f"submitted job {job.job_id} | run dir {run_dir}", flush=True)
    if not args.wait:
        return 0
    return follow(job)


def follow(job) -> int:
    while not job.done():
        time.sleep(2)
    try:
        job.results()
    except Exception as e:  # noqa: BLE001 - submitit's failure, as one line
        text = str(e).strip().splitlines()
        print(f"hpcnft submit: job {job.job_id} failed: {text[-1] if text else type(e).__name__}",
              file=sys.stderr)
        return 1
    print(f"job {job.job_id} finished: {job.state}")
    return 0
