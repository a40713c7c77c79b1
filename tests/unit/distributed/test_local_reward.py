"""The colocated reward client (world 1), synchronous and with perf.overlap_reward: the same
scores in the same order, scoring really off the caller's thread, errors surfacing at collect."""
import threading

import pytest
import torch

from hpcnft.distributed.reward_service import ROLLOUT, LocalRewardClient


def _score_fn(log):
    def score(kind, step, images, ids):
        log.append((threading.current_thread().name, list(ids)))
        return images.float().mean(dim=(1, 2, 3)) * step
    return score


def _chunks():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 8, 8, 3), generator=g, dtype=torch.uint8) for _ in range(5)]


def _run(client):
    pending = [client.submit(ROLLOUT, 3, images, list(range(4 * i, 4 * i + 4))) for i, images in enumerate(_chunks())]
    out = torch.cat([client.collect(p) for p in pending])
    client.finish()
    return out


def test_overlapped_scores_are_the_synchronous_scores_in_order():
    sync_log, overlap_log = [], []
    sync = _run(LocalRewardClient(_score_fn(sync_log)))
    overlapped = _run(LocalRewardClient(_score_fn(overlap_log), overlap=True))
    assert torch.equal(sync, overlapped)
    assert [ids for _, ids in overlap_log] == [ids for _, ids in sync_log]
    assert all(name.startswith("hpcnft-reward") for name, _ in overlap_log)
    assert all(name == threading.current_thread().name for name, _ in sync_log)


def test_submit_returns_before_the_chunk_is_scored():
    release = threading.Event()

    def slow(kind, step, images, ids):
        assert release.wait(30)
        return torch.zeros(len(ids))
    client = LocalRewardClient(slow, overlap=True)
    pending = client.submit(ROLLOUT, 1, _chunks()[0], [0, 1, 2, 3])  # would block forever if synchronous
    assert not pending.done()
    release.set()
    assert client.collect(pending).tolist() == [0.0] * 4
    assert client.server_busy_s > 0
    client.finish()


def test_a_scoring_error_surfaces_at_collect():
    def broken(kind, step, images, ids):
        raise RuntimeError("PickScore out of memory")
    client = LocalRewardClient(broken, overlap=True)
    pending = client.submit(ROLLOUT, 1, _chunks()[0], [0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="out of memory"):
        client.collect(pending)
    client.finish()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_terms_warnings_are_kept_until_taken_in_chunk_order(overlap):
    from hpcnft.common.term_warnings import collected, warn

    def score(kind, step, images, ids):
        warn(f"chunk {ids[0]}")
        return torch.zeros(len(ids))

    client = LocalRewardClient(score, overlap=overlap)
    with collected() as caller:  # the scoring thread's warnings are the client's, not the caller's
        pending = [client.submit(ROLLOUT, 1, images, list(range(4 * i, 4 * i + 4))) for i, images in
                   enumerate(_chunks())]
        for p in pending:
            client.collect(p)
    assert client.take_warnings() == [f"chunk {4 * i}" for i in range(5)] and client.take_warnings() == []
    assert caller == []
    client.finish()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_service_that_stayed_unreachable_is_a_reward_outage_at_collect(overlap):
    # world 1 scores in the training process: a remote term's outage reaches the job as the
    # reward rank's client would give it, at collect, so that the job checkpoints and stops
    from hpcnft.common.errors import OutageError
    from hpcnft.distributed.reward_service import RewardOutage

    class Down(OutageError):
        pass

    def score(kind, step, images, ids):
        raise Down("reward term 'ocr' (remote http://judge/): connection refused after 9 attempts in 30 s")

    client = LocalRewardClient(score, overlap=overlap)
    pending = client.submit(ROLLOUT, 1, torch.zeros(2, 4, 4, 3, dtype=torch.uint8), [0, 1])
    with pytest.raises(RewardOutage, match=r"^reward term 'ocr' .*connection refused after 9 attempts in 30 s$"):
        client.collect(pending)
    client.finish()
