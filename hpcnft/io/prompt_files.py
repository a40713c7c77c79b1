"""Prompt files: text (one prompt per line), a file shipped in hpcnft/data, or a column of a CSV
such as DrawBench's. No torch here, so the run-file tools can read a run's prompts and start fast."""
from __future__ import annotations

import csv
import io
import os
from importlib import resources


class PromptFileError(Exception):
    pass


def read_prompt_file(spec: str, key: str) -> list[str]:
    """The prompts `spec` names (`key` is its config key, for the error lines):
    - a path: a text file, one prompt per line;
    - `builtin:NAME`: such a file shipped in hpcnft/data;
    - `csv:PATH#COLUMN`: the column COLUMN of a CSV file (tab-separated when PATH ends in .tsv);
    - `drawbench:PATH`, `drawbench:PATH#CATEGORY`: the user's copy of DrawBench saved as CSV,
      its "Prompts" column, every row or those whose "Category" is CATEGORY."""
    if spec.startswith("builtin:"):
        res = resources.files("hpcnft.data") / spec[len("builtin:"):]
        if not res.is_file():
            raise PromptFileError(f"{key}: no built-in prompt file {spec!r}")
        return prompt_lines(res.read_text(encoding="utf-8"), spec, key)
    if spec.startswith(CSV):
        path, column = split_fragment(spec[len(CSV):])
        if not column:
            raise PromptFileError(f"{key}: {spec!r} names no column (csv:PATH#COLUMN)")
        return read_table_column(path, column, key)
    if spec.startswith(DRAWBENCH):
        path, category = split_fragment(spec[len(DRAWBENCH):])
        return read_table_column(path, DRAWBENCH_PROMPTS, key, (DRAWBENCH_CATEGORY, category) if category else None)
    return prompt_lines(read_text(spec, key), spec, key)


def prompt_lines(text: str, spec: str, key: str) -> list[str]:
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptFileError(f"{key}: prompt file {spec!r} is empty")
    return prompts


def read_text(path: str, key: str, encoding: str = "utf-8") -> str:
    if os.path.isdir(path):
        raise PromptFileError(f"{key}: {path!r} is a directory, not a prompt file")
    if not os.path.isfile(path):
        raise PromptFileError(f"{key}: prompt file {path!r} does not exist")
    try:
        with open(path, encoding=encoding, newline="") as f:  # newline="": line ends as written (csv wants them)
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{key}: cannot read prompt file {path!r} ({e})") from None
    nul = text.find("\x00")
    if nul >= 0:  # valid UTF-8 but in no prompt: a binary file, or UTF-16 text without its byte-order mark
        line = text.count("\n", 0, nul) + 1
        raise PromptFileError(f"{key}: prompt file {path!r} has a NUL byte on line {line} (not a text file?)")
    return text


# -- prompt tables (CSV, TSV) -------------------------------------------------------------
CSV, DRAWBENCH = "csv:", "drawbench:"
# The columns of the DrawBench sheet (Saharia et al. 2022, Imagen): 200 prompts in 11 categories.
DRAWBENCH_PROMPTS, DRAWBENCH_CATEGORY = "Prompts", "Category"


def split_fragment(rest: str) -> tuple[str, str]:
    """`PATH#NAME` -> (PATH, NAME); a path that exists as written keeps any `#` it holds."""
    if "#" not in rest or os.path.isfile(rest):
        return rest, ""
    path, _, name = rest.rpartition("#")
    return path, name.strip()


def one_line(cell: str) -> str:
    """A table cell as one prompt line: its line breaks (a quoted cell may hold some) become single
    spaces, so the prompt is the text the same prompt in a one-per-line file would be."""
    return " ".join(part.strip() for part in cell.splitlines() if part.strip())


def find_column(header: list[str], name: str) -> int | None:
    """The column called `name`, exactly, else ignoring case (copies differ: "Prompts", "prompts")."""
    for match in (lambda h: h == name, lambda h: h.casefold() == name.casefold()):
        hits = [i for i, h in enumerate(header) if match(h)]
        if hits:
            return hits[0]
    return None


def read_table_column(path: str, column: str, key: str, where: tuple[str, str] | None = None) -> list[str]:
    """The non-empty cells of `column` of a CSV (or .tsv) file with a header row, in file order;
    with `where` = (other column, value), only the rows whose other column is value (ignoring
    case and surrounding spaces). A UTF-8 byte-order mark is dropped; blank rows are skipped."""
    text = read_text(path, key, encoding="utf-8-sig")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if path.lower().endswith(".tsv") else ",")
    try:
        rows = [[cell.strip() for cell in row] for row in reader if any(cell.strip() for cell in row)]
    except csv.Error as e:
        raise PromptFileError(f"{key}: cannot read {path!r} as a table (line {reader.line_num}: {e})") from None
    if not rows:
        raise PromptFileError(f"{key}: prompt table {path!r} is empty")
    header, body = rows[0], rows[1:]
    wanted = [column] + ([where[0]] if where else [])
    index = [find_column(header, name) for name in wanted]
    for name, i in zip(wanted, index):
        if i is None:
            columns = ", ".join(repr(h) for h in header)
            raise PromptFileError(f"{key}: {path!r} has no column {name!r} (its header: {columns})")

    def cell(row: list[str], i: int) -> str:
        return row[i] if i < len(row) else ""

    if where:
        value = where[1].casefold()
        selected = [row for row in body if cell(row, index[1]).casefold() == value]
        if not selected:
            present = ", ".join(sorted({cell(row, index[1]) for row in body} - {""}))
            raise PromptFileError(f"{key}: {path!r} has no rows whose {where[0]!r} is {where[1]!r} "
                                  f"(its values: {present or 'none'})")
        body = selected
    prompts = [p for p in (one_line(cell(row, index[0])) for row in body) if p]
    if not prompts:
        raise PromptFileError(f"{key}: {path!r} has no prompts in column {column!r}")
    return prompts
