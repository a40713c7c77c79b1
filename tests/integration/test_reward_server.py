"""`hpcnft reward-server` as a process: a `remote` term scoring through it with the server's
shared secret gets the local terms' scores bit for bit, one without it a 401 at once; serving
anyone beyond loopback (--insecure-no-token) is said on stderr; SIGTERM and SIGINT stop it with
exit code 0."""
from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
import torch

from jobs import start
from hpcnft.algo.root_config import load_config
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.registry import load_term
from hpcnft.rewards.remote import RemoteRewardError, RemoteTerm

TOKEN = "integration-token-0123456789"
PROMPTS = ["a photo of a cat", "a watercolor of a lighthouse at dusk", "two red apples", "an empty room"]


def wait_for_port(proc, port_file: str, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise AssertionError(f"reward-server exited {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("reward-server never wrote its port")
        time.sleep(0.1)
    return int(open(port_file).read())


def stop(proc, sig) -> tuple[int, str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def pickscore_dir(tmp_path_factory) -> str:
    """The tiny PickScore alone (the session's tiny models would build the tiny SD3 as well)."""
    from hpcnft.models.tiny import build_tiny_pickscore

    return build_tiny_pickscore(str(tmp_path_factory.mktemp("pickscore") / "pickscore_tiny"))


@pytest.fixture
def one_thread():
    """The server scores as a reward rank of the tiny recipe: one CPU thread (determinism.cpu_threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(load_config("tiny").determinism.cpu_threads)
    yield
    torch.set_num_threads(old)


def test_remote_terms_through_the_server_score_as_the_local_terms(tmp_path, pickscore_dir, one_thread, monkeypatch):
    port_file = str(tmp_path / "port")
    terms = f'reward.terms=[{{kind="pickscore", name="ps", model_dir="{pickscore_dir}"}}]'
    proc = start("reward-server", "jpeg_compressibility", "ps", "--set", terms, "--port", "0", "--port-file", port_file,
                 env={"HPCNFT_REWARD_TOKEN": TOKEN})
    monkeypatch.setenv("HPCNFT_JUDGE_TOKEN", TOKEN)
    try:
        port = wait_for_port(proc, port_file)
        cfg, cpu = load_config("tiny", [terms]), torch.device("cpu")
        images = np.random.default_rng(7).integers(0, 256, (len(PROMPTS), 64, 64, 3), dtype=np.uint8)
        local_terms = {"jpeg_compressibility": RewardTermConfig(kind="jpeg_compressibility"), "ps": cfg.reward.terms[0]}
        for name, term in local_terms.items():
            local = load_term(term, cfg, cpu)(PROMPTS, images)
            url = f"http://127.0.0.1:{port}/v1/score/{name}"
            served = RemoteTerm(name, url, 60.0, 0, token_env="HPCNFT_JUDGE_TOKEN")(PROMPTS, images)
            assert torch.equal(served.view(torch.int32), local.view(torch.int32)), name
        with pytest.raises(RemoteRewardError, match=r"HTTP 401 .*: no token sent \(token_env is empty\)$"):
            RemoteTerm("ps", url, 60.0, 2)(PROMPTS, images)
    finally:
        code, out, err = stop(proc, signal.SIGTERM)
    assert code == 0, err
    assert re.search(rf"^serving jpeg_compressibility, ps on http://127\.0\.0\.1:{port}$", out, re.M)
    assert err == "reward server: POST /v1/score/ps: 401 a shared secret is required: send Authorization: Bearer " \
                  "<token>\n"  # the refusal alone: no request logged


def test_sigint_stops_the_server_cleanly_and_serving_anyone_is_said(tmp_path):
    port_file = str(tmp_path / "port")
    proc = start("reward-server", "jpeg_incompressibility", "--host", "0.0.0.0", "--insecure-no-token", "--port", "0",
                 "--port-file", port_file, env={"HPCNFT_REWARD_TOKEN": ""})
    port = wait_for_port(proc, port_file)
    code, out, err = stop(proc, signal.SIGINT)
    assert code == 0 and "Traceback" not in err and "interrupted" not in err
    assert err.startswith("hpcnft reward-server: warning: no shared secret (--insecure-no-token): anyone who "
                          f"reaches 0.0.0.0:{port} may use this server\n")
