"""The shared secret of the reward server and the remote term: a server with a token answers 401
to a request without it or with another, before reading its body and without logging it; a
token file open to others or empty is refused; listening beyond loopback needs a token; the
remote term sends the token from the variable token_env names and fails at once on a 401,
naming the variable, never the token."""
from __future__ import annotations

import http.client
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.rewards.http_protocol import CONTENT_TYPE, MAX_BODY_BYTES, encode_request
from hpcnft.rewards.http_server import ScoringServer
from hpcnft.rewards.registry import load_term
from hpcnft.rewards.remote import RemoteRewardError, RemoteTerm
from hpcnft.rewards.shared_secret import (MISSING, REFUSED, TokenError, authorization, client_token, is_loopback,
                                          listening_refusal, read_token_file, server_token)
from reward_http import connect, read_answer, serving

TOKEN = "s3cret-token-0123456789abcdef"
PROMPTS = ["a red cube", "a blue ball"]
BODY = encode_request(PROMPTS, np.zeros((2, 8, 8, 3), dtype=np.uint8))
OCR = "/v1/score/ocr"


def zero_term(prompts, imgs):
    return torch.zeros(len(prompts))


def guarded(lines: list, token: str | None = TOKEN) -> ScoringServer:
    return ScoringServer(("127.0.0.1", 0), {"ocr": zero_term}, log=lines.append, token=token)


def request(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def score(port: int, authorization_value: str | None = None, path: str = OCR, body: bytes = BODY):
    headers = {"Content-Type": CONTENT_TYPE}
    if authorization_value is not None:
        headers["Authorization"] = authorization_value
    return request(port, "POST", path, body, headers)


@pytest.mark.parametrize("sent,challenge,needle", [
    (None, "Bearer", "a shared secret is required"),
    ("Basic dXNlcjpwYXNz", "Bearer", "a shared secret is required"),
    (f"Bearer {TOKEN}x", 'Bearer error="invalid_token"', "the token was refused"),
    (f"Bearer {TOKEN[:-1]}", 'Bearer error="invalid_token"', "the token was refused"),
])
def test_a_request_without_the_token_is_401_and_the_token_is_never_logged(sent, challenge, needle):
    lines = []
    with serving(guarded(lines)) as server:
        status, headers, answer = score(server.port, sent)
    assert (status, headers["WWW-Authenticate"], headers["Connection"]) == (401, challenge, "close")
    assert needle in answer["error"] and TOKEN[:8] not in answer["error"]
    assert len(lines) == 1 and lines[0].startswith(f"reward server: POST {OCR}: 401 {needle}")
    assert TOKEN[:8] not in lines[0]


def test_the_right_token_is_scored_and_the_scheme_is_case_insensitive():
    with serving(guarded([])) as server:
        assert score(server.port, f"Bearer {TOKEN}")[::2] == (200, {"scores": [0.0, 0.0]})
        assert score(server.port, f"bearer  {TOKEN} ")[0] == 200


def test_the_token_comes_before_any_other_check_and_before_the_body():
    lines = []
    with serving(guarded(lines)) as server:
        status, _, answer = score(server.port, None, "/v1/score/secret-judge")
        assert status == 401 and "secret-judge" not in answer["error"] and "ocr" not in answer["error"]
        with connect(server.port) as sock:  # a body that never comes: answered at once from the head
            sock.sendall(f"POST {OCR} HTTP/1.1\r\nContent-Type: {CONTENT_TYPE}\r\n"
                         f"Content-Length: {MAX_BODY_BYTES}\r\n\r\n".encode())
            assert read_answer(sock)[0] == 401
        # a large body sent whole is read and dropped: the client sees the answer, not a reset
        assert score(server.port, "Bearer wrong", body=bytes(32 << 20))[0] == 401
    assert server.admission.bytes == 0 and len(lines) == 3


def test_health_needs_the_token_too_where_the_server_has_one():
    with serving(guarded([])) as server:
        status, headers, _ = request(server.port, "GET", "/v1/health", None, {})
        assert (status, headers["WWW-Authenticate"]) == (401, "Bearer")
        status, _, answer = request(server.port, "GET", "/v1/health", None, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and answer["terms"] == ["ocr"]
    with serving(guarded([], token=None)) as server:
        assert request(server.port, "GET", "/v1/health", None, {})[0] == 200
        assert score(server.port)[0] == 200  # no token set: none asked for


def test_only_one_bearer_header_with_the_token_is_authorized():
    token = TOKEN.encode()
    assert authorization([f"Bearer {TOKEN}"], token) is None
    assert authorization([], token) == authorization(["Token abc"], token) == MISSING
    assert authorization(["Bearer "], token) == authorization([f"Bearer {TOKEN} {TOKEN}"], token) == REFUSED
    assert authorization([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], token) == REFUSED


def token_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_a_token_file_gives_its_first_line_stripped(tmp_path):
    assert read_token_file(token_file(tmp_path, f"  {TOKEN}  \nsecond line\n")) == TOKEN
    assert read_token_file(token_file(tmp_path, TOKEN, 0o400)) == TOKEN


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_open_to_others_is_refused_naming_the_file_and_the_fix(tmp_path, mode):
    path = token_file(tmp_path, TOKEN, mode)
    with pytest.raises(TokenError) as e:
        read_token_file(path)
    assert str(e.value) == f"--token-file {path}: open to group or others (mode {mode:04o}): chmod 600 {path}"


@pytest.mark.parametrize("text,needle", [("", "empty"), ("\n" + TOKEN, "empty"), ("   \n", "empty"),
                                         ("tok en with spaces\n", "printable ASCII"),
                                         ("s\u00e9cret-0123456789abcdef", "printable ASCII")])
def test_an_empty_or_unusable_token_file_is_refused(tmp_path, text, needle):
    path = token_file(tmp_path, text)
    with pytest.raises(TokenError) as e:
        read_token_file(path)
    assert str(e.value).startswith(f"--token-file {path}: ") and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_token_file_is_one_line(tmp_path):
    with pytest.raises(TokenError, match=r"^--token-file \S+absent: No such file or directory$"):
        read_token_file(str(tmp_path / "absent"))


def test_the_server_token_is_the_files_else_the_environments(tmp_path):
    env = {"HPCNFT_REWARD_TOKEN": f" {TOKEN}-env "}
    assert server_token(None, {}) is None and server_token(None, {"HPCNFT_REWARD_TOKEN": " "}) is None
    assert server_token(None, env) == f"{TOKEN}-env"
    assert server_token(token_file(tmp_path, TOKEN), env) == TOKEN
    with pytest.raises(TokenError, match=r"^\$HPCNFT_REWARD_TOKEN: a token of 5 characters is easily guessed"):
        server_token(None, {"HPCNFT_REWARD_TOKEN": "short"})


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                           ("localhost", True), ("LOCALHOST", True), ("::ffff:127.0.0.1", True),
                                           ("0.0.0.0", False), ("", False), ("::", False), ("10.1.2.3", False),
                                           ("node12", False), ("localhost.example.org", False)])
