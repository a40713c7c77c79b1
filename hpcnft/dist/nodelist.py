"""Slurm host lists and the job's rendezvous port (pure: no torch, no MPI)."""
from __future__ import annotations

import re
import zlib

DEFAULT_PORT = 29500


class LaunchError(Exception):
    """The environment describes an impossible or inconsistent launch (one-line message)."""


class NodelistError(LaunchError, ValueError):
    """A Slurm host list that cannot be parsed."""


def job_port(job_id: str | None, base: int = 20000, span: int = 20000) -> int:
    """A port in [base, base+span) that every rank of one job derives alike; 29500 without a job.

    Numeric job ids map to ``base + id % span`` so jobs that run at the same time (nearby ids)
    get distinct ports; other ids (``123_4``, a PMIx namespace, an HNP URI) are CRC32-hashed.
    """
    if span < 1 or base < 1 or base + span > 65536:
        raise ValueError(f"job_port: bad range base={base} span={span}")
    if job_id is None or str(job_id).strip() == "":
        return DEFAULT_PORT
    s = str(job_id).strip()
    n = int(s) if s.isdigit() else zlib.crc32(s.encode())
    return base + n % span


_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(body: str, text: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = _RANGE_RE.match(part)
        if not m:
            raise NodelistError(f"bad range {part!r} in host list {text!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = int(hi_s) if hi_s is not None else lo
        if hi < lo:
            raise NodelistError(f"descending range {part!r} in host list {text!r}")
        if hi - lo > 100000:
            raise NodelistError(f"range {part!r} in host list {text!r} is too large")
        width = len(lo_s)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_host(item: str, text: str) -> list[str]:
    """Expand one host expression, which may hold several bracket groups (rack[1-2]-n[01-02])."""
    open_i = item.find("[")
    if open_i < 0:
        if "]" in item:
            raise NodelistError(f"unbalanced ']' in host list {text!r}")
        return [item]
    close_i = item.find("]", open_i)
    if close_i < 0 or "[" in item[open_i + 1:close_i]:
        raise NodelistError(f"unbalanced '[' in host list {text!r}")
    prefix, body, rest = item[:open_i], item[open_i + 1:close_i], item[close_i + 1:]
    if "]" in prefix:
        raise NodelistError(f"unbalanced ']' in host list {text!r}")
    tails = _expand_host(rest, text) if rest else [""]
    return [f"{prefix}{n}{t}" for n in _expand_ranges(body, text) for t in tails]


def parse_nodelist(s: str) -> list[str]:
    """Expand a Slurm host list: ``"gpu[001-004,010],cpu7"`` -> gpu001..gpu004, gpu010, cpu7.

    Commas inside brackets belong to the range; zero padding follows the range's first number;
    text after a bracket (``a[1-2]-ib``) and several bracket groups per host are supported.
    Raises NodelistError (a LaunchError and ValueError) on malformed input.
    """
    text = s
    s = (s or "").strip()
    if not s or s == "(null)":
        return []
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(s):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    if depth != 0:
        raise NodelistError(f"unbalanced '[' in host list {text!r}")
    items.append(s[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            raise NodelistError(f"empty host name in host list {text!r}")
        hosts.extend(_expand_host(item, text))
    return hosts
