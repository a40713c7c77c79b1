"""The bench beside a job (hpcnft.bench.job_settings): the --set items that give the bench's fast
stack a job's own settings, so that the job's iteration is set against it like for like."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.bench.job_settings import NOT_IN_ONE_PROCESS, SECTIONS, bench_stack_config, flat, job_sets
from hpcnft.bench.levers import fast_overrides
from hpcnft.bench.shapes import SHAPES, with_sets

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


@pytest.mark.parametrize("recipe,shapes,sets", [
    ("sd35m_pickscore_grpo", "sd35m", ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=8",
                                       "perf.replicate_frozen_base=true"]),
    ("flux1dev_pickscore", "flux1dev", ["rollout.prompts_per_step=1", "rollout.samples_per_prompt=8",
                                        "rollout.batch_size=4", "train.micro_batch=2", "perf.base_fp8_storage=true",
                                        "perf.replicate_frozen_base=true", "perf.text_encoders=offload"]),
])
def test_the_bench_stack_gets_the_jobs_settings_but_its_sharding(recipe, shapes, sets):
    job = load_config(recipe, sets)
    S = SHAPES[shapes]()
    assert flat(bench_stack_config(S, CUDA, [f"rollout.batch_size={job.rollout.batch_size}",
                                             f"train.micro_batch={job.train.micro_batch}"], job.algo.name)) != flat(job)
    items, left = job_sets(S, CUDA, job)
    assert left == {}
    bench, want = flat(bench_stack_config(S, CUDA, items, job.algo.name)), flat(job)
    for k, v in want.items():
        if k.split(".")[0] in SECTIONS and k not in NOT_IN_ONE_PROCESS:
            assert bench[k] == v, k
    assert bench["algo.name"] == job.algo.name and "determinism.enabled=true" in items
    assert not [i for i in items if i.split("=")[0] in NOT_IN_ONE_PROCESS]
    # the shapes follow the job's sample count and T5 length (per-sample rates, embeddings)
    sized = with_sets(S, fast_overrides(S, CUDA, items))
    assert sized.samples == job.rollout.prompts_per_step * job.rollout.samples_per_prompt
    assert sized.t5_tokens == job.rollout.max_sequence_length
