"""A dead rank ends the whole job, naming the rank; nothing written is lost. A dead spawner
leaves no rank behind; a stop signal before the job began is a preemption with nothing saved; a
remote judge that drips its answer ends the job within the term's timeout_s, naming it, in one
line on the terminal; Ctrl-C checkpoints and says the command that resumes."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import psutil

from jobs import TINY_ARGS, TINY_STEPS, assert_same_metrics, copy_run, hpcnft, rank_pids, start, wait_for_line
from hpcnft.io.runfile import read_run
from hpcnft.rewards.http_server import serve_in_thread

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("victim,role", [(2, "reward"), (1, "train")])
def test_killing_a_rank_ends_the_job_naming_it(tmp_path, victim, role):
    run_dir = str(tmp_path / f"kill-{victim}")
    proc = start("run", "tiny", "--steps", "20", "--run-dir", run_dir)
    wait_for_line(proc, "step 2/20")
    rows_before = read_run(run_dir).metrics["train/nft_loss"].shape[0]
    os.kill(rank_pids(proc.pid)[victim], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)  # a job that outlives its dead rank is a hang
    assert proc.returncode == 128 + signal.SIGKILL, err  # the job's code names the signal (docs/run_file.md)
    assert f"rank {victim} ({role}) failed: killed by SIGKILL" in err
    # last, how to go on (no checkpoint yet at step 2: tiny's come every 5 steps)
    assert err.splitlines()[-1] == f"hpcnft: no checkpoint was written: `hpcnft run tiny --run-dir {run_dir} " \
                                   "--steps 20` starts the run over", err
    run = read_run(run_dir)  # readable, and every row written before the fault is still there
    assert run.metrics["train/nft_loss"].shape[0] >= rows_before
    assert run.metrics["train/nft_loss"][:, 0].tolist()[:2] == [1.0, 2.0]
    # the failure is recorded at the step it happened in, the one after the last row or that row
    last = int(run.metrics["train/nft_loss"][-1, 0])
    errors = [e["step"] for e in run.events if e["kind"] == "error"]
    assert errors and all(last <= step <= last + 1 for step in errors), (last, errors)


def test_under_torchrun_a_killed_rank_ends_the_job_with_torchruns_code(tmp_path):
    """torchrun, not hpcnft, decides the job's code: 1 for any failed rank (docs/run_file.md)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "-m", "hpcnft", "run", "tiny", "--steps", "20", "--run-dir", str(tmp_path / "torchrun")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "step 2/20")
    ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
             if "hpcnft" in " ".join(p.cmdline())}
    ranks[1].kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in err, err[-3000:]


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_killed_spawner_leaves_no_rank_and_the_run_resumes_bit_for_bit(tmp_path, tiny_run):
    """The OOM killer's SIGKILL of `hpcnft run`: its ranks hear of it (SIGHUP), checkpoint the
    step under way and leave, well within layout.timeout_s; the next start takes the run dir and
    ends with the uninterrupted run's bits."""
    import time

    run_dir = copy_run(tiny_run, str(tmp_path / "orphaned"), keep_checkpoints_through=1)
    proc = start("run", "tiny", "--steps", str(TINY_STEPS), "--run-dir", run_dir, *TINY_ARGS)
    wait_for_line(proc, "hpcnft: resuming after step 1")
    ranks = [psutil.Process(pid) for pid in rank_pids(proc.pid).values()]
    assert len(ranks) == 3
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 300  # layout.timeout_s is 600
    while still_running(ranks):
        assert time.monotonic() < deadline, f"ranks left running: {still_running(ranks)}"
        time.sleep(0.1)
    stops = [e for e in read_run(run_dir).events if e["kind"] == "signal"]
    assert stops and stops[-1]["text"].startswith("SIGHUP: checkpointed step"), stops
    again = hpcnft("run", "tiny", "--steps", str(TINY_STEPS), "--run-dir", run_dir, *TINY_ARGS)
    assert "in use" not in again.stderr
    assert_same_metrics(tiny_run.run_dir, run_dir)


def test_a_stop_signal_before_the_job_began_is_a_preemption_with_nothing_saved(tmp_path):
    proc = start("run", "tiny", "--steps", "2", "--run-dir", str(tmp_path / "early"))
    wait_for_line(proc, "hpcnft: run dir")  # the spawner starts its ranks: they are importing
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, out + err
    assert "nothing to save" in err and "failed" not in err and "Traceback" not in err, err


