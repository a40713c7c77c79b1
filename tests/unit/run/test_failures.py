"""The job's first failure is claimed by one rank, which alone prints it; a new start claims afresh."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from hpcnft.run.failures import FAILURE_CLAIM, claim_failure, clear_failure_claim, failed_rank


def test_the_first_claim_wins_and_stays_its_ranks(tmp_path):
    os.makedirs(tmp_path / "logs")
    assert failed_rank(str(tmp_path)) is None
    with ThreadPoolExecutor(4) as pool:
        won = list(pool.map(lambda r: claim_failure(str(tmp_path), r), range(4)))
    assert won.count(True) == 1
    winner = won.index(True)
    assert failed_rank(str(tmp_path)) == winner
    assert claim_failure(str(tmp_path), winner)  # asked again (train_main, then entry): still its own
    clear_failure_claim(str(tmp_path))
    assert failed_rank(str(tmp_path)) is None and not (tmp_path / FAILURE_CLAIM).exists()
    clear_failure_claim(str(tmp_path))  # nothing to clear: no error


def test_a_claim_that_cannot_be_written_is_said_rather_than_lost(tmp_path):
    assert claim_failure(str(tmp_path / "no" / "such" / "dir"), 1)
