"""The README and docs/ as a reader follows them: every relative link reaches a file and every
`#anchor` a heading of its target (GitHub's anchors); the README stays a front door that links
every page, names the weights a real run needs and where they come from, and gives the first
command's time as a range; and the pointers to the README's or a docs page's sections in the
scripts, the code and the tests name sections that exist."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 320
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# Where the code, scripts and tests point readers at a section of the README or a docs page.
POINTER_FILES = sorted(
    {*ROOT.glob("slurm/*.sbatch"), ROOT / ".ci" / "run", *ROOT.glob("hpcnft/**/*.py"),
     *ROOT.glob("hpcnft/recipes/*.toml"), *ROOT.glob("tools/*"), *ROOT.glob("tests/**/*.py")}
    - {Path(__file__).resolve()})

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

# A page named by path (docs/x.md, README.md), with an optional #anchor.
PATH_POINTER = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]+?|README)\.md)(#[\w-]+)?")
# A section named in quotes after its page: README "Slurm", `docs/bench/README.md`, "Runs 20–21".
QUOTED_POINTER = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md|README(?:\.md)?)`?(?:'s)?,?\s+\"([^\"\n]+)\"")
# A README section named bare: (README, Testing), README's Determinism.
BARE_POINTER = re.compile(r"(?<![\w/.-])README(?:\.md)?(?:'s|,)\s+([A-Z][\w-]*)")
# A numbered section of a page (architecture.md §5): the pages have no numbered sections.
NUMBERED_POINTER = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\s*§")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, backticks dropped, lower case, every
    character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            yield n, line


def headings(path: Path) -> list[str]:
    return [HEADING.match(line).group(2) for _, line in prose_lines(path.read_text(encoding="utf-8"))
            if HEADING.match(line)]


def anchors(path: Path) -> set[str]:
    """Every anchor of a page: its headings' slugs (a repeated one gets -1, -2, ...) and HTML anchors."""
    found, seen = set(), {}
    for heading in headings(path):
        s = slug(heading)
        found.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return found | set(HTML_ANCHOR.findall(path.read_text(encoding="utf-8")))


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link and image outside code, and of every link definition."""
    found = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        found += [(n, m.group(1)) for m in LINK.finditer(line) if not _inside_code(line, m.start())]
        found += [(n, m.group(1)) for m in LINK_DEFINITION.finditer(line)]
    return found


def _inside_code(line: str, pos: int) -> bool:
    return any(c.start() < pos < c.end() for c in CODE_SPAN.finditer(line))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def link_problems(page: Path) -> list[str]:
    problems = []
    for n, target in links(page):
        if SCHEME.match(target):  # http(s), mailto: not followed here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{rel(page)}:{n}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {rel(dest)}")
    return problems


def resolve_page(name: str) -> Path:
    return README if name in ("README", "README.md") else ROOT / name


def names_a_heading(page: Path, title: str) -> bool:
    """A heading whose text is `title`, or starts with it and a word ends there."""
    title = title.replace("`", "").strip().lower()
    for h in headings(page):
        h = h.replace("`", "").strip().lower()
        if h == title or (h.startswith(title) and not re.match(r"\w", h[len(title)])):
            return True
    return False


def pointer_problems(path: Path) -> list[str]:
    problems = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n"), 1):
        where = f"{rel(path)}:{n}"
        for m in PATH_POINTER.finditer(line):
            page = resolve_page(m.group(1))
            if not page.is_file():
                problems.append(f"{where}: {m.group(1)} does not exist")
            elif m.group(2) and m.group(2)[1:] not in anchors(page):
                problems.append(f"{where}: no heading with anchor {m.group(2)} in {m.group(1)}")
        for m in QUOTED_POINTER.finditer(line):
            page = resolve_page(m.group(1))
            if page.is_file() and not names_a_heading(page, m.group(2)):
                problems.append(f"{where}: {m.group(1)} has no section \"{m.group(2)}\"")
        for m in BARE_POINTER.finditer(line):
            if not names_a_heading(README, m.group(1)):
                problems.append(f"{where}: the README has no section {m.group(1)}")
        for m in NUMBERED_POINTER.finditer(line):
            name = m.group(1)
            if (ROOT / name).is_file() or (ROOT / "docs" / name).is_file():
                problems.append(f"{where}: {name} has no numbered sections; name the page and its heading")
    return problems


def test_slug_follows_githubs_anchors():
    assert slug("Does it learn? `tiny_learns`") == "does-it-learn-tiny_learns"
    assert slug("Performance (one H200, 2026-12-02 and 2026-12-03)") == "performance-one-h200-2026-12-02-and-2026-12-03"
    assert slug("Base models: SD3.5-Large and FLUX.1-dev") == "base-models-sd35-large-and-flux1-dev"
    assert slug("Runs 20–21: Inductor's Triton GEMM templates") == "runs-2021-inductors-triton-gemm-templates"
    assert slug("The run file, `run.h5`") == "the-run-file-runh5"


def test_the_checks_find_a_broken_link_anchor_and_pointer(tmp_path, monkeypatch):
    """The checks themselves: a page with a missing file, a missing anchor, a fenced link (not
    a link) and a good one; a script pointing at sections that do not exist."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Its part\n\n```\n[x](nowhere.md)\n```\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text("# B\n\n[ok](a.md#its-part) [gone](c.md) [wrong](a.md#other) [self](#b) "
                    "`[code](x.md)` [web](https://example.org/x.md)\n", encoding="utf-8")
    assert [p.split(": ", 1)[1] for p in link_problems(page)] == [
        "c.md: no such file", "a.md#other: no heading with anchor #other in docs/a.md"]
    assert link_problems(tmp_path / "docs" / "a.md") == []
    script = tmp_path / "job.sbatch"
    script.write_text('# docs/a.md#its-part, docs/a.md "Its part"; docs/a.md#nope, docs/a.md "Slurm", '
                      "docs/z.md, a.md §2\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "README", tmp_path / "docs" / "a.md")
    assert [p.split(": ", 1)[1] for p in pointer_problems(script)] == [
        "no heading with anchor #nope in docs/a.md", "docs/z.md does not exist",
        'docs/a.md has no section "Slurm"', "a.md has no numbered sections; name the page and its heading"]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(page):
    assert link_problems(page) == []


def test_pointers_in_scripts_code_and_tests_name_sections_that_exist():
    problems = [p for path in POINTER_FILES if path.is_file() for p in pointer_problems(path)]
    problems += [p for page in PAGES for p in pointer_problems(page)]
    assert problems == []


def test_the_slurm_script_points_at_the_slurm_section():
    text = (ROOT / "slurm" / "sd3_pickscore.sbatch").read_text(encoding="utf-8")
    assert "docs/launching.md#slurm" in text
    assert "slurm" in anchors(ROOT / "docs" / "launching.md")


def test_readme_is_a_front_door_that_links_every_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if not SCHEME.match(t)}
    assert [rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked] == []
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text(encoding="utf-8").split("\n")
        assert re.match(r"#{1,2} \S", lines[0]) and lines[1] == "" and lines[2].strip(), rel(page)  # title, then what it covers


