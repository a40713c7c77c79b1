"""The bench beside a job: the `--set` items that make `hpcnft bench`'s one-process stack run a
job's recipe at the job's own settings (its sample counts, batch sizes, precision, algorithm
values, levers and determinism), so that the job's iteration is set against it like for like
(tools/real_scale_job.py, `--bench auto`). What one process has no counterpart of (the job's
sharding choices) is left out and named."""
from __future__ import annotations

from hpcnft.algo.registry import specs
from hpcnft.bench.levers import fast_overrides
from hpcnft.bench.shapes import Shapes, with_sets
from hpcnft.bench.stack import DEFAULT_ALGO, _toml, bench_config
from hpcnft.common.validation import flatten

# the settings a one-process iteration runs by: these sections, and every algorithm's own
SECTIONS = ("rollout", "train", "perf", "determinism", "optim", *(s.section for s in specs()),
            *(k for s in specs() for k in s.owns))
# the job's sharding and budget choices: a one-process stack has no FSDP2 mesh to apply them to
NOT_IN_ONE_PROCESS = ("perf.replicate_frozen_base", "perf.skip_single_rank_fsdp", "perf.fsdp_cpu_offload",
                      "perf.memory_budget_gib")
# first, so that the fast stack's own batch sizes never exceed the job's samples
SIZES = ("rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.num_steps", "rollout.batch_size",
         "train.micro_batch", "perf.old_pass_batch", "perf.vae_decode_batch")


def flat(cfg) -> dict:
    """A config's values by dotted key."""
    return flatten(cfg.to_dict())


def bench_stack_config(S: Shapes, dev, items: list[str], algo: str):
    """The config `hpcnft bench --shapes S --algo algo --set items` gives its fast stack."""
    from hpcnft.bench.algo_stack import algorithm_overrides

    over = fast_overrides(S, dev, items)
    S = with_sets(S, over)
    return bench_config(S, dev, algorithm_overrides(algo, over, S.family) if algo != DEFAULT_ALGO else over)


def differences(bench: dict, job: dict) -> dict:
    return {k: (bench[k], job[k]) for k in sorted(job) if k.split(".")[0] in SECTIONS and k in bench
            and bench[k] != job[k] and k not in NOT_IN_ONE_PROCESS}


def job_sets(S: Shapes, dev, job) -> tuple[list[str], dict]:
    """(the --set items, what still differs as {key: (bench, job)}) for the bench's fast stack at
    `job`'s settings, algorithm job.algo.name."""
    want = flat(job)
    items = [f"{k}={_toml(want[k])}" for k in SIZES]
    for k in differences(flat(bench_stack_config(S, dev, items, job.algo.name)), want):
        if want[k] is not None:  # (no --set spelling: stays among the differences)
            items.append(f"{k}={_toml(want[k])}")
    return items, differences(flat(bench_stack_config(S, dev, items, job.algo.name)), want)
