"""hpcnft.distributed.preempt and the rank's way out: the requeue passes the job id as one argument, a late
signal after the flag is retired passes through shutdown, rank_main retires its flag on every way
out, Slurm's own SIGTERM leaves the requeue to Slurm, and a failed log line keeps the signal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest




def test_requeue_passes_the_job_id_as_one_argument(tmp_path, monkeypatch):
    from hpcnft.distributed.preempt import requeue

    fake = tmp_path / "scontrol"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    job = "123; touch MARKER $(touch M2)"
    assert requeue(job, types.SimpleNamespace(info=lambda *a: None)) == f"requeued Slurm job {job}"
    assert json.loads((tmp_path / "argv.json").read_text()) == ["requeue", job]
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "M2").exists()


_LATE_SIGNAL = r"""
import logging, signal, sys
from hpcnft.distributed.preempt import PreemptFlag
flag = PreemptFlag("SIGUSR2", True, logging.getLogger("t"))
if sys.argv[1] == "retired":
    flag.retire()
# What CPython does when it shuts down: a signal with a Python handler goes back to its default.
for s in (signal.SIGUSR2, signal.SIGTERM):
    if callable(signal.getsignal(s)):
        signal.signal(s, signal.SIG_DFL)
signal.raise_signal(signal.SIGUSR2)
signal.raise_signal(signal.SIGTERM)
print("finished")
"""


def test_a_retired_preempt_flag_lets_a_late_signal_pass_through_shutdown():
    import signal

    done = subprocess.run([sys.executable, "-c", _LATE_SIGNAL, "retired"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr
    killed = subprocess.run([sys.executable, "-c", _LATE_SIGNAL, "active"], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGUSR2  # what a rank without retire() meets


_RANK_MAIN_OUT_EARLY = r"""
import signal, sys
import torch.distributed as dist
from hpcnft.algo.root_config import load_config
from hpcnft.common.errors import EXIT_BAD_INPUT
from hpcnft.distributed.detect import detect
from hpcnft.distributed.spawner import free_port
from hpcnft.run.entry import rank_main
cfg = load_config("tiny", [f"models.sd3_dir={sys.argv[1]}/missing"], run_dir=f"{sys.argv[1]}/run")
launch = detect({"MASTER_PORT": str(free_port())})  # not 29500, which another job may hold
assert rank_main(cfg, launch, "tiny") == EXIT_BAD_INPUT  # out early: a missing model folder
assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # preempt.handle_sigterm
assert not dist.is_initialized()  # nor a process group
print("ok")
"""


def test_rank_main_retires_its_preempt_flag_on_every_way_out(tmp_path):
    # in a process of its own: a rank renames its process and owns its signals and stderr
    r = subprocess.run([sys.executable, "-c", _RANK_MAIN_OUT_EARLY, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]


def test_slurms_own_sigterm_leaves_the_requeue_to_slurm():
    from hpcnft.distributed.preempt import leave_requeue_to_slurm

    assert leave_requeue_to_slurm("SIGUSR2", "SIGUSR2") is None  # the time-limit warning: requeue
    assert leave_requeue_to_slurm("", "SIGUSR2") is None  # the reward rank's signal: requeue
    assert leave_requeue_to_slurm("SIGTERM", "SIGTERM") is None  # SIGTERM as the configured warning
    why = leave_requeue_to_slurm("SIGTERM", "SIGUSR2")  # scancel, scontrol requeue, time limit
    assert why.startswith("SIGTERM: Slurm is ending the job") and "not requeued" in why


def test_a_preempt_signal_is_kept_when_its_log_line_fails():
    import logging
    import signal

    from hpcnft.distributed.preempt import PreemptFlag

    class Broken(logging.Handler):
        def handle(self, record):  # a write that fails outright (not through handleError)
            raise RuntimeError("reentrant call inside <_io.BufferedWriter>")

    log = logging.getLogger("hpcnft-test-broken-log")
    log.handlers[:], log.propagate = [Broken()], False
    previous = signal.getsignal(signal.SIGUSR2)
    flag = PreemptFlag("SIGUSR2", False, log)
    try:
        with pytest.raises(RuntimeError, match="reentrant"):
            signal.raise_signal(signal.SIGUSR2)
        assert flag.requested and flag.signal_name == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, previous)


_EARLY = r"""
import logging, os, signal, sys
from hpcnft.distributed import preempt
preempt.catch_early()
os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # lands while the rank would be importing
flag = preempt.PreemptFlag("SIGUSR2", sys.argv[2] == "handle", logging.getLogger("t"))
print(flag.requested, flag.signal_name)
"""


@pytest.mark.parametrize("sig,handle,out,code", [("SIGTERM", "handle", "True SIGTERM", 0),
                                                 ("SIGUSR2", "-", "True SIGUSR2", 0),
                                                 ("SIGHUP", "-", "True SIGHUP", 0),
                                                 ("SIGTERM", "-", "", -15)])
def test_a_stop_signal_before_the_flag_exists_is_handed_to_it(sig, handle, out, code):
    """Kept by catch_early and acted on by the flag; a signal the flag does not take (SIGTERM
    with preempt.handle_sigterm off) gets its default action once the flag is made."""
    r = subprocess.run([sys.executable, "-c", _EARLY, sig, handle], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (code, out), r.stderr


def test_sighup_stops_without_a_requeue():
    from hpcnft.distributed.preempt import leave_requeue_to_slurm

    why = leave_requeue_to_slurm("SIGHUP", "SIGUSR2")
    assert why and why.startswith("SIGHUP: the process that started the ranks") and "not requeued" in why


_ORPHAN = r"""
import os, signal, subprocess, sys, time
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", str(os.getpid()), sys.argv[3]])
    time.sleep(600)
else:
    from hpcnft.distributed.spawner import end_with_parent
    got = []
    signal.signal(signal.SIGHUP, lambda s, f: got.append(s))
    assert end_with_parent(int(sys.argv[2]))
    open(sys.argv[3] + ".ready", "w").close()
    while not got:
        time.sleep(0.02)
    open(sys.argv[3], "w").write(f"SIGHUP after parent {sys.argv[2]} died; ppid now {os.getppid()}")
"""


def test_a_rank_hears_its_spawners_death(tmp_path):
    """PR_SET_PDEATHSIG: the OOM killer's SIGKILL of the spawner reaches its ranks as SIGHUP."""
    import signal
    import time

    marker = str(tmp_path / "heard")
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, "parent", _ORPHAN, marker])
    deadline = time.monotonic() + 120
    while not os.path.exists(marker + ".ready"):
        assert parent.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    while not os.path.exists(marker) or not open(marker).read():
        assert time.monotonic() < deadline, "the orphan never heard of its parent's death"
        time.sleep(0.05)
    assert open(marker).read().startswith(f"SIGHUP after parent {parent.pid} died")
