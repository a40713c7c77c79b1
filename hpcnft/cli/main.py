"""The `hpcnft` command. Each subcommand lives in its own module, imported only when used, so
light commands (compare, show) start without loading torch. A command module provides
`add_arguments(name, parser)` and `main(name, args) -> int`."""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from hpcnft.common import collector
from hpcnft.common.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, UsageError

DESCRIPTION = ("DiffusionNFT (or Flow-GRPO) fine-tuning of Stable Diffusion 3.5 and FLUX.1-dev against PickScore or "
               "a weighted mix of reward terms, as one torch.distributed job, and the tools around its runs.")

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("hpcnft.cli.run", "run the job (spawns the layout's ranks when no launcher is present)"),
    "submit": ("hpcnft.cli.submit", "submit a run through submitit (slurm, local or debug)"),
    "make-tiny": ("hpcnft.cli.run", "write the tiny SD3, FLUX, Wan, PickScore and reward-term model folders"),
    "make-weights": ("hpcnft.cli.make_weights", "write a real model's folder (SD3.5-M/L, FLUX.1-dev, PickScore) with "
                                                "random weights, to rehearse a cluster before downloading"),
    "compare": ("hpcnft.cli.report", "compare the metric series of two runs or standards"),
    "show": ("hpcnft.cli.report", "summarise a run file: config, topology, attempts, events, metrics"),
    "plot": ("hpcnft.cli.report", "plot metric curves of one or more runs to a PNG"),
    "watch": ("hpcnft.cli.report", "follow a live run, one line per new step"),
    "export-metrics": ("hpcnft.cli.report", "export metrics to CSV or TensorBoard"),
    "export": ("hpcnft.cli.export", "export trained weights of a checkpoint as a diffusers-loadable folder"),
    "reward-server": ("hpcnft.cli.reward_server", "serve reward terms over HTTP for remote terms of other jobs"),
    "score": ("hpcnft.cli.score", "score image files or a run's sample grids with reward terms, as a reward rank does"),
    "bench": ("hpcnft.bench", "GPU throughput and MFU of each phase beside the plain diffusers/peft stack"),
}


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line (`hpcnft run: error: ...`), exit 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcnft", description=DESCRIPTION,
                                epilog="`hpcnft COMMAND --help` lists a command's options.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv or ["--help"])
        return EXIT_BAD_INPUT
    name = argv[0]
    module_name, help_ = COMMANDS[name]
    if name == "run":  # a stop signal during the imports is kept for the job to act on
        from hpcnft.distributed import preempt

        preempt.catch_early(interrupt=bool(os.environ.get(preempt.SPAWNER_PID_ENV)))
    enabled = gc.isenabled()
    collector.hold_off()  # until the command's libraries and models are loaded (collector.settle)
    try:
        return _run_command(name, module_name, help_, argv)
    finally:
        collector.before_exit(enabled)


def _run_command(name: str, module_name: str, help_: str, argv: list[str]) -> int:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        print(f"hpcnft {name}: unavailable ({e})", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = OneLineParser(prog=f"hpcnft {name}", description=help_)
    module.add_arguments(name, parser)
    args = parser.parse_args(argv[1:])
    if name != "run":  # a rank settles once its models are loaded, the spawner before it spawns
        collector.settle()
    try:
        return int(module.main(name, args) or 0)
    except UsageError as e:
        print(f"hpcnft {name}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"hpcnft {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
