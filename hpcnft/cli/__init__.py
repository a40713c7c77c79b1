"""The `hpcnft` command and its subcommands."""
from hpcnft.cli.main import main

__all__ = ["main"]
