"""The job's first failure is claimed by one rank, which alone prints it; a rank that only saw a
peer go waits for the cause's claim; a new start claims afresh."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcnft.distributed.reward_service import RewardServiceError
from hpcnft.run.failures import FailureClaim
from hpcnft.run.output import claim_first_failure, is_consequence


def test_the_first_claim_wins_and_stays_its_ranks(tmp_path):
    os.makedirs(tmp_path / "logs")
    claim = FailureClaim(str(tmp_path))
    assert claim.holder() is None
    with ThreadPoolExecutor(4) as pool:
        won = list(pool.map(claim.claim, range(4)))
    assert won.count(True) == 1
    winner = won.index(True)
    assert claim.holder() == winner
    assert claim.claim(winner)  # asked again (train_main, then entry): still its own
    claim.clear()
    assert claim.holder() is None and not os.path.lexists(claim.path)
    claim.clear()  # nothing to clear: no error


def test_a_claim_that_cannot_be_made_is_said_rather_than_lost(tmp_path):
    assert FailureClaim(str(tmp_path / "no" / "such" / "dir")).claim(1)


def test_a_claim_is_made_on_a_full_disk(tmp_path):
    """A symbolic link needs no data block: the cause of a full disk still claims its failure."""
    from hardening_tools import small_tmpfs

    mnt = str(tmp_path / "mnt")
    with small_tmpfs(mnt, "64k"):
        os.makedirs(os.path.join(mnt, "logs"))
        with open(os.path.join(mnt, "filler"), "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 4096)
        claim = FailureClaim(mnt)
        assert claim.claim(0) and not claim.claim(1) and claim.holder() == 0


@pytest.mark.parametrize("error,consequence", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:51436"), True),
    (RuntimeError("[../pair.cc:537] Read error [10.0.0.3]:4711: Connection reset by peer"), True),
    (RewardServiceError("reward rank 2 failed: RemoteRewardError: reward term 'ocr' ..."), True),
    (RewardServiceError("lost the connection while waiting for scores from reward rank 2 (...)"), True),
    (RewardServiceError("scoring failed: RemoteRewardError: reward term 'ocr' ..."), False),
    (OSError(28, "No space left on device"), False),
    (ValueError("a bug"), False),
])
def test_an_error_that_only_says_a_peer_is_gone_is_a_consequence(error, consequence):
    assert is_consequence(error) is consequence


def test_a_consequence_waits_for_the_causes_claim(tmp_path):
    os.makedirs(tmp_path / "logs")
    lost = RuntimeError("Connection closed by peer [127.0.0.1]:1")
    late_cause = threading.Timer(0.5, lambda: FailureClaim(str(tmp_path)).claim(2))
    late_cause.start()
    assert not claim_first_failure(str(tmp_path), 0, lost)  # rank 2 claimed while rank 0 waited
    assert FailureClaim(str(tmp_path)).holder() == 2
