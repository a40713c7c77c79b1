"""`hpcnft submit`: the run's arguments plus submitit's resources; --dry-run shows what would be
submitted, --wait follows the job."""
from __future__ import annotations

import shlex
import sys
import time

from hpcnft.cli.run import add_arguments as add_run_arguments
from hpcnft.common.errors import EXIT_FAILED
from hpcnft.run.submit import CLUSTERS, prepare


def add_arguments(name: str, p) -> None:
    add_run_arguments("run", p)
    p.add_argument("--cluster", default="slurm", help=f"{', '.join(CLUSTERS)} (debug: in this process)")
    p.add_argument("--nodes", default="1", help="nodes: N, or MIN-MAX (Slurm allocates within the range, and a "
                                                "requeued job may get another count: each must fit the layout)")
    p.add_argument("--tasks-per-node", type=int, default=3, help="ranks per node (default 3: 2 train + 1 reward)")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--time", type=int, default=60, metavar="MINUTES", help="time limit")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--mem-gb", type=float)
    p.add_argument("--folder", help="submitit's folder (default RUN_DIR/submitit)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the submission and print its sbatch script (submitit's parameters for local "
                        "and debug), creating and submitting nothing")
    p.add_argument("--wait", action="store_true", help="follow the job until it ends")


def main(name: str, args) -> int:
    submission = prepare(args.recipe, args.cluster, args.overrides, args.run_dir, args.steps, args.nodes,
                         args.tasks_per_node, args.gpus_per_node, args.cpus_per_task, args.time, args.partition,
                         args.account, args.mem_gb, args.folder)
    if args.dry_run:
        print(submission.preview(), end="", flush=True)
        sets = [word for item in submission.overrides for word in ("--set", item)]
        steps = [] if submission.steps is None else ["--steps", str(submission.steps)]
        print(f"hpcnft submit: dry run, nothing created or submitted; its tasks are the ranks of "
              f"{shlex.join(['hpcnft', 'run', submission.recipe, '--run-dir', submission.run_dir, *sets, *steps])}",
              file=sys.stderr)
        return 0
    job = submission.submit()
    print(f"submitted job {job.job_id} | run dir {submission.run_dir}", flush=True)
    if not args.wait:
        return 0
    return follow(job)


def follow(job) -> int:
    while not job.done():
        time.sleep(2)
    try:
        job.results()
    except Exception as e:  # noqa: BLE001 - submitit's failure, as one line
        text = str(e).strip().splitlines()  # submitit's last line names the failure
        print(f"hpcnft submit: job {job.job_id} failed: {text[-1] if text else type(e).__name__}",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"job {job.job_id} finished: {job.state}")
    return 0
