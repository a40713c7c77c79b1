"""DiffusionNFT (Zheng et al. 2025): spec (what the rest of hpcnft knows of it), config (`[nft]`),
formulas (the math, pure functions), pairs (the trained (sample, sigma) pairs and their noise),
trainer (one optimizer step) and algorithm (its part of an iteration)."""
