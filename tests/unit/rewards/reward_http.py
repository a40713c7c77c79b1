"""A scoring server on a free loopback port for the duration of a test."""
from __future__ import annotations

import contextlib

from hpcnft.rewards.http_server import serve_in_thread


@contextlib.contextmanager
def serving(server):
    """Serve `server` (an http.server instance) in a thread; shut it down and close it after."""
    serve_in_thread(server)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
