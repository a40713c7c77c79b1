"""`python -m hpcnft.run.rank RECIPE --run-dir D [--set ...] [--steps N]`: one rank of a job
the local spawner started (run.start, distributed.spawner), straight into the rank's entry."""
from __future__ import annotations

import argparse
import gc
import os
import sys

from hpcnft.distributed import preempt


def main(argv: list[str] | None = None) -> int:
    preempt.catch_early(interrupt=True)  # before the imports: a Ctrl-C now is kept for the job
    from hpcnft.common import collector

    p = argparse.ArgumentParser(prog="hpcnft.run.rank")
    p.add_argument("recipe")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int)
    args = p.parse_args(argv)
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
