"""`python -m hpcnft.run.rank RECIPE --run-dir D [--set ...] [--steps N]`: one rank of a job
the local spawner started (run.start, distributed.spawner), straight into the rank's entry;
or forked by a fork server that ran `preload` (distributed.fork_server)."""
from __future__ import annotations

import argparse
import gc
import os
import sys

from hpcnft.distributed import preempt


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hpcnft.run.rank")
    p.add_argument("recipe")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int)
    return p.parse_args(argv)


def preload(argv: list[str]) -> None:
    """Import what every rank of this job imports, for ranks a fork server forks (distributed.
    fork_server): they start without importing torch, diffusers and transformers again. No torch
    operation runs here (a GNU OpenMP pool started before a fork hangs the children): the ranks
    build the tiny models themselves."""
    from hpcnft.algo.root_config import load_config
    from hpcnft.common import collector
    from hpcnft.models.loading import import_libraries
    import hpcnft.run.entry  # noqa: F401 - the rank's own modules

    args = parse(argv)
    collector.hold_off()
    import_libraries(load_config(args.recipe, args.overrides, steps=args.steps, run_dir=args.run_dir))
    collector.settle()  # frozen: the ranks' collections never walk (nor copy) the shared objects


def main(argv: list[str] | None = None) -> int:
    preempt.catch_early(interrupt=True)  # before the imports: a Ctrl-C now is kept for the job
    from hpcnft.common import collector

    args = parse(argv)
    enabled = gc.isenabled()
    collector.hold_off()  # until the rank's models are loaded (collector.settle)
    try:
        from hpcnft.algo.root_config import load_config
        from hpcnft.distributed.detect import detect
        from hpcnft.run.entry import rank_main

        cfg = load_config(args.recipe, args.overrides, steps=args.steps, run_dir=args.run_dir)
        return rank_main(cfg, detect(os.environ), args.recipe, args.overrides)
    finally:
        collector.before_exit(enabled)


if __name__ == "__main__":
    sys.exit(main())
