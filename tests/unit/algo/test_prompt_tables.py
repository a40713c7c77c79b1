"""Prompts from a column of a CSV or TSV file (hpcnft.algo.prompts): `csv:PATH#COLUMN` and the
user's copy of DrawBench, `drawbench:PATH` or `drawbench:PATH#CATEGORY`. The files are written
here byte by byte, as a spreadsheet's CSV export would be (RFC 4180 quoting), and the expected
prompts are read off them by hand."""
from __future__ import annotations

import pytest

from hpcnft.algo.prompts import PromptFileError, PromptStream, read_prompt_file

BOM = b"\xef\xbb\xbf"

# DrawBench's layout (columns "Prompts", "Category"), as a spreadsheet saves it: a byte-order
# mark, CRLF line ends, quoted cells holding commas, doubled quotes and a line break, a
# category cell with a trailing space, blank lines, an empty prompt cell, a third column.
DRAWBENCH = BOM + (
    'Prompts,Category,Note\r\n'
    'A red colored car.,Colors,\r\n'
    '"A bird, and a car.",Colors,x\r\n'
    '\r\n'
    'A storefront with "Hello World" written on it.,Text,\r\n'
    '"A storefront with ""Diffusion"" written on it.",Text,\r\n'
    '"A long description of a cabin\r\n  in the woods, at dusk.",Descriptions,\r\n'
    'Five cars on the street.,Counting,\r\n'
    ',Counting,an empty prompt cell\r\n'
    'An elephant is behind a tree.,Gary Marcus et al. ,\r\n'
    '\r\n'
    '\r\n'
).encode()

ALL_PROMPTS = [
    "A red colored car.",
    "A bird, and a car.",
    'A storefront with "Hello World" written on it.',
    'A storefront with "Diffusion" written on it.',
    "A long description of a cabin in the woods, at dusk.",
    "Five cars on the street.",
    "An elephant is behind a tree.",
]


@pytest.fixture
def drawbench(tmp_path):
    path = tmp_path / "DrawBench.csv"
    path.write_bytes(DRAWBENCH)
    return str(path)


def refused(spec: str, key: str = "data.eval_prompts") -> str:
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(spec, key)
    line = str(e.value)
    assert line.startswith(f"{key}: ") and "\n" not in line, line
    return line


def test_drawbench_reads_every_prompt_in_file_order(drawbench):
    assert read_prompt_file(f"drawbench:{drawbench}", "data.eval_prompts") == ALL_PROMPTS


def test_drawbench_category_selects_its_rows(drawbench):
    assert read_prompt_file(f"drawbench:{drawbench}#Colors", "k") == ALL_PROMPTS[:2]
    assert read_prompt_file(f"drawbench:{drawbench}#text", "k") == ALL_PROMPTS[2:4]  # case ignored
    assert read_prompt_file(f"drawbench:{drawbench}#Gary Marcus et al.", "k") == ALL_PROMPTS[6:]
    # a category whose rows hold no prompt text is no evaluation set
    assert read_prompt_file(f"drawbench:{drawbench}#Counting", "k") == ALL_PROMPTS[5:6]


def test_an_unknown_category_lists_those_present(drawbench):
    line = refused(f"drawbench:{drawbench}#Colours")
    assert drawbench in line and "'Colours'" in line
    assert "Colors, Counting, Descriptions, Gary Marcus et al., Text" in line


def test_csv_column_by_name(tmp_path):
    p = tmp_path / "captions.csv"
    p.write_text('id,caption\n1,"a cat, asleep"\n2,a dog\n\n3,\n', encoding="utf-8")
    assert read_prompt_file(f"csv:{p}#caption", "data.train_prompts") == ["a cat, asleep", "a dog"]
    assert read_prompt_file(f"csv:{p}#Caption", "data.train_prompts") == ["a cat, asleep", "a dog"]


def test_an_exact_header_wins_over_one_that_differs_in_case(tmp_path):
    p = tmp_path / "two.csv"
    p.write_text("Prompt,prompt\nupper,lower\n", encoding="utf-8")
    assert read_prompt_file(f"csv:{p}#prompt", "k") == ["lower"]
    assert read_prompt_file(f"csv:{p}#Prompt", "k") == ["upper"]


