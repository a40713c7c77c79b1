"""The exit codes the docs give are the code's: a rank's own (hpcnft.common.errors) in
docs/architecture.md and docs/run_file.md, and the job's for a rank killed by a signal: 128+N
from the local spawner (tests/unit/distributed/test_spawn_local.py), torchrun's 1
(tests/integration/test_faults.py)."""
from __future__ import annotations

import os
import re

from hpcnft.common import errors

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs")
CODES = sorted(value for name, value in vars(errors).items() if name.startswith("EXIT_"))


def _text(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return " ".join(f.read().split())


def test_the_architecture_page_lists_a_ranks_exit_codes():
    listed = re.search(r"a rank's exit codes \(([\d, ]+);", _text("architecture.md"))
    assert listed and [int(code) for code in listed.group(1).split(",")] == CODES


def test_the_run_file_page_gives_every_code_and_who_decides_a_killed_ranks():
    text = _text("run_file.md")
    codes = text[text.index("Exit codes: "):]
    codes = codes[:codes.index("## ")]
    for code in CODES:
        assert re.search(rf"\b{code} (done|a rank failed|bad input|preempted|interrupted)", codes), code
    assert "128+N a rank killed by signal N (137: SIGKILL" in codes
    assert "torchrun exits 1 for any failed rank, a killed one included" in codes