def test_only_loopback_addresses_stay_on_this_machine(host, loopback):
    assert is_loopback(host) == loopback
    assert (listening_refusal(host, None, False) is None) == loopback
    assert listening_refusal(host, TOKEN, False) is None and listening_refusal(host, None, True) is None


def test_the_listening_refusal_names_the_ways_out():
    assert listening_refusal("0.0.0.0", None, False) == (
        "--host 0.0.0.0 reaches beyond this machine: give a shared secret (--token-file or HPCNFT_REWARD_TOKEN), "
        "or --insecure-no-token to serve anyone")


# -- the remote term ------------------------------------------------------------------------


def remote_term(server, token_env: str = "HPCNFT_JUDGE_TOKEN", retries: int = 3) -> RemoteTerm:
    url = f"http://127.0.0.1:{server.port}{OCR}"
    return RemoteTerm("ocr", url, 10.0, retries, sleep=lambda s: None, token_env=token_env)


def test_the_remote_term_sends_the_token_of_the_variable_token_env_names(monkeypatch):
    monkeypatch.setenv("HPCNFT_JUDGE_TOKEN", f"{TOKEN}\n")
    with serving(guarded([])) as server:
        assert remote_term(server)(PROMPTS, np.zeros((2, 8, 8, 3), np.uint8)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("value,reason", [
    (None, "no token sent: $HPCNFT_JUDGE_TOKEN (token_env) is unset or empty"),
    ("", "no token sent: $HPCNFT_JUDGE_TOKEN (token_env) is unset or empty"),
    (TOKEN + "-old", "the token from $HPCNFT_JUDGE_TOKEN (token_env) was refused"),
])
def test_a_401_fails_at_once_naming_the_variable_never_the_token(monkeypatch, value, reason):
    if value is None:
        monkeypatch.delenv("HPCNFT_JUDGE_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HPCNFT_JUDGE_TOKEN", value)
    lines = []
    with serving(guarded(lines)) as server:
        term = remote_term(server)
        with pytest.raises(RemoteRewardError) as e:
            term(PROMPTS, np.zeros((2, 8, 8, 3), np.uint8))
    text = str(e.value)
    assert len(lines) == 1  # one request: not retried
    assert text.startswith(f"reward term 'ocr' (remote {term.url}): HTTP 401 (") and text.endswith(f"): {reason}")
    assert "\n" not in text and TOKEN[:8] not in text and TOKEN[:8] not in lines[0]


class Echoing(BaseHTTPRequestHandler):
    """A judge that answers 403 with the Authorization header it got in its error text."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        body = json.dumps({"error": f"forbidden: {self.headers['Authorization']}"}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_403_fails_at_once_and_a_token_echoed_back_is_not_repeated(monkeypatch):
    monkeypatch.setenv("HPCNFT_JUDGE_TOKEN", TOKEN)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echoing)
    server.port, server.requests = server.server_address[1], 0
    with serving(server), pytest.raises(RemoteRewardError) as e:
        remote_term(server)(PROMPTS, np.zeros((2, 8, 8, 3), np.uint8))
    assert server.requests == 1
    assert str(e.value).endswith("HTTP 403 (forbidden: Bearer <token>): the token from $HPCNFT_JUDGE_TOKEN "
                                 "(token_env) was refused")


def test_an_empty_token_env_sends_no_token(monkeypatch):
    monkeypatch.setenv("HPCNFT_REWARD_TOKEN", TOKEN)
    empty = r"HTTP 401 \(.*\): no token sent \(token_env is empty\)$"
    with serving(guarded([])) as server, pytest.raises(RemoteRewardError, match=empty):
        remote_term(server, token_env="")(PROMPTS, np.zeros((2, 8, 8, 3), np.uint8))
    assert client_token("", {"": TOKEN}) is None


def test_an_unusable_token_in_the_variable_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("HPCNFT_JUDGE_TOKEN", "two words")
    with pytest.raises(RemoteRewardError) as e:
        RemoteTerm("ocr", "http://127.0.0.1:9/v1/score/ocr", 1.0, 0, token_env="HPCNFT_JUDGE_TOKEN")
    assert str(e.value) == ("reward term 'ocr' (remote http://127.0.0.1:9/v1/score/ocr): $HPCNFT_JUDGE_TOKEN "
                            "(token_env): the token must be printable ASCII without spaces")


# -- the config ----------------------------------------------------------------------------


def test_token_env_defaults_to_the_servers_variable_and_reaches_the_term_never_its_value(monkeypatch):
    monkeypatch.setenv("HPCNFT_OCR", TOKEN)
    terms = ('reward.terms=[{kind="remote", name="ocr", url="http://h:8000/v1/score/ocr"}, '
             '{kind="remote", name="vlm", url="http://h:8000/v1/score/vlm", token_env="HPCNFT_OCR"}]')
    cfg = load_config("tiny", [terms, "layout.timeout_s=1000"])  # two remote terms' waits
    assert [t.token_env for t in cfg.reward.terms] == ["HPCNFT_REWARD_TOKEN", "HPCNFT_OCR"]
    assert load_term(cfg.reward.terms[1], cfg, torch.device("cpu")).token_env == "HPCNFT_OCR"
    assert TOKEN not in cfg.to_json()


@pytest.mark.parametrize("name,ok", [("HPCNFT_OCR_TOKEN", True), ("", True), ("HPCNFT_", False),
                                     ("hpcnft_ocr", False), ("AWS_SECRET_ACCESS_KEY", False), ("PATH", False),
                                     ("HPCNFT_A-B", False), ("HPCNFT_A B", False), ("HPCNFT_" + "X" * 101, False)])
def test_token_env_must_name_an_hpcnft_variable_or_be_empty(name, ok):
    overrides = [f'reward.terms=[{{kind="remote", url="http://h:8000/v1/score/ocr", token_env="{name}", '
                 'retry_for_s=30}]']
    if ok:
        assert load_config("tiny", overrides).reward.terms[0].token_env == name
    else:
        with pytest.raises(ConfigError, match=r"^reward\.terms\[0\]\.token_env: .* must name an environment "
                                              r"variable HPCNFT_"):
            load_config("tiny", overrides)
