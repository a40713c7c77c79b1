"""Flow-GRPO (Liu et al. 2025): spec (what the rest of hpcnft knows of it), config (`[grpo]`),
formulas (the math, pure functions), sampler (the rollout's SDE with its log-probabilities),
trainer (the updates of a step) and algorithm (its part of an iteration)."""
