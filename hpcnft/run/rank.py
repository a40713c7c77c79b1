"""`python -m hpcnft.run.rank`: one rank of a job the local spawner started (run.start,
distributed.spawner), straight into the rank's entry; or forked by a fork server that ran
`preload` (distributed.fork_server). The rank parses no config text: the spawner hands it the
config it resolved, whole, with the command's recipe and overrides (what a resume repeats), in
START_ENV."""
from __future__ import annotations

import gc
import json
import os
import sys

from hpcnft.common.errors import EXIT_BAD_INPUT
from hpcnft.distributed import preempt

START_ENV = "HPCNFT_START"


def handover(cfg, recipe: str, overrides: list[str]) -> dict[str, str]:
    """The spawned ranks' START_ENV: the resolved config and the command's recipe and overrides."""
    return {START_ENV: json.dumps({"config": cfg.to_dict(), "recipe": recipe, "overrides": list(overrides)})}


def taken_over(environ=os.environ):
    """(config, recipe, overrides) as the spawner handed them over (START_ENV)."""
    from hpcnft.algo.root_config import config_from_dict

    start = json.loads(environ[START_ENV])
    return config_from_dict(start["config"]), start["recipe"], list(start["overrides"])


def preload(argv: list[str]) -> None:
    """Import what every rank of this job imports, for ranks a fork server forks (distributed.
    fork_server): they start without importing torch, diffusers and transformers again. No torch
    operation runs here (a GNU OpenMP pool started before a fork hangs the children): the ranks
    build the tiny models themselves."""
    from hpcnft.common import collector
    from hpcnft.models.loading import import_libraries
    import hpcnft.run.entry  # noqa: F401 - the rank's own modules

    collector.hold_off()
    import_libraries(taken_over()[0])
    collector.settle()  # frozen: the ranks' collections never walk (nor copy) the shared objects


def main(argv: list[str] | None = None) -> int:
    if START_ENV not in os.environ:
        print(f"hpcnft.run.rank: a rank of a job `hpcnft run` spawns (no {START_ENV} here); start jobs with "
              "`hpcnft run`", file=sys.stderr)
        return EXIT_BAD_INPUT
    preempt.catch_early(interrupt=True)  # before the imports: a Ctrl-C now is kept for the job
    from hpcnft.common import collector

    enabled = gc.isenabled()
    collector.hold_off()  # until the rank's models are loaded (collector.settle)
    try:
        from hpcnft.distributed.detect import detect
        from hpcnft.run.entry import rank_main

        cfg, recipe, overrides = taken_over()
        return rank_main(cfg, detect(os.environ), recipe, overrides)
    finally:
        collector.before_exit(enabled)


if __name__ == "__main__":
    sys.exit(main())
