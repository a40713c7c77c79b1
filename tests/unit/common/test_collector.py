"""The garbage collector over a command's life (hpcnft.common.collector)."""
from __future__ import annotations

import gc
import subprocess
import sys

from hpcnft.cli.main import main


def test_a_command_collects_as_usual_once_loaded_and_gives_collections_back(tmp_path, capsys):
    gc.unfreeze()
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    seen = {}

    real = __import__("hpcnft.cli.report", fromlist=["main"]).main

    def spy(name, args):
        seen["enabled"] = gc.isenabled()  # settled before the command ran
        return real(name, args)
    import hpcnft.cli.report as report
    report.main, restore = spy, report.main
    try:
        assert main(["show", str(tmp_path / "missing")]) == 2
    finally:
        report.main = restore
    assert seen == {"enabled": True}
    assert gc.isenabled() and gc.get_freeze_count() > frozen_before  # frozen at its end
    gc.unfreeze()


def test_a_command_imports_its_libraries_with_collections_held_off():
    """Collections stay off while the command's module and libraries import, and are back on
    (settle) before a command other than `run` does its work; a rank settles once its models are
    loaded (run.job, run.reward_rank), the spawner before it spawns (cli.run)."""
    code = ("import gc, sys\n"
            "from hpcnft.common import collector\n"
            "import hpcnft.cli.main\n"
            "m = sys.modules['hpcnft.cli.main']\n"
            "collector.settle = lambda: print('settle', gc.isenabled())\n"
            "sys.argv = ['hpcnft', 'show', '/nonexistent']\n"
            "m.main()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["settle", "False"]
