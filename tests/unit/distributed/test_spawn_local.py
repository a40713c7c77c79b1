"""The local spawner's exit code: the first failed rank's, however close together the ranks end;
for ranks started as new interpreters and for ranks forked from the spawner alike."""
from __future__ import annotations

import os
import sys
import time

import pytest

from hpcnft.distributed.groups import spawn_local

HOW = ["exec", "fork"]


def role(rank):
    return "reward" if rank == 2 else "train"


def spawn(script: str, how: str, **kw) -> int:
    """spawn_local of 3 ranks running `script`: in new interpreters, or forked (the script run by
    the entry the spawner calls in each child; an entry's return value is the rank's exit code)."""
    if how == "exec":
        return spawn_local([], 3, role, command=(sys.executable, "-c", script), **kw)

    def entry(argv):
        exec(compile(script, "<rank>", "exec"), {})
        return 0
    return spawn_local([], 3, role, entry=entry, **kw)


@pytest.mark.parametrize("how", HOW)
def test_ranks_that_all_fail_at_once_fail_the_job(capfd, how):
    # all three exit at the same instant, as ranks do on a full disk: almost surely between two
    # of the spawner's polls
    script = f"import os, time; time.sleep(max(0.0, {time.time() + 1.5} - time.time())); os._exit(3)"
    assert spawn(script, how) == 3
    assert "failed: exit code 3; stopping the other ranks" in capfd.readouterr().err


@pytest.mark.parametrize("how", HOW)
def test_the_first_failure_is_the_jobs_code_and_a_signal_maps_to_128_plus_it(how):
    script = ("import os, signal, sys, time; r = int(os.environ['RANK'])\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(2); sys.exit(1)")
    assert spawn(script, how) == 128 + 9


@pytest.mark.parametrize("how", HOW)
def test_ranks_that_all_succeed_make_a_zero_exit(how):
    assert spawn("import sys; sys.exit(0)", how) == 0


@pytest.mark.parametrize("how", HOW)
def test_only_rank_0_inherits_the_descriptor_it_is_given(tmp_path, how):
    # the run dir's lock: rank 0 reads the inherited file through the number in the variable;
    # the other ranks get neither the variable nor the descriptor
    path = tmp_path / "shared"
    path.write_text("held")
    with open(path, "rb") as f:
        script = ("import os, sys; r = int(os.environ['RANK']); v = os.environ.get('LOCK_FD')\n"
                  "if r == 0: sys.exit(0 if os.pread(int(v), 4, 0) == b'held' else 5)\n"
                  "try:\n"
                  f"    os.fstat({f.fileno()}); sys.exit(7)\n"
                  "except OSError:\n"
                  "    sys.exit(0 if v is None else 6)")
        assert spawn(script, how, rank0_fd=("LOCK_FD", f.fileno())) == 0


@pytest.mark.parametrize("how", HOW)
def test_a_rank_killed_by_a_signal_is_named_before_the_ranks_that_noticed_its_death(capfd, how):
    # rank 1 is killed; rank 0 notices at once and exits 1, both between two of the spawner's polls
    at = time.time() + 1.5
    script = (f"import os, signal, time; r = int(os.environ['RANK']); time.sleep(max(0.0, {at} - time.time()))\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "if r == 0: time.sleep(0.01); os._exit(1)\n"
              "time.sleep(2); os._exit(1)")
    assert spawn(script, how) == 128 + 9
    err = capfd.readouterr().err
    assert "rank 1 (train) failed: killed by SIGKILL" in err and "rank 0" not in err


def test_a_forked_rank_that_raises_prints_its_traceback_and_exits_1(capfd):
    def entry(argv):
        raise RuntimeError("boom in rank " + os.environ["RANK"])
    assert spawn_local([], 3, role, entry=entry) == 1
    err = capfd.readouterr().err
    assert "RuntimeError: boom in rank" in err and "Traceback" in err


def test_forked_ranks_run_the_exit_handlers_their_interpreter_would(tmp_path):
    """atexit handlers a rank registers run when it ends (libraries close their files there)."""
    def entry(argv):
        import atexit

        rank = os.environ["RANK"]
        atexit.register(lambda: (tmp_path / f"closed-{rank}").write_text(rank))
        return 0
    assert spawn_local([], 3, role, entry=entry) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed-0", "closed-1", "closed-2"]


def test_ranks_fork_only_where_no_rank_can_use_a_gpu(monkeypatch):
    import torch

    from hpcnft.algo.root_config import load_config
    from hpcnft.distributed.groups import ranks_can_fork

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert ranks_can_fork(load_config("tiny"))  # a torch without CUDA
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert not ranks_can_fork(load_config("tiny"))  # layout.device auto: the ranks may take a GPU
    assert ranks_can_fork(load_config("tiny", ["layout.device=cpu"]))