def test_readme_says_where_the_weights_come_from():
    """Each model a recipe loads: its Hugging Face id, a download command, and the folder the
    recipe expects by default; the gated ones with their licences."""
    from hpcnft.algo.root_config import load_config

    text = README.read_text(encoding="utf-8").replace("\\\n", " ")  # continued command lines joined
    models = {
        "stabilityai/stable-diffusion-3.5-medium": ("sd35m_pickscore", "sd3_dir"),
        "stabilityai/stable-diffusion-3.5-large": ("sd35l_pickscore", "sd3_dir"),
        "black-forest-labs/FLUX.1-dev": ("flux1dev_pickscore", "flux_dir"),
        "yuvalkirstain/PickScore_v1": ("sd35m_pickscore", "pickscore_dir"),
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K": ("sd35m_pickscore", "pickscore_processor_dir"),
    }
    for repo_id, (recipe, key) in models.items():
        assert re.search(rf"^hf download {re.escape(repo_id)} .*--local-dir", text, re.M), repo_id
        row = next(line for line in text.splitlines() if line.startswith("|") and f"`{repo_id}`" in line)
        assert f"`models.{key}`" in row and f"`{getattr(load_config(recipe).models, key)}`" in row, row
    for repo_id, licence in [("stabilityai/stable-diffusion-3.5-medium", "Stability AI Community License"),
                             ("black-forest-labs/FLUX.1-dev", "FLUX.1 [dev] Non-Commercial License")]:
        row = next(line for line in text.splitlines() if line.startswith("|") and f"`{repo_id}`" in line)
        assert "gated" in row and licence in row, row
    assert "hf auth login" in text and "huggingface-cli" in text


def test_readme_gives_the_first_commands_time_as_a_range_on_2_cores():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The two commands"):text.index("```bash", text.index("## The two commands"))]
    m = re.search(r"(\d+)–(\d+) minutes on 2 cores", " ".join(section.split()))
    assert m and int(m.group(1)) < int(m.group(2)), section
    assert "about 3 minutes" not in section


def test_ci_runs_the_test_tiers_the_readme_gives():
    text = README.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| all (CI) |"))
    command = re.search(r"`(python3 -m pytest [^`]+)`", row).group(1)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    pytest_line = next(line for line in ci.splitlines() if "python3 -m pytest" in line)
    for words in re.findall(r'-m "[^"]+"|-n \d+|--dist \w+', command):
        assert words in pytest_line, words
    assert "python3 -m pip install -e '.[test,ocr]' && python3 -m pytest\n" in text  # no OCR test skips
    assert "-e '.[test]'" in ci and "-e '.[ocr]'" in ci


def test_python_calls_the_pages_show_exist():
    """`hpcnft.x.y(...)` in a page names a function that exists (from Python a run is submitted
    with hpcnft.run.submit.submit; the package's root holds only __version__)."""
    import importlib

    missing = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"`(hpcnft(?:\.\w+)+)\(", page.read_text(encoding="utf-8")))):
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            if not callable(obj):
                missing.append(f"{rel(page)}: {name}")
    assert missing == []


def test_the_readme_gives_each_tiers_test_count_as_the_collection_has_it(pytestconfig):
    """The Testing table's counts are what collecting the whole tree gives (a run that names files
    collects part of it, and cannot tell)."""
    from tiers import COUNTS

    TIER_COUNTS = pytestconfig.stash.get(COUNTS, None)
    if not TIER_COUNTS:
        pytest.skip("this session did not collect the whole tree")
    rows = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[3].isdigit():
            rows[cells[0].split(" ")[0]] = int(cells[3])
    assert rows == {"default": TIER_COUNTS["default"], "slow": TIER_COUNTS["slow"], "hpc": TIER_COUNTS["hpc"],
                    "gpu": TIER_COUNTS["gpu"], "all": TIER_COUNTS["all"]}, TIER_COUNTS
