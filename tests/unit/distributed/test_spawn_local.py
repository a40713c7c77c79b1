"""The local spawner's exit code: the first failed rank's, however close together the ranks end."""
from __future__ import annotations

import sys
import time

from hpcnft.distributed.groups import spawn_local


def role(rank):
    return "reward" if rank == 2 else "train"


def ranks(script):
    return (sys.executable, "-c", script)


def test_ranks_that_all_fail_at_once_fail_the_job(capfd):
    # all three exit at the same instant, as ranks do on a full disk: almost surely between two
    # of the spawner's polls
    script = f"import os, time; time.sleep(max(0.0, {time.time() + 1.5} - time.time())); os._exit(3)"
    assert spawn_local([], 3, role, command=ranks(script)) == 3
    assert "failed: exit code 3; stopping the other ranks" in capfd.readouterr().err


def test_the_first_failure_is_the_jobs_code_and_a_signal_maps_to_128_plus_it():
    script = ("import os, signal, sys, time; r = int(os.environ['RANK'])\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(2); sys.exit(1)")
    assert spawn_local([], 3, role, command=ranks(script)) == 128 + 9


def test_ranks_that_all_succeed_make_a_zero_exit():
    assert spawn_local([], 3, role, command=ranks("import sys; sys.exit(0)")) == 0


def test_only_rank_0_inherits_the_descriptor_it_is_given(tmp_path):
    # the run dir's lock: rank 0 reads the inherited file through the number in the variable;
    # the other ranks get neither the variable nor the descriptor
    path = tmp_path / "shared"
    path.write_text("held")
    script = ("import os, sys; r = int(os.environ['RANK']); v = os.environ.get('LOCK_FD')\n"
              "if r == 0: sys.exit(0 if os.pread(int(v), 4, 0) == b'held' else 5)\n"
              "sys.exit(0 if v is None else 6)")
    with open(path, "rb") as f:
        assert spawn_local([], 3, role, command=ranks(script), rank0_fd=("LOCK_FD", f.fileno())) == 0


def test_a_rank_killed_by_a_signal_is_named_before_the_ranks_that_noticed_its_death(capfd):
    # rank 1 is killed; rank 0 notices at once and exits 1, both between two of the spawner's polls
    at = time.time() + 1.5
    script = (f"import os, signal, time; r = int(os.environ['RANK']); time.sleep(max(0.0, {at} - time.time()))\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "if r == 0: time.sleep(0.01); os._exit(1)\n"
              "time.sleep(2); os._exit(1)")
    assert spawn_local([], 3, role, command=ranks(script)) == 128 + 9
    err = capfd.readouterr().err
    assert "rank 1 (train) failed: killed by SIGKILL" in err and "rank 0" not in err
