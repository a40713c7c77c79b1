"""hpcnft.distributed.reward_service's messages: a malformed request header is refused before anything
is allocated; well-formed ones pass."""
from __future__ import annotations


import pytest

from hpcnft.distributed.reward_service import (DONE, ERROR, EVAL, MAX_CHUNK, MAX_SIDE, ROLLOUT, SNAPSHOT, RewardServiceError,
                                   validate_header)



@pytest.mark.parametrize("header", [
    [ROLLOUT, 1, MAX_CHUNK + 1, 64, 64, 0], [ROLLOUT, 1, 1, MAX_SIDE + 1, 64, 0], [EVAL, 1, 1, 64, 1 << 40, 0],
    [ROLLOUT, 1, MAX_CHUNK, MAX_SIDE, MAX_SIDE, 0],  # each bound alone is fine, together 800 GB
    [ROLLOUT, 1, -1, 64, 64, 0], [ROLLOUT, 1, 4, -64, 64, 0], [ROLLOUT, 1, 0, 64, 64, 0], [ROLLOUT, -5, 4, 64, 64, 0],
    [ROLLOUT, 1, 1 << 62, 1 << 62, 1 << 62, 0],
    [0, 1, 4, 64, 64, 0], [99, 1, 4, 64, 64, 0], [-1, 0, 0, 0, 0, 0], [DONE, 3, 7, 0, 0, 0],
    [ROLLOUT, 1, 4, 64, 64], [ROLLOUT, 1, 4, 64, 64, 0, 0],
])
def test_a_malformed_request_is_an_error_before_any_allocation(header):
    with pytest.raises(RewardServiceError, match="malformed request"):
        validate_header(header)


@pytest.mark.parametrize("header", [[ROLLOUT, 1, 8, 512, 512, 0], [EVAL, 0, 4, 64, 64, 0], [DONE, 3, 0, 0, 0, 0],
                                    [DONE, 3, 1, 0, 0, 0], [ERROR, 0, 0, 0, 0, 0], [SNAPSHOT, 2, 0, 0, 0, 0]])
def test_well_formed_requests_pass(header):
    validate_header(header)