class DrippingJudge(BaseHTTPRequestHandler):
    """Reads the request, then answers a byte every 0.5 s: never a whole answer in time."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")  # within what 4 scores may take
        self.end_headers()
        while not self.server.stopping.is_set():
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return
            self.server.stopping.wait(0.5)


def test_a_judge_that_drips_its_answer_ends_the_job_within_timeout_s_naming_the_term(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), DrippingJudge)
    server.daemon_threads, server.stopping = True, threading.Event()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/score/ocr"
    term = f'{{kind="remote", name="ocr", url="{url}", timeout_s=2.0, retries=0}}'
    serve_in_thread(server)
    try:
        proc = start("run", "tiny", "--steps", "2", "--run-dir", str(tmp_path / "dripped"),
                     "--set", f"reward.terms=[{term}]")
        out, err = proc.communicate(timeout=300)  # under layout.timeout_s (120 s), which would end it too
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
    # a judge that never answers in time is one that is unavailable: no retries asked for, the
    # job stops at once, with nothing finished to keep (exit 69, not a failure of a rank)
    assert proc.returncode == 69, out + err
    why = f"reward term 'ocr' (remote {url}): timed out: no whole answer within 2 s (timeout_s) after 1 attempt"
    assert err == f"hpcnft: {why}; no step was finished: nothing to save\n", err


def test_ctrl_c_checkpoints_says_how_to_resume_once_and_that_command_resumes_bit_for_bit(tmp_path, tiny_run):
    """A terminal's Ctrl-C reaches the whole process group: spawner and ranks. The run has no
    --run-dir (auto-named), so the command printed must name it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    proc = subprocess.Popen([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", str(TINY_STEPS), *TINY_ARGS],
                            cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = wait_for_line(proc, "step 1/3")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    out = "".join(seen) + out
    assert proc.returncode == 130, out + err
    said = re.findall(r"^hpcnft: interrupted at step (\d+): checkpointed; `(.+)` resumes it$", out, re.M)
    assert len(said) == 1, out
    step, command = int(said[0][0]), shlex.split(said[0][1])
    assert step < TINY_STEPS and "Traceback" not in out + err and "failed" not in err, err
    assert err == ("hpcnft: interrupted: the ranks checkpoint at the end of the step under way and stop "
                   "(Ctrl-C again stops them at once)\n")
    run_dir = str(tmp_path / command[command.index("--run-dir") + 1])
    assert command[:3] == ["hpcnft", "run", "tiny"] and run_dir.startswith(str(tmp_path / "runs" / "tiny-"))
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{step:06d}"))
    again = subprocess.run([sys.executable, "-m", "hpcnft", *command[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f"hpcnft: resuming after step {step} from" in again.stdout, again.stderr
    assert_same_metrics(tiny_run.run_dir, run_dir)


def test_a_double_ctrl_c_before_any_checkpoint_says_the_command_starts_over(tmp_path):
    """Stopped at once while the models load: nothing was checkpointed, and the line says so rather
    than promising a resume."""
    run_dir = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "HPCNFT_LAUNCHER")
           and not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-m", "hpcnft", "run", "tiny", "--run-dir", run_dir], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_line(proc, "loading the models")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1)  # two signals sent together would arrive as one
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    again = [line for line in err.splitlines() if line.startswith("hpcnft: interrupted again")]
    assert again == ["hpcnft: interrupted again: the ranks are stopped at once; no checkpoint was written: "
                     f"`hpcnft run tiny --run-dir {run_dir} --steps 20` starts the run over"], err
    assert not os.path.isdir(os.path.join(run_dir, "checkpoints")) or not os.listdir(
        os.path.join(run_dir, "checkpoints"))


def test_a_run_whose_output_reader_dies_checkpoints_its_step_and_stops(tmp_path):
    """`hpcnft run ... | cat` and the reader killed (a pager quit, a terminal that hung up): rank
    0's next progress line meets a closed pipe. It stops printing, the ranks checkpoint the step
    under way and stop as on SIGHUP (exit 75, not requeued); nothing dies of BrokenPipeError."""
    run_dir = str(tmp_path / "piped")
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", "20", "--run-dir", run_dir],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        wait_for_line(proc, "step 1/20")
        proc.stdout.close()  # the reader goes
        code = proc.wait(timeout=300)
        err.seek(0)
        said = err.read()
    assert code == 75, said
    assert "Traceback" not in said and "BrokenPipe" not in said and "Exception ignored" not in said, said
    stops = [e for e in read_run(run_dir).events if e["kind"] == "signal"]
    assert len(stops) == 1 and stops[0]["text"].startswith("its output was closed: checkpointed step "), stops
    step = stops[0]["step"]
    assert 2 <= step < 20 and os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{step:06d}"))
    assert read_run(run_dir).metrics["train/nft_loss"][:, 0].tolist() == [float(s) for s in range(1, step + 1)]
