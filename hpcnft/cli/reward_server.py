"""`hpcnft reward-server TERM... [--recipe R] [--set KEY=VALUE] [--host H] [--port P]`: serve
reward terms over HTTP (hpcnft/rewards/http_protocol.py) for `remote` terms of other jobs.

A TERM is the name of a term in the recipe's reward.terms, or a bare kind (pickscore,
jpeg_compressibility, ...) with its default settings, the tiny model where the kind has one.
The terms score as a reward rank of the recipe would: same determinism settings, same CPU
thread count. `--max-requests`, `--max-connections`, `--max-per-address`, `--max-body-mib`,
`--head-deadline-s` and `--min-body-kib-s` bound what clients may cost the server
(hpcnft/rewards/http_server.py). With a shared secret
(`--token-file`, or $HPCNFT_REWARD_TOKEN) clients must send it; listening beyond loopback
without one is refused, before any model loads, unless `--insecure-no-token`. SIGINT or SIGTERM
stops the server; the exit code is then 0."""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import signal
import sys
import threading

from hpcnft.common.errors import UsageError
from hpcnft.rewards.config import REWARD_TOKEN_ENV, TERM_KINDS
from hpcnft.rewards.shared_secret import TokenError, listening_refusal, server_token

SERVED_KINDS = tuple(k for k in TERM_KINDS if k != "remote")
# ScoringServer's defaults, repeated so that --help does not import torch
MAX_REQUESTS, MAX_CONNECTIONS, MAX_PER_ADDRESS, MAX_BODY_MIB = 8, 256, 32, 2048
HEAD_DEADLINE_S, MIN_BODY_KIB_S = 10.0, 1024
SPARE_DESCRIPTORS = 128  # beyond one per connection: the listener, models' files, a burst being accepted


def whole_number(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_arguments(name: str, p) -> None:
    from hpcnft.common.recipe_files import recipe_names

    p.add_argument("terms", nargs="+", metavar="TERM",
                   help=f"a term name of the recipe's reward.terms, or a kind ({', '.join(SERVED_KINDS)})")
    p.add_argument("--recipe", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value (repeatable), e.g. "
                        "--set 'reward.terms=[{kind=\"pickscore\", model_dir=\"/m\"}]'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the terms' models run")
    p.add_argument("--port-file", help="write the port here once the server listens")
    p.add_argument("--max-requests", type=whole_number, default=MAX_REQUESTS, metavar="N",
                   help=f"requests admitted at once, scored one at a time (default {MAX_REQUESTS}); more are "
                        "answered 503 with Retry-After")
    p.add_argument("--max-connections", type=whole_number, default=MAX_CONNECTIONS, metavar="N",
                   help=f"connections open at once (default {MAX_CONNECTIONS}, at least --max-requests); one more "
                        "closes the oldest that has not sent its request, else it is answered 503 with Retry-After")
    p.add_argument("--max-per-address", type=whole_number, default=MAX_PER_ADDRESS, metavar="N",
                   help=f"connections open at once from one address (default {MAX_PER_ADDRESS}); one more closes "
                        "that address's oldest that has not sent its request, else it is answered 503")
    p.add_argument("--max-body-mib", type=whole_number, default=MAX_BODY_MIB, metavar="MIB",
                   help=f"MiB of request bodies held at once (default {MAX_BODY_MIB}); a request that does not fit "
                        "is answered 503 with Retry-After, one larger than this 413")
    p.add_argument("--head-deadline-s", type=seconds, default=HEAD_DEADLINE_S, metavar="S",
                   help=f"seconds for a request's line and headers to arrive (default {HEAD_DEADLINE_S:g}); past it "
                        "the connection is closed")
    p.add_argument("--min-body-kib-s", type=whole_number, default=MIN_BODY_KIB_S, metavar="R",
                   help=f"the slowest pace of a body, KiB a second (default {MIN_BODY_KIB_S}): byte k must arrive "
                        "within --head-deadline-s + k/R seconds of the head, or the connection is closed")
    p.add_argument("--token-file", metavar="PATH",
                   help="a file (chmod 600) whose first line is the shared secret clients must send "
                        f"(Authorization: Bearer); without it, ${REWARD_TOKEN_ENV} if set. A --host beyond "
                        "loopback needs one")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="listen beyond loopback without a shared secret: anyone who reaches the port may use "
                        "the server (a trusted network only)")


def server_limits(args) -> dict:
    """ScoringServer's limits from the options; UsageError where they do not fit together."""
    if args.max_connections < args.max_requests:
        raise UsageError(f"--max-connections {args.max_connections} is less than --max-requests {args.max_requests}: "
                         "each admitted request holds a connection")
    return {"max_requests": args.max_requests, "max_connections": args.max_connections,
            "max_per_address": args.max_per_address, "body_budget_bytes": args.max_body_mib << 20,
            "head_deadline_s": args.head_deadline_s, "min_body_rate": args.min_body_kib_s * 1024}


