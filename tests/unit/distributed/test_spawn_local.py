"""The local spawner's exit code: the first failed rank's, however close together the ranks end;
signals passed on, Ctrl-C, the failure claim; and the spawner itself imports no torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hpcnft.distributed.spawner import spawn_local



def role(rank):
    return "reward" if rank == 2 else "train"


def spawn(script: str, **kw) -> int:
    """spawn_local of 3 ranks, each a new interpreter running `script`."""
    return spawn_local([], 3, role, command=(sys.executable, "-c", script), **kw)


def test_ranks_that_all_fail_at_once_fail_the_job(capfd):
    # all three exit at the same instant, as ranks do on a full disk: almost surely between two
    # of the spawner's polls
    script = f"import os, time; time.sleep(max(0.0, {time.time() + 1.5} - time.time())); os._exit(3)"
    assert spawn(script) == 3
    assert "failed: exit code 3; stopping the other ranks" in capfd.readouterr().err


def test_the_first_failure_is_the_jobs_code_and_a_signal_maps_to_128_plus_it():
    script = ("import os, signal, sys, time; r = int(os.environ['RANK'])\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(2); sys.exit(1)")
    assert spawn(script) == 128 + 9


def test_ranks_that_all_succeed_make_a_zero_exit():
    assert spawn("import sys; sys.exit(0)") == 0


def test_only_rank_0_inherits_the_descriptor_it_is_given(tmp_path):
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
        assert spawn(script, rank0_fd=("LOCK_FD", f.fileno())) == 0


def test_a_rank_killed_by_a_signal_is_named_before_the_ranks_that_noticed_its_death(capfd):
    # rank 1 is killed; rank 0 notices at once and exits 1, both between two of the spawner's polls
    at = time.time() + 1.5
    script = (f"import os, signal, time; r = int(os.environ['RANK']); time.sleep(max(0.0, {at} - time.time()))\n"
              "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
              "if r == 0: time.sleep(0.01); os._exit(1)\n"
              "time.sleep(2); os._exit(1)")
    assert spawn(script) == 128 + 9
    err = capfd.readouterr().err
    assert "rank 1 (train) failed: killed by SIGKILL" in err and "rank 0" not in err


@pytest.fixture
def fork_entries(monkeypatch):
    """The fork server finds tests/fork_entries.py by name."""
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    return lambda name, prepare="prepare": (f"fork_entries:{prepare}", f"fork_entries:{name}")


def test_a_forked_rank_that_raises_prints_its_traceback_and_exits_1(capfd, fork_entries):
    assert spawn_local([], 3, role, fork=fork_entries("boom")) == 1
    err = capfd.readouterr().err
    assert "RuntimeError: boom in rank" in err and "Traceback" in err


def test_forked_ranks_run_the_exit_handlers_their_interpreter_would(tmp_path, fork_entries):
    """atexit handlers a rank registers run when it ends (libraries close their files there)."""
    assert spawn_local([str(tmp_path)], 3, role, fork=fork_entries("close_at_exit")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["closed-0", "closed-1", "closed-2"]


def test_the_fork_server_prepares_once_and_the_spawner_adopts_its_ranks(capfd, fork_entries):
    """One prepare for all ranks, in a process that is gone once they run: each rank's parent is
    the spawner, which waits on it as its own child."""
    assert spawn_local([], 3, role, fork=fork_entries("report")) == 0
    out = capfd.readouterr().out.splitlines()
    prepared = [line for line in out if line.startswith("prepared in ")]
    ranks = sorted(line.split() for line in out if line.startswith("rank "))
    assert len(prepared) == 1 and int(prepared[0].split()[-1]) != os.getpid()
    assert [r[1] for r in ranks] == ["0", "1", "2"]
    assert {r[5] for r in ranks} == {str(os.getpid())}  # adopted by this process
    assert len({r[3] for r in ranks}) == 3


@pytest.mark.parametrize("started", ["forked", "new interpreter"])
def test_rank_0_inherits_the_rendezvous_socket_already_listening_so_no_other_process_takes_the_port(
        started, fork_entries):
    # a port only chosen, then bound by rank 0 later, was taken in between by a parallel job
    how = {"fork": fork_entries("holds_the_rendezvous")} if started == "forked" else {
        "command": (sys.executable, "-c", "import sys, fork_entries; sys.exit(fork_entries.holds_the_rendezvous([]))")}
    assert spawn_local([], 3, role, **how) == 0


def test_a_fork_server_that_cannot_import_starts_no_rank_and_says_why(capfd, fork_entries):
    assert spawn_local([], 3, role, fork=fork_entries("report", prepare="broken_prepare")) == 1
    captured = capfd.readouterr()
    assert "ImportError: no module named 'diffusers'" in captured.err
    assert "hpcnft: cannot start the ranks: the fork server failed (exit code 1) before it started the ranks" \
        in captured.err and "rank " not in captured.out


def test_a_stop_signal_while_the_fork_server_imports_starts_no_rank(capfd, fork_entries):
    """SIGTERM to the spawner before its ranks exist (kept by preempt.catch_early): the server
    forks nothing, the job ends 75 saying so."""
    import signal

    from hpcnft.distributed import preempt

    previous = signal.getsignal(signal.SIGTERM)
    try:
        preempt.catch_early()
        os.kill(os.getpid(), signal.SIGTERM)
        assert spawn_local([], 3, role, fork=fork_entries("report")) == 75
    finally:
        signal.signal(signal.SIGTERM, previous)
        preempt._early.clear()
    captured = capfd.readouterr()
    assert "SIGTERM before the ranks started: nothing to save" in captured.err
    assert "rank " not in captured.out


def test_ranks_fork_only_where_no_rank_can_use_a_gpu(monkeypatch):
    from importlib import metadata

    from hpcnft.distributed import spawner

    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0+cpu")
    assert spawner.ranks_can_fork("auto")  # a CPU-only torch
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0+cu128")
    assert not spawner.ranks_can_fork("auto")  # the ranks may take a GPU
    assert not spawner.ranks_can_fork("cuda")
    assert spawner.ranks_can_fork("cpu")


@pytest.mark.parametrize("device,forked", [("cpu", True), ("cuda", False)])
def test_the_spawner_imports_no_torch_and_a_cpu_jobs_ranks_are_forked_into_their_entry(tmp_path, device, forked):
    """`hpcnft run` with no launcher, up to the moment it starts the ranks: the spawner has
    imported no torch, for a GPU job (its ranks are new interpreters running hpcnft.run.rank)
    and a CPU job alike (a fork server preloads hpcnft.run.rank and forks ranks into its main);
    the ranks get no arguments, the resolved config is handed over (run.rank.START_ENV)."""
    probe = ("import json, sys\n"
             "from hpcnft.distributed import spawner\n"
             "def record(argv, world, role_of, fork=None, **kw):\n"
             "    print(json.dumps({'torch': 'torch' in sys.modules, 'argv': argv, 'world': world, 'fork': fork,\n"
             "                      'command': list(kw.get('command', spawner.RANK_COMMAND)),\n"
             "                      'handed': json.loads(kw['env']['HPCNFT_START'])}))\n"
             "    return 0\n"
             "spawner.spawn_local = record\n"
             "from hpcnft.cli.main import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HPCNFT_LAUNCHER")}
    run_dir = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", probe, "run", "tiny", "--run-dir", run_dir, "--set",
                        f"layout.device={device}"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    handed = seen.pop("handed")
    assert seen == {"torch": False, "argv": [], "world": 3,
                    "fork": ["hpcnft.run.rank:preload", "hpcnft.run.rank:main"] if forked else None,
                    "command": [sys.executable, "-P", "-m", "hpcnft.run.rank"]}
    assert (handed["recipe"], handed["overrides"]) == ("tiny", [f"layout.device={device}"])
    assert handed["config"]["run_dir"] == run_dir and handed["config"]["layout"]["device"] == device


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
    assert spawn(script) == 0


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
    assert spawn_local([], 3, role, command=(sys.executable, "-c", script), resume_hint=lambda: "`hpcnft run x` ...") \
        == 130
    err = capfd.readouterr().err
    assert err == ("hpcnft: interrupted: the ranks checkpoint at the end of the step under way and stop "
                   "(Ctrl-C again stops them at once)\n")


def test_a_second_ctrl_c_stops_the_ranks_at_once_and_says_how_to_resume(capfd, tmp_path):
    interrupt_after_forwarding(2)
    # a step that would outlast the test, after which a rank leaves a mark: none must be left
    script = INTERRUPTIBLE.replace("STEP_S", "120").replace(
        "sys.exit(130)", f"open({str(tmp_path / 'finished')!r} + os.environ['RANK'], 'w'); sys.exit(130)")
    script = "import os\n" + script
    hint = "no checkpoint was written: `hpcnft run x` starts the run over"  # as the run dir is then
    assert spawn_local([], 3, role, command=(sys.executable, "-c", script), resume_hint=lambda: hint) == 130
    assert not list(tmp_path.iterdir())
    lines = capfd.readouterr().err.splitlines()
    assert lines[1] == f"hpcnft: interrupted again: the ranks are stopped at once; {hint}" and len(lines) == 2 \
        and "failed" not in lines[0]


def test_the_rank_that_claimed_the_failure_is_named_not_the_first_to_exit(capfd, tmp_path):
    """Rank 2 fails first (it claims the failure), rank 1 notices and exits before it does."""
    script = ("import os, sys, time; r = int(os.environ['RANK'])\n"
              "if r == 1: sys.exit(1)\n"
              "time.sleep(1.5); sys.exit(1 if r == 2 else 0)")
    from hpcnft.run.failures import FailureClaim

    os.makedirs(tmp_path / "logs")
    claim = FailureClaim(str(tmp_path))
    claim.claim(2)
    assert spawn(script, failure_claim=claim) == 1
    err = capfd.readouterr().err
    assert err == "hpcnft: rank 2 (reward) failed; stopping the other ranks\n"
