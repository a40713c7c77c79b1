"""perf.base_fp8_storage end to end: a tiny 2+1 job (two train ranks under FSDP2, whose groups
hold the e4m3 weights beside the half-precision ones) says what the stored base holds, learns
its adapters, and resumed after its first step ends with the bits of the uninterrupted run
(checkpoints hold no frozen weight: each start stores the base again alike)."""
from __future__ import annotations

import pytest

from jobs import assert_resumed_after_step_one_is_uninterrupted
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow
FP8_BASE = ["--set", "perf.base_fp8_storage=true", "--set", 'train.precision="fp16"']


def test_an_fp8_base_job_resumes_bit_for_bit(tmp_path, hpcnft_cache):
    done = assert_resumed_after_step_one_is_uninterrupted(tmp_path, *FP8_BASE)
    assert "perf.base_fp8_storage: the blocks' frozen linears hold" in done.stdout + done.stderr
    assert read_run(str(tmp_path / "whole")).config["perf"]["base_fp8_storage"] is True
