"""Recipes as TOML tables: a built-in recipe by name (hpcnft/recipes/NAME.toml) or the user's
TOML file, with `base = "other"` to start from another recipe. What cannot be read (a directory,
a missing or unreadable file, bytes that are not UTF-8, invalid TOML, a base that leads back to
itself) is refused with one line naming the file."""
from __future__ import annotations

import os
import stat
import tomllib
from importlib import resources

from hpcnft.common.errors import ConfigError

# A recipe is a page of TOML; a larger file is almost surely the wrong path (a checkpoint, a
# data set), and reading it whole to find out would take long.
RECIPE_MAX_BYTES = 1 << 20


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("hpcnft.recipes").iterdir() if p.name.endswith(".toml"))


def is_recipe_file(recipe: str) -> bool:
    """A path to a TOML file, not the name of a built-in recipe."""
    return recipe.endswith(".toml") or os.sep in recipe


def read_recipe_text(path: str) -> str:
    """A recipe file's text, or a ConfigError naming the file and what is wrong with it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"recipe file {path!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"recipe file {path!r} cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"recipe file {path!r} is a directory, not a TOML file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read; a device never ends
        raise ConfigError(f"recipe file {path!r} is not a regular file")
    if st.st_size > RECIPE_MAX_BYTES:
        raise ConfigError(f"recipe file {path!r} is {st.st_size / 2**20:.1f} MiB, not a recipe "
                          f"(a TOML file of at most {RECIPE_MAX_BYTES >> 20} MiB)")
    try:
        with open(path, "rb") as f:
            data = f.read(RECIPE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"recipe file {path!r} cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"recipe file {path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}, line {line})") from None


def _text(recipe: str) -> tuple[str, str]:
    """(source, text) of a recipe name or file."""
    if is_recipe_file(recipe):
        return recipe, read_recipe_text(recipe)
    res = resources.files("hpcnft.recipes") / f"{recipe}.toml"
    if not res.is_file():
        raise ConfigError(f"unknown recipe {recipe!r} (known: {', '.join(recipe_names())})")
    return f"recipe:{recipe}", res.read_text(encoding="utf-8")


def _table(recipe: str) -> tuple[str, dict]:
    source, text = _text(recipe)
    try:
        return source, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML ({e})") from None


def read_recipe(recipe: str, _chain: tuple[str, ...] = ()) -> tuple[str, dict]:
    """A recipe name (tiny, sd35m_pickscore) or a path to a TOML file -> (source, table)."""
    source, table = _table(recipe)
    base = table.pop("base", None)  # `base = "tiny"`: start from that recipe, then apply this one
    if base is not None:
        if not isinstance(base, str) or base == recipe:
            raise ConfigError(f"{source}: base must name another recipe")
        chain = (*_chain, recipe)
        if base in chain:
            raise ConfigError(f"{source}: base {base!r} leads back to itself ({' -> '.join((*chain, base))})")
        table = merge(read_recipe(base, chain)[1], table)
    return source, table


def recipe_file_base(recipe: str) -> str | None:
    """The `base` a recipe file names (None: it names none, or `recipe` is a built-in name).
    Only for a recipe that read_recipe has read without complaint."""
    if not is_recipe_file(recipe):
        return None
    base = _table(recipe)[1].get("base")
    return base if isinstance(base, str) else None


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