def test_tsv_is_tab_separated(tmp_path):
    p = tmp_path / "prompts.tsv"
    p.write_bytes(BOM + b"Prompts\tCategory\r\na cat, a dog\tCount\r\n\"a \"\"quoted\"\" word\"\tText\r\n")
    assert read_prompt_file(f"drawbench:{p}", "k") == ["a cat, a dog", 'a "quoted" word']


def test_a_path_holding_a_hash_is_read_as_written(tmp_path):
    folder = tmp_path / "set#1"
    folder.mkdir()
    p = folder / "DrawBench.csv"
    p.write_bytes(DRAWBENCH)
    assert read_prompt_file(f"drawbench:{p}", "k") == ALL_PROMPTS
    assert read_prompt_file(f"drawbench:{p}#Colors", "k") == ALL_PROMPTS[:2]


def test_a_missing_file_names_key_and_path(tmp_path):
    path = str(tmp_path / "absent.csv")
    for spec in (f"drawbench:{path}", f"drawbench:{path}#Colors", f"csv:{path}#text"):
        line = refused(spec)
        assert path in line and "does not exist" in line, line


def test_a_missing_column_names_it_and_the_header(tmp_path):
    p = tmp_path / "other.csv"
    p.write_text("text,kind\na cat,animal\n", encoding="utf-8")
    line = refused(f"drawbench:{p}")
    assert str(p) in line and "'Prompts'" in line and "'text', 'kind'" in line
    line = refused(f"csv:{p}#caption", "data.train_prompts")
    assert str(p) in line and "'caption'" in line


def test_a_category_needs_the_category_column(tmp_path):
    p = tmp_path / "prompts_only.csv"
    p.write_text("Prompts\na cat\n", encoding="utf-8")
    assert read_prompt_file(f"drawbench:{p}", "k") == ["a cat"]
    assert "'Category'" in refused(f"drawbench:{p}#Colors")


def test_a_table_without_prompts_is_refused(tmp_path):
    header_only = tmp_path / "header_only.csv"
    header_only.write_text("Prompts,Category\n\n", encoding="utf-8")
    blank_cells = tmp_path / "blank_cells.csv"
    blank_cells.write_text('Prompts,Category\n ,Colors\n"  ",Text\n', encoding="utf-8")
    for p in (header_only, blank_cells):
        line = refused(f"drawbench:{p}")
        assert str(p) in line and "no prompts" in line, line
    empty = tmp_path / "empty.csv"
    empty.write_bytes(BOM + b"\r\n \r\n")
    line = refused(f"drawbench:{empty}")
    assert str(empty) in line and "empty" in line


def test_csv_needs_a_column(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("Prompts\na cat\n", encoding="utf-8")
    line = refused(f"csv:{p}")
    assert str(p) in line and "COLUMN" in line


def test_a_table_that_is_not_utf8_is_refused(tmp_path):
    p = tmp_path / "latin1.csv"
    p.write_bytes("Prompts\nun caf\u00e9\n".encode("latin-1"))
    assert str(p) in refused(f"drawbench:{p}")


def test_a_malformed_table_names_the_line(tmp_path):
    p = tmp_path / "huge_cell.csv"
    p.write_text("Prompts\na cat\n" + "x" * 200_000 + "\n", encoding="utf-8")  # over csv's field size limit
    line = refused(f"drawbench:{p}")
    assert str(p) in line and "line 3" in line


def test_a_directory_is_not_a_table(tmp_path):
    line = refused(f"drawbench:{tmp_path}")
    assert str(tmp_path) in line and "directory" in line


def test_table_prompts_stream_like_a_file_of_the_same_lines(drawbench, tmp_path):
    text = tmp_path / "same.txt"
    text.write_text("\n".join(ALL_PROMPTS) + "\n", encoding="utf-8")
    for shuffle in (False, True):
        a = PromptStream(read_prompt_file(f"drawbench:{drawbench}", "k"), shuffle, seed=5)
        b = PromptStream(read_prompt_file(str(text), "k"), shuffle, seed=5)
        assert [a.for_step(k, 3) for k in range(1, 6)] == [b.for_step(k, 3) for k in range(1, 6)]
