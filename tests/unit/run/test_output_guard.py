"""A write to a pipe whose reader has gone stops the printing, never the process: the stream's
descriptor then points to /dev/null, the process is told once (a rank asks for a checkpointed
stop), and the interpreter's last flush cannot fail either."""
from __future__ import annotations

import subprocess
import sys

PRINTER = """
import sys
{guard}
sys.stdin.readline()  # the parent has closed its end of stdout by now
for i in range(1000):
    print(f"line {{i}}", flush=True)
    print(f"unflushed {{i}}")  # left for the interpreter's last flush
sys.stderr.write(f"closed {{len(calls)}} done\\n")
"""
GUARDED = ("from hpcnft.run.output_guard import guard_std_streams\n"
           "calls = []\n"
           "guard_std_streams(lambda: calls.append(1))")


def printer_with_its_reader_gone(guard: str) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-c", PRINTER.format(guard=guard)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


def test_without_the_guard_a_closed_reader_kills_the_printer():
    code, err = printer_with_its_reader_gone("calls = []")
    assert code != 0 and "BrokenPipeError" in err


def test_a_closed_reader_stops_the_printing_and_is_said_once():
    code, err = printer_with_its_reader_gone(GUARDED)
    assert (code, err) == (0, "closed 1 done\n")


def test_a_stop_asked_for_a_closed_output_is_not_requeued():
    import signal

    from hpcnft.distributed.preempt import OUTPUT_CLOSED, PreemptFlag, leave_requeue_to_slurm

    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, text, *args):
            self.lines.append(text % args)

    log = Log()
    handled = (signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in handled}
    flag = PreemptFlag("SIGUSR2", True, log)
    try:
        flag.request(OUTPUT_CLOSED)
        flag.request(OUTPUT_CLOSED)
        assert flag.requested and flag.signal_name == OUTPUT_CLOSED and not flag.interrupted
        assert log.lines == [f"{OUTPUT_CLOSED}: will checkpoint and stop at the end of this iteration"]
        assert "not requeued" in leave_requeue_to_slurm(flag.signal_name, "SIGUSR2")
    finally:
        for signum, handler in before.items():  # this test's process is pytest's
            signal.signal(signum, handler)
