"""The OCR task end to end with its real recognizer: `tiny_ocr` (2 train ranks + 1 reward rank
scoring with PP-OCRv4) run twice gives the same bits, and resumed after its first step the bits
of the uninterrupted run; the `ocr` term served by `hpcnft reward-server` scores through a
`remote` term as it scores locally, and refuses a prompt without quoted text with its reason.
Skipped where the `ocr` extra is not installed."""
from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

from jobs import assert_same_metrics, hpcnft, start
from ocr_images import drawn
from hpcnft.algo.root_config import load_config
from hpcnft.io.runfile import read_run
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.registry import load_term
from hpcnft.rewards.remote import RemoteRewardError, RemoteTerm
from test_reward_server import stop, wait_for_port

pytestmark = pytest.mark.slow
pytest.importorskip("rapidocr_onnxruntime")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """tiny_ocr for 2 steps twice, and once as 1 step then resumed to 2."""
    root = tmp_path_factory.mktemp("ocr")
    out = {name: str(root / name) for name in ("first", "second", "resumed")}
    hpcnft("run", "tiny_ocr", "--steps", "2", "--run-dir", out["first"])
    hpcnft("run", "tiny_ocr", "--steps", "2", "--run-dir", out["second"])
    hpcnft("run", "tiny_ocr", "--steps", "1", "--run-dir", out["resumed"])
    out["resume_stdout"] = hpcnft("run", "tiny_ocr", "--steps", "2", "--run-dir", out["resumed"]).stdout
    return out


def test_tiny_ocr_scores_with_the_ocr_term_and_twice_gives_the_same_bits(runs):
    m = read_run(runs["first"]).metrics
    assert m["rollout/reward/ocr/mean"][:, 0].tolist() == [1.0, 2.0]
    assert m["eval/ocr_mean"][:, 0].tolist() == [2.0]
    assert ((m["rollout/reward/ocr/mean"][:, 1] >= 0) & (m["rollout/reward/ocr/mean"][:, 1] <= 1)).all()
    assert_same_metrics(runs["first"], runs["second"])
    assert hpcnft("compare", runs["first"], runs["second"]).stdout.startswith("same:")


def test_tiny_ocr_resumed_after_its_first_step_gives_the_uninterrupted_bits(runs):
    assert "resuming after step 1" in runs["resume_stdout"]
    assert [a["from_step"] for a in read_run(runs["resumed"]).attempts] == [0, 1]
    assert_same_metrics(runs["first"], runs["resumed"])


def test_the_ocr_term_through_the_reward_server_scores_as_it_does_locally(tmp_path):
    port_file = str(tmp_path / "port")
    proc = start("reward-server", "ocr", "--recipe", "tiny_ocr", "--port", "0", "--port-file", port_file)
    try:
        port = wait_for_port(proc, port_file)
        url = f"http://127.0.0.1:{port}/v1/score/ocr"
        prompts = ['a sign that says "OPEN LATE"', 'a cup printed with "TEA"', 'a "ROCK" poster']
        images = np.stack([drawn("OPEN LATE", 56, (40, 220)), drawn("TEA", 30, (300, 40)), drawn("ROLL", 64, (90, 90))])
        cfg = load_config("tiny_ocr")
        local = load_term(RewardTermConfig(kind="ocr"), cfg, torch.device("cpu"))(prompts, images)
        served = RemoteTerm("ocr", url, 120.0, 0, token_env="")(prompts, images)
        assert torch.equal(served.view(torch.int32), local.view(torch.int32))
        assert served[0] == 1.0 and served[1] == 1.0 and 0 < served[2] < 1  # "roll" for "rock": 1 - 2/4
        with pytest.raises(RemoteRewardError, match=r"HTTP 500 \(term 'ocr' failed: ValueError: reward term 'ocr': "
                                                     r"prompt 1 has no double-quoted text"):
            RemoteTerm("ocr", url, 120.0, 0, token_env="")(["a sign"], images[:1])
    finally:
        code, _, err = stop(proc, signal.SIGTERM)
    assert code == 0, err
