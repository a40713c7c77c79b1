"""One module per concern, each readable in a sitting: no module of the package is over 400 lines."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hpcnft"
MAX_LINES = 400


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in ROOT.rglob("*.py")}
    assert len(sizes) > 50
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
