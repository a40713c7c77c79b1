"""The RL algorithms by name (algo.name): what each does of an iteration beside the shared rollout,
rewards and evaluation (hpcnft.algo.iteration), one module each: DiffusionNFT (nft_step, with nft,
pairs and trainer) and Flow-GRPO (grpo_step, with grpo, grpo_sampler and grpo_trainer).

An algorithm offers: make_trainer(policy, group, num_train_ranks) (whose step(batch, sigmas, step)
returns the train metrics, and whose optimizer and loss scaler the checkpoints keep),
trained_steps(), pair_flops(flops), metric_keys (run.h5 keys beyond the shared ones),
begin_rollout(learner, step, parts), sample(learner, prompts, noise, chunk, step) -> (final
latents, conditioning, what it keeps), train_batch(learner, step, rollout, rewards, mine) and
old_policy_decay(step)."""
from __future__ import annotations

from hpcnft.algo.grpo_step import GRPOStep
from hpcnft.algo.nft_step import NFTStep

# one implementation per name of algo.name's choices, hpcnft.algo.config.ALGORITHMS (a test holds the two)
ALGORITHMS = {"nft": NFTStep, "flow_grpo": GRPOStep}


def algorithm_for(cfg):
    return ALGORITHMS[cfg.algo.name](cfg)
