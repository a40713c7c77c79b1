"""`python -m hpcnft.distributed.fork_server`: imports what a job's ranks import, once, then
forks the ranks from itself and exits, so that N ranks pay for torch, diffusers and
transformers once and the spawner, which never imports them, stays a small supervisor.

The spawner (distributed.spawner.spawn_local) is a child subreaper: when this process exits,
the ranks it forked become the spawner's children, which it waits on and signals as its own.
Only where no rank can use a GPU (CUDA does not survive a fork). Standard library only.

Protocol, one JSON line each way over two pipes the spawner passes (--request-fd, --reply-fd):
  request: {"prepare": "module:function", "entry": "module:function", "argv": [...],
            "ranks": [{"env": {...}, "keep_fds": [...]}, ...], "close_fds": [...]}
  reply:   {"ready": true} once `prepare(argv)` has imported the libraries; then the spawner
           writes "go" (or closes the pipe: nothing is forked) and the reply is {"pids": [...]}.
Each rank runs `entry(argv)` with its env and exits with its return value."""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import signal
import sys
import time

from hpcnft.distributed import preempt

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def resolve(spec: str):
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_rank(entry, argv: list[str], env: dict[str, str], keep_fds, close_fds, server_pid: int) -> None:
    """In a forked child: become the rank, as `python -m` of its entry would be; never returns."""
    code = 1
    try:
        for fd in close_fds:
            if fd not in keep_fds:
                os.close(fd)
        for s in HELD_SIGNALS:  # the server's dispositions are not the rank's
            signal.signal(s, signal.SIG_DFL)
        preempt.catch_early(interrupt=True)  # until the rank's PreemptFlag takes over
        os.environ.clear()
        os.environ.update(env)
        while os.getppid() == server_pid:  # the server is exiting: the spawner adopts the rank
            time.sleep(0.005)
        code = entry(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's exit runs: libraries' handlers, logging
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(request_fd: int, reply_fd: int) -> int:
    with os.fdopen(request_fd, "r") as requests, os.fdopen(reply_fd, "w") as replies:
        request = json.loads(requests.readline())
        entry = resolve(request["entry"])
        resolve(request["prepare"])(request["argv"])
        replies.write(json.dumps({"ready": True}) + "\n")
        replies.flush()
        if requests.readline().strip() != "go":
            return 0  # the spawner stopped before the ranks started
        sys.stdout.flush()
        sys.stderr.flush()
        pids, server_pid = [], os.getpid()
        close_fds = [*request["close_fds"], request_fd, reply_fd]
        for rank in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                run_rank(entry, request["argv"], rank["env"], rank["keep_fds"], close_fds, server_pid)
            pids.append(pid)
        replies.write(json.dumps({"pids": pids}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    # The spawner decides what a signal means; this process only must not outlive it.
    for s in HELD_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    from hpcnft.distributed.spawner import end_with_parent

    p = argparse.ArgumentParser(prog="hpcnft.distributed.fork_server")
    p.add_argument("--request-fd", type=int, required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("--spawner-pid", type=int, required=True)
    args = p.parse_args(argv)
    end_with_parent(args.spawner_pid, signal.SIGKILL)
    code = serve(args.request_fd, args.reply_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no exit handlers: they belong to the ranks, which share this process's state


if __name__ == "__main__":
    sys.exit(main())
