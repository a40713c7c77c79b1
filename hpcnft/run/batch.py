"""What the Slurm batch scripts (slurm/*.sbatch) run: `python3 -m hpcnft.run.batch SRUN...`
turns the scripts' environment variables into one `srun ... hpcnft run RECIPE --run-dir RUN_DIR
...` command, copies its output into RUN_DIR/logs, and exits with its code. Standard library
only: it runs in the batch step, before any rank.

Knobs (environment variables; sbatch exports the submitting environment by default, or pass
them with --export=ALL,NAME=value,...):

  RECIPE       recipe name or .toml file (the script sets its default)
  RUN_DIR      the run directory (default runs/$SLURM_JOB_ID, outside Slurm runs/local-<time>-<pid>);
               relative paths are taken from the job's working directory and made absolute. It
               must stay the same across requeues of one job: `hpcnft run` resumes from the
               latest checkpoint in RUN_DIR, which is how a requeued job continues.
  HPCNFT_ARGS  extra arguments for `hpcnft run`, split into words at blanks; quotes and
               backslashes group words as in the shell, but nothing is expanded or executed
               (no $VAR, $(...), `...`, globs or ~)
  HPCNFT_CMD   the command that runs hpcnft, split like HPCNFT_ARGS (default `hpcnft`, or
               `python3 -m hpcnft` when no `hpcnft` is on PATH)
  SRUN         the launcher, split like HPCNFT_ARGS (default: the script's srun line inside a
               Slurm job, none outside one, where hpcnft starts the layout's ranks itself);
               SRUN= (empty) runs the command directly. Added to it: --cpus-per-task
               (srun 22.05 does not inherit it) and --gpu-bind=$GPU_BIND
  SRUN_ARGS    more srun options, split like HPCNFT_ARGS (they come last and so win)
  GPU_BIND     srun --gpu-bind value (default none: every rank sees its node's GPUs and uses
               cuda:LOCAL_RANK); GPU_BIND= (empty) keeps Slurm's binding
  HPCNFT_TEE   1 (default): also append the job's output to RUN_DIR/logs/slurm-$SLURM_JOB_ID.out
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Mapping

EXIT_BAD_INPUT = 2
# Slurm signals the ranks before a requeue, cancel or time limit; the copy into the log keeps
# running while they shut down (it ends when their output ends).
COPY_IGNORES = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


class BatchError(ValueError):
    """A knob that cannot be used (one line)."""


def split_words(text: str, name: str) -> list[str]:
    """Words of a knob's value: blanks separate, quotes and backslashes group and escape as in
    the shell; nothing is expanded or executed."""
    try:
        return shlex.split(text, posix=True)
    except ValueError as e:
        raise BatchError(f"bad {name}: cannot split into words: {text} ({e})") from None


def run_dir(env: Mapping[str, str], cwd: str, now: float, pid: int) -> str:
    """RUN_DIR, absolute; the default keeps the job id, so a requeued job finds its run again."""
    path = env.get("RUN_DIR") or ""
    if not path:
        job = env.get("SLURM_JOB_ID")
        path = os.path.join("runs", job if job else f"local-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{pid}")
    return path if os.path.isabs(path) else os.path.join(cwd, path)


def hpcnft_command(env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> list[str]:
    if env.get("HPCNFT_CMD"):
        return split_words(env["HPCNFT_CMD"], "HPCNFT_CMD")
    # -P: the modules of the working directory (the job's submit directory) never run
    return ["hpcnft"] if which("hpcnft") else ["python3", "-P", "-m", "hpcnft"]


def allocated_tasks(env: Mapping[str, str]) -> int | None:
    """The tasks of the allocation the job holds now, from SLURM_TASKS_PER_NODE ("2(x3),1": 7).
    A job requeued onto other nodes (its pending record resized: `scontrol update JobId=J
    NumNodes=2 NumTasks=2`) keeps its first submission's SLURM_NTASKS, which srun would start
    regardless of the nodes it now has; None where the variable is absent or unreadable."""
    total = 0
    for part in (env.get("SLURM_TASKS_PER_NODE") or "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        total += int(m.group(1)) * int(m.group(2) or 1)
    return total or None


def launcher(env: Mapping[str, str], srun: list[str]) -> list[str]:
    """The launcher words: `srun` (the script's line) inside a Slurm job, SRUN where set, none
    outside Slurm; then what srun needs from the job."""
    if "SRUN" in env:
        words = split_words(env["SRUN"], "SRUN")
        words = words + srun[1:] if words else []
    else:
        words = list(srun) if env.get("SLURM_JOB_ID") else []
    if not words:
        return []
    if env.get("SLURM_CPUS_PER_TASK"):
        words.append(f"--cpus-per-task={env['SLURM_CPUS_PER_TASK']}")
    tasks = allocated_tasks(env)
    if tasks and os.path.basename(words[0]) == "srun":  # the ranks the nodes it got hold, not the first ones'
        words.append(f"--ntasks={tasks}")
    gpu_bind = env.get("GPU_BIND", "none")
    if gpu_bind:
        words.append(f"--gpu-bind={gpu_bind}")
    return words + split_words(env.get("SRUN_ARGS", ""), "SRUN_ARGS")


def command(env: Mapping[str, str], srun: list[str], directory: str) -> list[str]:
    """The whole command line: launcher, hpcnft, `run RECIPE --run-dir RUN_DIR`, HPCNFT_ARGS."""
    args = split_words(env.get("HPCNFT_ARGS", ""), "HPCNFT_ARGS")
    return [*launcher(env, srun), *hpcnft_command(env), "run", env.get("RECIPE") or "tiny", "--run-dir", directory,
            *args]


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    out = dict(env)
    out.setdefault("OMP_NUM_THREADS", env.get("SLURM_CPUS_PER_TASK") or "1")
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def say(out, text: str) -> None:
    out.write(f"[hpcnft.sbatch {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")
    out.flush()


def _default_signals() -> None:
    for name in COPY_IGNORES:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def run(argv: list[str], env: Mapping[str, str], cwd: str) -> int:
    try:
        directory = run_dir(env, cwd, time.time(), os.getpid())
        full = command(env, argv, directory)
    except BatchError as e:
        say(sys.stderr, f"error: {e}")
        return EXIT_BAD_INPUT
    old = os.umask(0o077)  # what this creates in RUN_DIR is private, like hpcnft's own files
    try:
        os.makedirs(os.path.join(directory, "logs"), exist_ok=True)
        log = open(os.path.join(directory, "logs", f"slurm-{env.get('SLURM_JOB_ID') or 'local'}.out"), "a") \
            if env.get("HPCNFT_TEE", "1") == "1" else None
    except OSError as e:
        say(sys.stderr, f"error: cannot create RUN_DIR {directory} ({e.strerror})")
        return EXIT_BAD_INPUT
    finally:
        os.umask(old)
    outs = [sys.stdout] + ([log] if log else [])
    attempt = int(env.get("SLURM_RESTART_COUNT") or 0) + 1
    for text in (f"job {env.get('SLURM_JOB_ID') or 'none'} ({env.get('SLURM_JOB_NAME', '')}) attempt {attempt} "
                 f"on {os.uname().nodename} nodes {env.get('SLURM_JOB_NODELIST') or 'local'} "
                 f"tasks {allocated_tasks(env) or env.get('SLURM_NTASKS') or '?'}", f"run dir {directory}",
                 f"command: {shlex.join(full)}"):
        for out in outs:
            say(out, text)
    if log is None:
        rc = _run(full, env, cwd, None)
    else:
        for name in COPY_IGNORES:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        rc = _run(full, env, cwd, outs)
    rc = exit_status(rc)
    for out in outs:
        say(out, f"exit {rc}")
    if log:
        log.close()
    return rc


def _run(full: list[str], env: Mapping[str, str], cwd: str, outs) -> int:
    try:
        if outs is None:
            return subprocess.run(full, env=child_env(env), cwd=cwd, preexec_fn=_default_signals).returncode
        proc = subprocess.Popen(full, env=child_env(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_default_signals)
    except OSError as e:
        say(sys.stderr, f"error: cannot run {full[0]}: {e.strerror}")
        return 127
    for line in iter(proc.stdout.readline, b""):
        for out in outs:
            out.buffer.write(line) if hasattr(out, "buffer") else out.write(line.decode(errors="replace"))
            out.flush()
    return proc.wait()


def exit_status(rc: int) -> int:
    """A child killed by a signal exits 128 + the signal's number, as in the shell."""
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], os.environ, os.getcwd()))