@pytest.mark.parametrize("built_here", [False, True])
def test_the_spawner_forks_its_ranks_unless_it_built_the_tiny_models(monkeypatch, tmp_path, built_here):
    """Building the tiny models runs torch in the spawner (an OpenMP pool a fork would hang on):
    that start's ranks are new interpreters; every other CPU start forks them after importing
    their libraries."""
    import argparse

    from hpcnft.algo.root_config import load_config
    from hpcnft.cli import run as cli_run
    from hpcnft.distributed import groups

    seen = {}
    monkeypatch.setattr(cli_run, "tiny_models_needed", lambda cfg: built_here)
    monkeypatch.setattr("hpcnft.models.loading.resolve_model_paths", lambda cfg: None)
    monkeypatch.setattr(groups, "spawn_local",
                        lambda argv, world, role_of, rank0_fd, entry, **kw: seen.update(entry=entry))
    monkeypatch.setattr(groups, "ranks_can_fork", lambda cfg: True)
    cfg = load_config("tiny", run_dir=str(tmp_path))
    cli_run.spawn_ranks(cfg, argparse.Namespace(recipe="tiny", overrides=[], steps=1), rank0_fd=None)
    from hpcnft.cli.main import main

    assert seen["entry"] is (None if built_here else main)
    if not built_here:
        import sys

        assert "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3" in sys.modules


def test_a_stop_signal_that_kills_ranks_before_their_handlers_is_a_preemption(capfd):
    """SIGTERM to the spawner, passed on to ranks that have no handler yet: nothing was saved,
    nothing failed: exit 75 saying so, no rank blamed."""
    import signal
    import threading

    def send_once_forwarding():  # never to pytest's own SIGTERM handling
        while getattr(signal.getsignal(signal.SIGTERM), "__name__", "") != "forward":
            time.sleep(0.02)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_once_forwarding, daemon=True).start()
    assert spawn_local([], 3, role, command=(sys.executable, "-c", "import time; time.sleep(60)")) == 75
    err = capfd.readouterr().err
    assert "SIGTERM reached rank" in err and "before it could checkpoint: nothing to save" in err
    assert "failed" not in err


def test_ranks_are_told_which_process_spawned_them():
    script = "import os, sys; sys.exit(0 if os.environ['HPCNFT_SPAWNER_PID'] == str(os.getppid()) else 4)"
    assert spawn(script, "exec") == 0 and spawn(script, "fork") == 0


def interrupt_after_forwarding(times: int, gap_s: float = 1.0) -> None:
    """Ctrl-C to this process (the spawner), `times` times, once it forwards signals."""
    import signal
    import threading

    def send():
        while getattr(signal.getsignal(signal.SIGINT), "__name__", "") != "forward":
            time.sleep(0.02)
        for _ in range(times):
            time.sleep(gap_s)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()


# A rank as a real one answers Ctrl-C: the flag is set, the step under way ends, it exits 130
INTERRUPTIBLE = ("import signal, sys, time\n"
                 "got = []\n"
                 "signal.signal(signal.SIGINT, lambda s, f: got.append(s))\n"
                 "while not got:\n"
                 "    time.sleep(0.02)\n"
                 "time.sleep(STEP_S)\n"
                 "sys.exit(130)")


def test_a_ctrl_c_lets_the_ranks_checkpoint_and_exits_130_blaming_none(capfd):
    interrupt_after_forwarding(1)
    script = INTERRUPTIBLE.replace("STEP_S", "0.5")
    assert spawn_local([], 3, role, command=(sys.executable, "-c", script), resume_hint="`hpcnft run x`") == 130
    err = capfd.readouterr().err
    assert err == ("hpcnft: interrupted: the ranks checkpoint at the end of the step under way and stop "
                   "(Ctrl-C again stops them at once)\n")


def test_a_second_ctrl_c_stops_the_ranks_at_once_and_says_how_to_resume(capfd, tmp_path):
    interrupt_after_forwarding(2)
    # a step that would outlast the test, after which a rank leaves a mark: none must be left
    script = INTERRUPTIBLE.replace("STEP_S", "120").replace(
        "sys.exit(130)", f"open({str(tmp_path / 'finished')!r} + os.environ['RANK'], 'w'); sys.exit(130)")
    script = "import os\n" + script
    assert spawn_local([], 3, role, command=(sys.executable, "-c", script), resume_hint="`hpcnft run x`") == 130
    assert not list(tmp_path.iterdir())
    lines = capfd.readouterr().err.splitlines()
    assert lines[1] == ("hpcnft: interrupted again: the ranks are stopped at once; `hpcnft run x` resumes from "
                        "the last checkpoint") and len(lines) == 2 and "failed" not in lines[0]


@pytest.mark.parametrize("how", HOW)
def test_the_rank_that_claimed_the_failure_is_named_not_the_first_to_exit(capfd, how, tmp_path):
    """Rank 2 fails first (it claims the failure), rank 1 notices and exits before it does."""
    script = ("import os, sys, time; r = int(os.environ['RANK'])\n"
              "if r == 1: sys.exit(1)\n"
              "time.sleep(1.5); sys.exit(1 if r == 2 else 0)")
    from hpcnft.run.failures import FailureClaim

    os.makedirs(tmp_path / "logs")
    claim = FailureClaim(str(tmp_path))
    claim.claim(2)
    assert spawn(script, how, failure_claim=claim) == 1
    err = capfd.readouterr().err
    assert err == "hpcnft: rank 2 (reward) failed; stopping the other ranks\n"
