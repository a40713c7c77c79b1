"""`hpcnft reward-server`'s input: which terms a TERM names, and bad input as one line, exit 2."""
from __future__ import annotations

import pytest

from hpcnft.cli.main import main
from hpcnft.cli.reward_server import served_terms
from hpcnft.common.config import load_config

TERMS = 'reward.terms=[{kind="pickscore", name="ps", model_dir="/models/ps"}, {kind="remote", name="ocr", ' \
        'url="http://h:1/v1/score/ocr"}]'


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["reward-server", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_kinds(capsys):
    with pytest.raises(SystemExit) as e:
        main(["reward-server", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for word in ("TERM", "--recipe", "--set", "--host", "--port", "--device", "--port-file", "jpeg_compressibility"):
        assert word in out


def test_an_unknown_term_is_one_line_and_exit_2(capsys):
    code, out, err = run(["jpeg_compressibility", "nope"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hpcnft reward-server: error: unknown term 'nope'")


@pytest.mark.parametrize("argv", [["remote"], ["ocr", "--set", TERMS]])
def test_a_remote_term_is_not_served(capsys, argv):
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "is a remote term itself" in err


def test_a_bad_override_is_one_line_and_exit_2(capsys):
    code, _, err = run(["pickscore", "--set", "reward.terms=[{kind=\"nope\"}]"], capsys)
    assert code == 2 and err.count("\n") == 1 and "reward.terms[0].kind" in err


def test_a_term_is_the_recipes_term_of_that_name_else_the_kinds_defaults():
    cfg = load_config("tiny", [TERMS])
    ps, jpeg, pickscore = served_terms(["ps", "jpeg_incompressibility", "pickscore"], cfg)
    assert (ps.kind, ps.name, ps.model_dir) == ("pickscore", "ps", "/models/ps")
    assert (jpeg.kind, jpeg.name) == ("jpeg_incompressibility", "jpeg_incompressibility")
    assert (pickscore.kind, pickscore.name, pickscore.model_dir) == ("pickscore", "pickscore", "")


def test_a_missing_model_folder_is_one_line_naming_the_term(capsys, tmp_path):
    missing = str(tmp_path / "absent")
    code, _, err = run(["pickscore", "--set", f'reward.terms=[{{kind="pickscore", model_dir="{missing}"}}]'], capsys)
    assert code == 2 and err.count("\n") == 1 and "term 'pickscore'" in err and missing in err
