"""How hpcnft starts Python processes of its own (its ranks, the fork server, what the sbatch
scripts and submitit run): never with the working directory on their import path.

`python -m MODULE` puts the current directory first on sys.path, so a `json.py` where the user
stands would run in every rank, and a folder named `hpcnft` there would stand in for the package.
Children run with `-P` (Python 3.11+: no such directory is prepended) and find hpcnft where this
process found it: where that is neither on PYTHONPATH nor in a site directory (an editable
install, a source checkout), its folder goes first on the child's PYTHONPATH, an explicit path
rather than whatever the working directory holds. Standard library only: the spawner uses it."""
from __future__ import annotations

import os
import site
import sys
from collections.abc import Mapping

SAFE_PATH = "-P"


def module_command(module: str, python: str = sys.executable) -> tuple[str, ...]:
    """`python -P -m module`: the module run without the working directory on its path."""
    return (python, SAFE_PATH, "-m", module)


def package_root() -> str:
    """The folder that holds this hpcnft package."""
    import hpcnft

    return os.path.dirname(os.path.dirname(os.path.abspath(hpcnft.__file__)))


def _site_dirs() -> set[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return {os.path.abspath(d) for d in dirs}


def python_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child started with module_command: the package's folder first on PYTHONPATH
    where the child would not find this same package without the working directory."""
    root = package_root()
    entries = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    if root in {os.path.abspath(p) for p in entries} or root in _site_dirs():
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join([root, *entries])}
