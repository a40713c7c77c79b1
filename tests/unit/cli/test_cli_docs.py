"""What a user reads: `hpcnft --help`, `run --help`, the README's commands, and the reference
pages' tables (docs/configuration.md, docs/run_file.md) against the code they describe."""
from __future__ import annotations

import os
import re

import pytest

from hpcnft.algo.root_config import load_config, reference_table
from hpcnft.cli.main import COMMANDS, main
from hpcnft.common.recipe_files import recipe_names
from hpcnft.common.validation import flatten
from hpcnft.algo.registry import specs
from hpcnft.io.runfile import ALL_KEYS

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
README = os.path.join(ROOT, "README.md")
CONFIGURATION = os.path.join(ROOT, "docs", "configuration.md")
RUN_FILE = os.path.join(ROOT, "docs", "run_file.md")


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_says_what_hpcnft_is_in_whole_sentences(capsys):
    out = help_text(["--help"], capsys)
    description = " ".join(out.split("\n\n")[1].split())
    assert description.endswith(".") and "DiffusionNFT" in description
    for name in COMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\b", out, re.M), name


def test_run_help_lists_every_recipe(capsys):
    out = " ".join(help_text(["run", "--help"], capsys).split())
    names = recipe_names()
    assert len(names) >= 4
    for name in names:
        assert re.search(rf"[( ]{re.escape(name)}[,;)]", out), name


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_readme_shows_every_command():
    text = _read(README)
    for name in COMMANDS:
        assert f"hpcnft {name} " in text, name


def _expand_braces(text: str) -> set[str]:
    """`train/{a,b}` -> {train/a, train/b}; plain `x/y` -> {x/y}."""
    found = set()
    for item in re.findall(r"`([^`\s]+)`", text):
        m = re.fullmatch(r"([\w/]*)\{([\w,]+)\}", item)
        found |= {m.group(1) + s for s in m.group(2).split(",")} if m else {item}
    return found


def test_run_file_page_names_every_metric_key():
    documented = _expand_braces(_read(RUN_FILE))
    assert [k for k in [*ALL_KEYS, *(k for s in specs() for k in s.metric_keys)] if k not in documented] == []


def test_configuration_page_has_every_config_key():
    """docs/configuration.md's table is the one made from the keys' declarations (each key's
    default, rule and meaning, written once beside its owner), and it lists every key."""
    text = _read(CONFIGURATION)
    table = "".join(line + "\n" for line in text.splitlines() if line.startswith("|"))
    expected = reference_table()
    assert table == expected, "docs/configuration.md's table differs from reference_table():\n" + expected
    rows = {line.split("`")[1] for line in table.splitlines()[2:]}
    cfg = load_config("tiny", ['reward.terms=[{kind = "pickscore"}]'])
    keys = {re.sub(r"\[\d+\]", "[]", k) for k in flatten(cfg.to_dict())}
    keys |= {f"reward.terms[].{k}" for k in cfg.to_dict()["reward"]["terms"][0]}
    assert rows == keys