def descriptors_for(connections: int) -> None:
    """Raise this process's open-file limit to what `connections` need, up to the hard limit;
    UsageError (before any model loads) where the hard limit is lower."""
    import resource

    need = connections + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise UsageError(f"--max-connections {connections} needs {need} open files, and this process may "
                             f"open at most {hard} (ulimit -Hn): lower --max-connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def url_host(host: str) -> str:
    """A host as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def required_token(args, environ=os.environ) -> str | None:
    """The shared secret clients must send (None: none); UsageError where it cannot be read, or
    where --host reaches beyond this machine without one and without --insecure-no-token."""
    try:
        token = server_token(args.token_file, environ)
    except TokenError as e:
        raise UsageError(str(e)) from None
    refusal = listening_refusal(args.host, token, args.insecure_no_token)
    if refusal:
        raise UsageError(refusal)
    return token


def served_terms(names: list[str], cfg, allow_remote: bool = False) -> list:
    """The RewardTermConfig of each TERM: the recipe's term of that name, else that kind's
    defaults. UsageError for an unknown name, or a remote term unless `allow_remote`."""
    from dataclasses import replace

    from hpcnft.rewards.config import RewardTermConfig
    from hpcnft.rewards.registry import job_terms

    configured = {t.name: t for t in job_terms(cfg)}
    out = []
    for name in dict.fromkeys(names):
        if name in configured:
            term = configured[name]
        elif name in TERM_KINDS:
            term = RewardTermConfig(kind=name, name=name)
        else:
            raise UsageError(f"unknown term {name!r}: not a term of the recipe ({', '.join(configured)}) "
                             f"nor a kind ({', '.join(SERVED_KINDS)})")
        if term.kind == "remote" and not allow_remote:
            raise UsageError(f"term {name!r} is a remote term itself; serve it where it is scored")
        if term.kind == "remote" and not term.url:
            raise UsageError(f"term {name!r}: a remote term needs its url (name one of the recipe's reward.terms)")
        out.append(replace(term, name=name))
    return out


def load_terms(terms: list, cfg, device) -> dict:
    from hpcnft.models.folders import ModelError
    from hpcnft.rewards.registry import load_term

    loaded = {}
    for term in terms:
        try:
            loaded[term.name] = load_term(term, cfg, device)
        except ModelError as e:
            raise UsageError(f"term {term.name!r}: {e}") from None
        except ImportError as e:
            raise UsageError(f"term {term.name!r}: kind {term.kind!r} is unavailable here ({e})") from None
    return loaded


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_ALLOCATION_BYTES = 1 << 20


def return_large_buffers_to_the_system() -> None:
    """Allocate every buffer of 1 MiB or more (request bodies, their arrays) with its own mmap,
    so that freeing it gives the memory back. glibc's default raises that threshold after each
    such free, and from then on keeps freed bodies in its per-thread arenas: the server's memory
    would grow well past its byte budget. A no-op where the C library has no mallopt."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES)
    except (OSError, AttributeError):
        pass


def write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)  # a reader never sees half a number


def main(name: str, args) -> int:
    import torch

    from hpcnft.algo.root_config import ConfigError, load_config
    from hpcnft.common import determinism
    from hpcnft.rewards.http_server import ScoringServer

    limits = server_limits(args)
    descriptors_for(args.max_connections)
    token = required_token(args)  # before any model loads
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    terms = served_terms(args.terms, cfg)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    determinism.enable(cfg.determinism.enabled, cfg.determinism.cpu_threads, args.device)
    determinism.seed_globals(cfg.train.seed)  # as a reward rank of this config is seeded
    loaded = load_terms(terms, cfg, torch.device(args.device))
    return_large_buffers_to_the_system()
    try:
        server = ScoringServer((args.host, args.port), loaded, token=token, **limits)
    except OSError as e:
        raise UsageError(f"cannot listen on {url_host(args.host)}:{args.port}: {e.strerror or e}") from None

    def stop(signum, frame) -> None:
        # shutdown() waits for serve_forever to return, so it cannot run in the loop's own thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    with server:
        print(f"serving {', '.join(loaded)} on http://{url_host(args.host)}:{server.port}", flush=True)
        if token is None and listening_refusal(args.host, None, False):
            print(f"hpcnft reward-server: warning: no shared secret (--insecure-no-token): anyone who reaches "
                  f"{url_host(args.host)}:{server.port} may use this server", file=sys.stderr, flush=True)
        if args.port_file:
            try:
                write_port_file(args.port_file, server.port)
            except OSError as e:
                raise UsageError(f"--port-file {args.port_file}: {e.strerror or e}") from None
        server.serve_forever(poll_interval=0.2)
    print("reward server stopped", flush=True)
    return 0
