"""What the scoring server (http_server.py) lets clients hold, kept on its event loop's thread:

- `Connections`: at most `max_connections` open, at most `max_per_address` from one address. A
  connection beyond either evicts the oldest one that is still waiting for its request head (or
  draining a refused body) and has waited at least `evict_after_s`: an idle or trickling
  socket never keeps out a client that sends its request at once. With none to evict, the new
  one is turned away (503).
- `Admission`: at most `max_requests` requests admitted at once, and the body bytes they hold
  (`max_bytes`), counted as the bytes arrive, not as a Content-Length declares them: a client
  that declares a large body and trickles it holds what it sent. A body that does not fit waits
  for room (up to the server's busy wait); when every request holding bytes waits for room,
  none can finish, and the newest of them is refused so that the older ones go on.
- `LogLimiter`: error lines at most `burst` at once, then `per_s` a second; the lines left out
  are counted in one line when lines may come again.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


def check_limits(max_requests: int, max_connections: int, max_per_address: int, body_budget_bytes: int,
                 head_deadline_s: float, min_body_rate: float, busy_wait_s: float) -> None:
    if max_requests < 1:
        raise ValueError(f"max_requests must be at least 1, got {max_requests}")
    if max_connections < max_requests:
        raise ValueError(f"max_connections must be at least max_requests ({max_requests}), got {max_connections}")
    if max_per_address < 1:
        raise ValueError(f"max_per_address must be at least 1, got {max_per_address}")
    if body_budget_bytes < 1:
        raise ValueError(f"body_budget_bytes must be at least 1, got {body_budget_bytes}")
    if not (math.isfinite(head_deadline_s) and head_deadline_s > 0):
        raise ValueError(f"head_deadline_s must be a positive number of seconds, got {head_deadline_s}")
    if not (math.isfinite(min_body_rate) and min_body_rate > 0):
        raise ValueError(f"min_body_rate must be a positive number of bytes a second, got {min_body_rate}")
    if not (math.isfinite(busy_wait_s) and busy_wait_s >= 0):
        raise ValueError(f"busy_wait_s must be a number of seconds >= 0, got {busy_wait_s}")


class Busy(Exception):
    """The body bytes a request needs did not fit within the wait, or it had to give way."""


@dataclass(eq=False)
class Connection:
    """One open connection: its peer address, when it opened, how to end it (`close`: abort the
    socket, cancel its handler), whether it may be evicted, and the body bytes it holds."""
    address: str
    opened: float
    close: Callable[[], None]
    evictable: bool = True  # waiting for its request head, or draining a refused body
    held: int = 0
    order: int = 0  # when it was admitted as a request (Admission): newer ones give way first
    waiting_for: int = 0  # body bytes it waits for room for (Admission)


class Connections:
    def __init__(self, max_connections: int, max_per_address: int, evict_after_s: float, clock=time.monotonic):
        self.max_connections, self.max_per_address, self.evict_after_s = max_connections, max_per_address, evict_after_s
        self.clock = clock
        self.open: dict[Connection, None] = {}  # in the order they opened
        self.per_address: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return len(self.open)

    def _oldest_evictable(self, address: str | None) -> Connection | None:
        now = self.clock()
        for conn in self.open:
            if conn.evictable and (address is None or conn.address == address) and \
                    now - conn.opened >= self.evict_after_s:
                return conn
            if now - conn.opened < self.evict_after_s:
                return None  # the rest are younger still
        return None

    def admit(self, address: str, close: Callable[[], None]) -> tuple[Connection | None, list[Connection]]:
        """(the new connection, or None: turned away; the connections evicted for it, closed)."""
        evicted = []
        if self.per_address[address] >= self.max_per_address:
            victim = self._oldest_evictable(address)
            if victim is None:
                return None, evicted
            evicted.append(victim)
            self.remove(victim)
        if len(self.open) >= self.max_connections:
            victim = self._oldest_evictable(None)
            if victim is None:
                return None, evicted
            evicted.append(victim)
            self.remove(victim)
        for victim in evicted:
            victim.close()
        conn = Connection(address, self.clock(), close)
        self.open[conn] = None
        self.per_address[address] += 1
        return conn, evicted

    def remove(self, conn: Connection) -> None:
        if self.open.pop(conn, False) is None:
            self.per_address[conn.address] -= 1
            if not self.per_address[conn.address]:
                del self.per_address[conn.address]


@dataclass(eq=False)
class _Waiter:
    conn: Connection
    nbytes: int
    granted: asyncio.Future = field(default=None)


class Admission:
    """Places for `max_requests` requests, and `max_bytes` of body bytes among them. Read from
    other threads (the health answer, tests) as plain numbers: `requests`, `waiting`, `bytes`."""

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = self.bytes = 0
        self._places: collections.deque[asyncio.Future] = collections.deque()
        self._room: list[_Waiter] = []
        self._holders: dict[Connection, None] = {}
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        """Requests waiting for a place."""
        return sum(not f.done() for f in self._places)

    async def enter(self, conn: Connection, wait_s: float) -> bool:
        """A place for `conn`'s request, waiting up to `wait_s` for one; False if none came."""
        if self.requests < self.max_requests and not self._places:
            return self._admitted(conn)
        granted = asyncio.get_running_loop().create_future()
        self._places.append(granted)
        try:
            async with asyncio.timeout(wait_s):
                await granted
        except TimeoutError:
            pass
        finally:
            if granted in self._places:
                self._places.remove(granted)
        if granted.done() and not granted.cancelled():
            return self._admitted(conn, counted=True)
        return False

    def _admitted(self, conn: Connection, counted: bool = False) -> bool:
        self.requests += not counted
        conn.order = next(self._order)
        return True

    def leave(self, conn: Connection) -> None:
        """`conn`'s request is over: its place passes on, its bytes are given back."""
        self.give(conn, conn.held)
        while self._places:
            granted = self._places.popleft()
            if not granted.done():
                granted.set_result(None)  # the place passes on as it is: `requests` stays
                return
        self.requests -= 1

    async def take(self, conn: Connection, nbytes: int, wait_s: float) -> float:
        """Room for `nbytes` more body bytes of `conn`'s request, waiting up to `wait_s`; the
        seconds it waited. Busy if it did not come, or the request had to give way."""
        if not self._room and self.bytes + nbytes <= self.max_bytes:
            self._hold(conn, nbytes)
            return 0.0
        t0 = time.monotonic()
        waiter = _Waiter(conn, nbytes, asyncio.get_running_loop().create_future())
        self._room.append(waiter)
        conn.waiting_for = nbytes
        self._settle()
        try:
            async with asyncio.timeout(wait_s):
                await waiter.granted
        except TimeoutError:
            pass
        finally:
            conn.waiting_for = 0
            if waiter in self._room:
                self._room.remove(waiter)
                self._settle()
        if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.result():
            return time.monotonic() - t0
        raise Busy

    def _hold(self, conn: Connection, nbytes: int) -> None:
        self.bytes += nbytes
        conn.held += nbytes
        if conn.held:
            self._holders[conn] = None

    def give(self, conn: Connection, nbytes: int) -> None:
        """`conn` gives back `nbytes` of what it holds."""
        nbytes = min(nbytes, conn.held)
        self.bytes -= nbytes
        conn.held -= nbytes
        if not conn.held:
            self._holders.pop(conn, None)
        self._settle()

    def _settle(self) -> None:
        """Grant the waiting bodies room in the order they asked while it lasts; then, if every
        request that holds bytes is itself waiting for room, none of them can finish: the newest
        waiter gives way (Busy), and the rest are looked at again."""
        while self._room:
            while self._room and self.bytes + self._room[0].nbytes <= self.max_bytes:
                waiter = self._room.pop(0)
                if not waiter.granted.done():
                    self._hold(waiter.conn, waiter.nbytes)
                    waiter.granted.set_result(True)
            if not self._room or any(not c.waiting_for for c in self._holders):
                return
            newest = max(self._room, key=lambda w: w.conn.order)
            self._room.remove(newest)
            newest.conn.waiting_for = 0
            if not newest.granted.done():
                newest.granted.set_result(False)


class LogLimiter:
    """`log` with at most `burst` lines at once and `per_s` a second after that; the lines left
    out are counted in one line before the next that passes, or at `flush()`. Thread-safe."""

    def __init__(self, log, burst: int = 20, per_s: float = 2.0, clock=time.monotonic):
        self.log, self.burst, self.per_s, self.clock = log, burst, per_s, clock
        self.tokens, self.at, self.left_out = float(burst), clock(), 0
        self.lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now

    def __call__(self, line: str) -> None:
        with self.lock:
            self._refill()
            if self.tokens < 1:
                self.left_out += 1
                return
            self.tokens -= 1
            self._say_left_out()
            self.log(line)

    def flush(self) -> None:
        with self.lock:
            self._refill()
            if self.left_out and self.tokens >= 1:
                self.tokens -= 1
                self._say_left_out()

    def _say_left_out(self) -> None:
        if self.left_out:
            self.log(f"reward server: {self.left_out} more error line{'s' if self.left_out > 1 else ''} left out "
                     f"(at most {self.burst} at once, then {self.per_s:g} a second)")
            self.left_out = 0
