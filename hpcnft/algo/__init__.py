"""The algorithm: NFT math, sampling, the policy and its trainer, one iteration, prompts and reward scoring."""
