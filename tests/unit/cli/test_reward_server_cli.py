"""`hpcnft reward-server`'s input: which terms a TERM names, the server's limits, its shared
secret (listening beyond loopback refused without one, before any model loads), and bad input
as one line, exit 2."""
from __future__ import annotations

import os
import time

import pytest

from hpcnft.algo.root_config import load_config
from hpcnft.cli import reward_server
from hpcnft.cli.main import OneLineParser, main
from hpcnft.cli.reward_server import required_token, served_terms, server_limits
from hpcnft.rewards import http_server

TERMS = 'reward.terms=[{kind="pickscore", name="ps", model_dir="/models/ps"}, {kind="remote", name="ocr", ' \
        'url="http://h:1/v1/score/ocr", retry_for_s=30}]'


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["reward-server", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_kinds(capsys):
    with pytest.raises(SystemExit) as e:
        main(["reward-server", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for word in ("TERM", "--recipe", "--set", "--host", "--port", "--device", "--port-file", "jpeg_compressibility",
                 "--max-requests", "--max-body-mib", "--max-per-address", "--head-deadline-s", "--min-body-kib-s",
                 "503", "--token-file",
                 "--insecure-no-token", "HPCNFT_REWARD_TOKEN", "chmod 600"):
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


def parsed(argv: list[str]):
    parser = OneLineParser(prog="hpcnft reward-server")
    reward_server.add_arguments("reward-server", parser)
    return parser.parse_args(argv)


def test_the_limits_reach_the_server_and_default_to_its_own():
    assert server_limits(parsed(["jpeg_compressibility", "--max-requests", "3", "--max-connections", "4",
                                 "--max-per-address", "2", "--max-body-mib", "5", "--head-deadline-s", "2.5",
                                 "--min-body-kib-s", "7"])) == \
        {"max_requests": 3, "max_connections": 4, "max_per_address": 2, "body_budget_bytes": 5 << 20,
         "head_deadline_s": 2.5, "min_body_rate": 7 << 10}
    assert server_limits(parsed(["jpeg_compressibility"])) == \
        {"max_requests": http_server.MAX_REQUESTS, "max_connections": http_server.MAX_CONNECTIONS,
         "max_per_address": http_server.MAX_PER_ADDRESS, "body_budget_bytes": http_server.BODY_BUDGET_BYTES,
         "head_deadline_s": http_server.HEAD_DEADLINE_S, "min_body_rate": http_server.MIN_BODY_RATE}


def test_more_connections_than_the_open_file_limit_allows_is_one_line_and_exit_2(capsys, monkeypatch):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    code = main(["reward-server", "jpeg_compressibility", "--max-connections", str(hard)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"--max-connections {hard} needs {hard + 128} open files" in err and "ulimit -Hn" in err


def test_fewer_connections_than_requests_is_one_line_and_exit_2(capsys):
    assert main(["reward-server", "jpeg_compressibility", "--max-requests", "4", "--max-connections", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("hpcnft reward-server: error: --max-connections 3 is less than --max-requests 4: "
                                 "each admitted request holds a connection\n")


@pytest.mark.parametrize("option,value,needle", [
    ("--max-requests", "0", "must be a whole number >= 1, got '0'"),
    ("--max-requests", "two", "must be a whole number >= 1, got 'two'"),
    ("--max-connections", "0", "must be a whole number >= 1, got '0'"),
    ("--max-body-mib", "-1", "must be a whole number >= 1, got '-1'"),
    ("--max-body-mib", "1.5", "must be a whole number >= 1, got '1.5'"),
    ("--max-per-address", "0", "must be a whole number >= 1, got '0'"),
    ("--head-deadline-s", "0", "must be a number of seconds > 0, got '0'"),
    ("--head-deadline-s", "nan", "must be a number of seconds > 0, got 'nan'"),
    ("--head-deadline-s", "inf", "must be a number of seconds > 0, got 'inf'"),
    ("--min-body-kib-s", "0", "must be a whole number >= 1, got '0'"),
])
def test_a_bad_limit_is_one_line_and_exit_2(capsys, option, value, needle):
    with pytest.raises(SystemExit) as e:
        main(["reward-server", "jpeg_compressibility", option, value])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"hpcnft reward-server: error: argument {option}: {needle}")


TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Neither the config nor any term loads: a refusal of the host comes before them."""
    def never(*args, **kwargs):
        raise AssertionError("a model or the config was loaded")

    monkeypatch.setattr(reward_server, "load_terms", never)
    monkeypatch.setattr("hpcnft.algo.root_config.load_config", never)
    monkeypatch.delenv("HPCNFT_REWARD_TOKEN", raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node12"])
def test_listening_beyond_loopback_without_a_token_is_refused_before_anything_loads(capsys, no_model_loads, host):
    t0 = time.monotonic()
    code, out, err = run(["pickscore", "--host", host, "--port", "0"], capsys)
    assert time.monotonic() - t0 < 5  # a hang guard: nothing was loaded
    assert code == 2 and out == ""
    assert err == (f"hpcnft reward-server: error: --host {host} reaches beyond this machine: give a shared secret "
                   "(--token-file or HPCNFT_REWARD_TOKEN), or --insecure-no-token to serve anyone\n")


def token_file(tmp_path, text: str = TOKEN, mode: int = 0o600) -> str:
    path = tmp_path / "token"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


def test_a_token_file_open_to_others_is_refused_before_anything_loads(capsys, no_model_loads, tmp_path):
    path = token_file(tmp_path, mode=0o644)
    code, out, err = run(["pickscore", "--token-file", path], capsys)
    assert code == 2 and out == ""
    assert err == f"hpcnft reward-server: error: --token-file {path}: open to group or others (mode 0644): " \
                  f"chmod 600 {path}\n"
    code, _, err = run(["pickscore", "--token-file", token_file(tmp_path, "")], capsys)
    assert code == 2 and err.count("\n") == 1 and ": empty; write the token on its first line" in err


def test_a_token_or_the_opt_out_lets_the_server_listen_beyond_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCNFT_REWARD_TOKEN", raising=False)
    assert required_token(parsed(["pickscore", "--host", "0.0.0.0", "--insecure-no-token"])) is None
    assert required_token(parsed(["pickscore", "--host", "0.0.0.0", "--token-file", token_file(tmp_path)])) == TOKEN
    assert required_token(parsed(["pickscore"])) is None  # loopback: no token needed
    monkeypatch.setenv("HPCNFT_REWARD_TOKEN", TOKEN)
    assert required_token(parsed(["pickscore", "--host", "0.0.0.0"])) == TOKEN
    assert required_token(parsed(["pickscore", "--host", "0.0.0.0", "--insecure-no-token"])) == TOKEN  # still asked
