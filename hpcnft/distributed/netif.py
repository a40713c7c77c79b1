"""Which network interface a rank's collectives use, and how it reaches the master.

Left alone, gloo binds the address its host's name resolves to and NCCL the first interface by
its own ranking, which on a cluster node can be a container bridge or a management network the
other nodes cannot reach. The node's own name is what Slurm's node list gives the other ranks,
so the interface that holds the address of that name is the one they reach this rank on:
`bind_collectives` exports it as ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (each only where
the user has not set it). A name that resolves to loopback (a single workstation) sets nothing,
so a one-node job keeps loopback. The pure parts take the resolved addresses and the interface
table as arguments; `local_interfaces` and `resolve` read them from this node.
"""
from __future__ import annotations

import ipaddress
import re
import os
import socket
from typing import Mapping, MutableMapping, Sequence

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _plain(addr: str) -> str:
    """An address without an IPv6 zone (``fe80::1%eth0``)."""
    return addr.split("%", 1)[0]


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(_plain(addr)).is_loopback
    except ValueError:
        return False


def interface_holding(addr: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that holds ADDR (interfaces: name -> its addresses), or None."""
    want = _plain(addr)
    for name, addrs in interfaces.items():
        if any(_plain(a) == want for a in addrs):
            return name
    return None


def own_interface(host_addrs: Sequence[str], interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface of the first non-loopback address the node's name resolves to that one of
    this node's interfaces holds; None when the name resolves to loopback only (or to nothing here)."""
    for addr in host_addrs:
        if not _is_loopback(addr):
            name = interface_holding(addr, interfaces)
            if name is not None:
                return name
    return None


def bind_env(env: Mapping[str, str], host_addrs: Sequence[str],
             interfaces: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The socket-interface variables to set: each of SOCKET_IFNAME_VARS that ENV leaves unset
    (or empty), naming the node's own interface (see own_interface); {} when there is none."""
    name = own_interface(host_addrs, interfaces)
    if name is None:
        return {}
    return {var: name for var in SOCKET_IFNAME_VARS if not (env.get(var) or "").strip()}


def resolve(host: str) -> list[str]:
    """The addresses HOST resolves to on this node, in the resolver's order ([] if none)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    seen: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in seen:
            seen.append(addr)
    return seen


def local_interfaces() -> dict[str, list[str]]:
    """This node's interfaces and their IP addresses."""
    import psutil  # lazy: only ranks that start a process group need it

    return {name: [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def bind_collectives(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Export the node's own interface for gloo and NCCL where the user has not chosen one;
    returns the interface the collectives use (the user's, the one set here, or None: their default)."""
    chosen = bind_env(env, resolve(socket.gethostname()), local_interfaces())
    env.update(chosen)
    return (env.get(SOCKET_IFNAME_VARS[0]) or "").strip() or None


def route_to(master_addr: str, interfaces: Mapping[str, Sequence[str]] | None = None) -> str:
    """How this node reaches MASTER_ADDR, for a rendezvous that failed: ``10.0.0.1 from eth0
    (10.0.0.2)``, or why it cannot (the name does not resolve, no route)."""
    addrs = resolve(master_addr)
    if not addrs:
        return f"{master_addr} does not resolve on {socket.gethostname()}"
    target = addrs[0]
    family = socket.AF_INET6 if ":" in _plain(target) else socket.AF_INET
    try:
        # a datagram socket's connect only picks the route and source address; nothing is sent
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            source = str(probe.getsockname()[0])
    except OSError as e:
        return f"{target}: no route from {socket.gethostname()} ({e.strerror or e})"
    name = interface_holding(source, local_interfaces() if interfaces is None else interfaces)
    shown = target if target == master_addr else f"{master_addr} = {target}"
    return f"{shown} from interface {name or '?'} ({source}) of {socket.gethostname()}"


# gloo's wordings: "Connection closed by peer [ADDR]:PORT", "Read error [ADDR]:PORT: Connection
# reset by peer", "Write error [ADDR]:PORT: Broken pipe"
_PEER_RE = re.compile(r"(?:peer|Read error|Write error) \[([^\]]+)\]")


# What a collective raises when a peer went away (died, or closed its end after failing): gloo's
# wordings above, and NCCL's and the c10d store's
_LOST_PEER_RE = re.compile(r"Connection closed by peer|Connection reset by peer|Read error \[|Write error \[|"
                           r"Broken pipe|remote process exited|communicator was aborted|Socket Timeout|"
                           r"failed to recv, got 0 bytes")


def names_a_lost_peer(text: str) -> bool:
    """Whether an error only says that a peer of the job went away."""
    return bool(_LOST_PEER_RE.search(text))


def peers_named(text: str, hosts: Sequence[str], resolve_host=None) -> str:
    """Who the peers an error names by address are: ``node3 (rank 2)`` for each address in
    ``peer [ADDR]`` (gloo's wording) that one of the job's HOSTS (rank -> hostname) resolves to;
    "" when none is known. A lost connection then says which rank on which node went away."""
    resolve_host = resolve_host or resolve
    found: list[str] = []
    for addr in dict.fromkeys(_plain(a) for a in _PEER_RE.findall(text)):
        for host in dict.fromkeys(hosts):
            if addr in {_plain(a) for a in resolve_host(host)}:
                ranks = [str(r) for r, h in enumerate(hosts) if h == host]
                found.append(f"{host} (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})")
                break
    return ", ".join(found)
