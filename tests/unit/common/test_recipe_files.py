"""hpcnft.common.recipe_files: a recipe file that cannot be read is one line naming the file and
what is wrong (never a traceback, never a read that blocks), and `base` chains end."""
from __future__ import annotations

import errno
import os

import pytest

from hpcnft.algo.root_config import load_config
from hpcnft.common import recipe_files
from hpcnft.common.errors import ConfigError
from hpcnft.common.recipe_files import read_recipe, recipe_file_base


def refused(recipe: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    line = str(e.value)
    assert "\n" not in line, line
    return line


def test_bytes_that_are_not_utf8_name_the_byte_its_offset_and_line(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes(b"steps = 2\n# caf\xe9 au lait\n")  # Latin-1, as an old editor saves it
    assert refused(str(p)) == f"recipe file {str(p)!r} is not UTF-8 text (byte 0xe9 at offset 15, line 2)"


def test_a_directory_is_not_reported_as_missing(tmp_path):
    d = tmp_path / "recipes.toml"
    d.mkdir()
    for given in (str(d), str(d) + os.sep, str(tmp_path) + os.sep):
        assert refused(given) == f"recipe file {given!r} is a directory, not a TOML file"


def test_a_missing_file_is_still_reported_as_missing(tmp_path):
    p = str(tmp_path / "absent.toml")
    assert refused(p) == f"recipe file {p!r} does not exist"


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
    # Tests run as root, who reads any mode: the refusal of open() is made here.
    p = tmp_path / "locked.toml"
    p.write_text("steps = 2\n")

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(recipe_files, "open", denied, raising=False)
    assert refused(str(p)) == f"recipe file {str(p)!r} cannot be read (Permission denied)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any mode")
def test_a_file_without_read_permission_is_one_line(tmp_path):
    p = tmp_path / "locked.toml"
    p.write_text("steps = 2\n")
    p.chmod(0)
    assert "Permission denied" in refused(str(p))


def test_a_fifo_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)  # opening it to read would wait for a writer
    assert refused(str(fifo)) == f"recipe file {str(fifo)!r} is not a regular file"


def test_a_huge_file_is_refused_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_files, "RECIPE_MAX_BYTES", 64)
    p = tmp_path / "big.toml"
    p.write_text("# " + "x" * 100 + "\nsteps = 2\n")
    assert "is 0.0 MiB, not a recipe" in refused(str(p))


def test_a_base_chain_that_comes_back_is_refused(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(f'base = "{b}"\nsteps = 2\n')
    b.write_text(f'base = "{a}"\n')
    line = refused(str(a))
    assert line.startswith(f"{b}: base {str(a)!r} leads back to itself") and f"{a} -> {b} -> {a}" in line


def test_a_base_chain_of_files_and_names_merges_in_order(tmp_path):
    mid, top = tmp_path / "mid.toml", tmp_path / "top.toml"
    mid.write_text('base = "tiny"\n[optim]\nlr = 1e-2\n[rollout]\nheight = 32\n')
    top.write_text(f'base = "{mid}"\n[optim]\nlr = 5e-3\n')
    _, table = read_recipe(str(top))
    assert table["optim"]["lr"] == 5e-3 and table["rollout"]["height"] == 32 and table["rollout"]["width"] == 64


def test_recipe_file_base(tmp_path):
    bare, based = tmp_path / "bare.toml", tmp_path / "based.toml"
    bare.write_text("steps = 2\n")
    based.write_text('base = "tiny"\nsteps = 2\n')
    assert recipe_file_base(str(bare)) is None and recipe_file_base(str(based)) == "tiny"
    assert recipe_file_base("tiny_learns") is None  # a built-in name is no file
