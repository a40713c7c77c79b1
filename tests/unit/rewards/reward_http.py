"""A scoring server on a free loopback port for the duration of a test, and clients that speak
to it below http.client's checks: a raw head, a body sent a byte at a time, retries on 503."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import socket
import time

from hpcnft.rewards.http_protocol import CONTENT_TYPE
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


def head(path: str, length: int | None, content_type: str = CONTENT_TYPE, method: str = "POST") -> bytes:
    """A request's line and headers, as bytes (a path may hold any byte)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def connect(port: int, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_answer(sock: socket.socket) -> tuple[int, dict, dict]:
    """(status, headers, JSON payload) of the answer on `sock`."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, dict(response.getheaders()), json.loads(response.read())


def send_post(port: int, path: str, body: bytes, content_type: str = CONTENT_TYPE,
              timeout: float = 30) -> tuple[int, dict, dict]:
    """(status, headers, JSON payload) of one POST; the whole body is sent before the answer is read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def post_until_answered(port: int, path: str, body: bytes, hang_guard_s: float = 60) -> tuple[int, dict, int]:
    """POST until the answer is not 503, waiting Retry-After seconds after each 503:
    (status, payload, how many 503s came first)."""
    deadline, busy = time.monotonic() + hang_guard_s, 0
    while True:
        status, headers, payload = send_post(port, path, body)
        if status != 503:
            return status, payload, busy
        busy += 1
        assert time.monotonic() < deadline, f"still 503 after {busy} tries: {payload}"
        time.sleep(float(headers["Retry-After"]))


def drip_until_closed(sock: socket.socket, data: bytes, every_s: float = 0.05, hang_guard_s: float = 30) -> bytes:
    """Send `data` a byte at a time, `every_s` apart, until the server closes the connection;
    what it sent back. AssertionError if it is still open after `hang_guard_s`."""
    received, deadline = [], time.monotonic() + hang_guard_s
    for byte in (data[i:i + 1] for i in range(len(data))):
        assert time.monotonic() < deadline, "the server kept a dripping connection open"
        try:
            sock.sendall(byte)
            while select.select([sock], [], [], every_s)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return b"".join(received)
                received.append(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return b"".join(received)
    raise AssertionError("the drip ended before the server closed the connection")


def wait_for_port(proc, port_file: str, hang_guard_s: float = 300) -> int:
    """The port a `hpcnft reward-server --port-file` process listens on, once it has written it."""
    deadline = time.monotonic() + hang_guard_s
    while not os.path.exists(port_file):
        assert proc.poll() is None, f"reward-server exited {proc.returncode}"
        assert time.monotonic() < deadline, "reward-server never wrote its port"
        time.sleep(0.05)
    with open(port_file) as f:
        return int(f.read())
