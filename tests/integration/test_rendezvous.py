"""A rank that cannot rendezvous ends the job with one line naming the address and the fix, not
a traceback: here rank 0's master port is already taken on the node (a derived job port can
collide with any process there); and an IPv6 master address, bracketed where an address and a
port meet."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_", "TORCHELASTIC_")


def world1(tmp_path, master_addr: str, port: int, *sets: str) -> subprocess.CompletedProcess:
    """One rank under a launcher's environment (RANK, WORLD_SIZE, MASTER_*): the tiny job, 1 step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    over = [a for kv in ("layout.train_ranks=1", "layout.reward_ranks=0", *sets) for a in ("--set", kv)]
    return subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", "1", "--run-dir",
                           str(tmp_path / "run"), *over], capture_output=True, text=True, timeout=300, env=env)


def last_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return [line for line in r.stderr.splitlines() if line.strip()][-1]


def test_a_taken_master_port_is_one_line_naming_the_fix(tmp_path, hpcnft_cache):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("", 0))  # every IPv4 interface, as the TCPStore binds
        blocker.listen()
        port = blocker.getsockname()[1]
        r = world1(tmp_path, "127.0.0.1", port)
    assert last_error_line(r) == (f"hpcnft: rank 0 cannot listen on 127.0.0.1:{port}: the port is taken on this "
                                  f"node; set MASTER_PORT to a free port for this job"), r.stderr[-3000:]


def test_an_ipv6_master_address_rendezvous_and_runs(tmp_path, hpcnft_cache):
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    r = world1(tmp_path, "::1", port, "eval.at_end=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 1/1" in r.stdout


def test_a_taken_ipv6_master_port_names_the_bracketed_address(tmp_path, hpcnft_cache):
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as blocker:
        blocker.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        blocker.bind(("::", 0))  # every interface, both families
        blocker.listen()
        port = blocker.getsockname()[1]
        r = world1(tmp_path, "::1", port)
    assert last_error_line(r).startswith(f"hpcnft: rank 0 cannot listen on [::1]:{port}: "), r.stderr[-3000:]
