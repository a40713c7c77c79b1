"""MixGRPO (Li et al. 2025, Tencent-Hunyuan/MixGRPO): the rollout samples with the ODE but for a
window of steps sampled with Flow-GRPO's SDE, only the window's transitions are trained, and the
window slides along the sampler's grid as training goes on. spec (what the rest of hpcnft knows of
it), config (`[mixgrpo]`), formulas (the window, the advantages), sampler (the mixed ODE/SDE
rollout), trainer and algorithm (its part of an iteration)."""
