"""Entries for ranks forked by the fork server in tests/unit/distributed/test_spawn_local.py
(the server imports them by name: they must live in a module)."""
from __future__ import annotations

import atexit
import os
import sys


def prepare(argv):
    print(f"prepared in {os.getpid()}", flush=True)


def boom(argv):
    raise RuntimeError("boom in rank " + os.environ["RANK"])


def close_at_exit(argv):
    rank = os.environ["RANK"]
    atexit.register(lambda: open(os.path.join(argv[0], f"closed-{rank}"), "w").write(rank))
    return 0


def report(argv):
    """Each rank says who it is, who its parent is and what it inherited, then exits 0."""
    line = f"rank {os.environ['RANK']} pid {os.getpid()} ppid {os.getppid()} modules {'torch' in sys.modules}\n"
    os.write(1, line.encode())  # one write: the ranks' lines never interleave
    return 0


def broken_prepare(argv):
    raise ImportError("no module named 'diffusers'")


def holds_the_rendezvous(argv):
    """Rank 0 inherits a socket that already listens on MASTER_PORT, so no other process can bind
    that port; the other ranks get neither the variable nor the socket. Exit 0 when so."""
    import errno
    import socket

    port, held = int(os.environ["MASTER_PORT"]), os.environ.get("HPCNFT_MASTER_LISTEN_FD")
    if os.environ["RANK"] != "0":
        return 0 if held is None else 3
    with socket.socket(fileno=os.dup(int(held))) as rendezvous:
        if rendezvous.getsockname()[1] != port or not rendezvous.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return 4
    with socket.socket() as intruder:
        try:
            intruder.bind(("127.0.0.1", port))
        except OSError as e:
            return 0 if e.errno == errno.EADDRINUSE else 5
    return 6
