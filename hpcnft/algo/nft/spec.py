"""DiffusionNFT as the rest of hpcnft knows it (hpcnft.algo.spec): its `[nft]` section, the old
policy's EMA in `[ema]`, its run.h5 keys."""
from __future__ import annotations

from hpcnft.algo.nft.config import NFTConfig
from hpcnft.algo.spec import AlgorithmSpec

TRAIN_KEYS = tuple(f"train/nft_{s}" for s in ("loss", "loss_per_pair", "pos_loss", "neg_loss", "r_mean", "adv_mean",
                                               "t_mean", "num_timesteps"))


class NFTSpec(AlgorithmSpec):
    name, title, section, config = "nft", "DiffusionNFT", "nft", NFTConfig
    owns = {"ema": "DiffusionNFT's old-policy EMA"}
    loss_key = "train/nft_loss"
    metric_keys = TRAIN_KEYS
    plot_keys = ("train/nft_loss", "train/grad_norm", "train/nft_pos_loss")
    implementation = "hpcnft.algo.nft.algorithm:NFT"
    sums_virtual_shards = True

    def pair_passes(self, cfg, guidance_passes: int) -> tuple[int, int]:
        """v_old (no grad), the trained forward, its backward, the forward again under gradient
        checkpointing, the frozen base's for a KL term; all unguided."""
        return 2 + cfg.train.grad_checkpointing + (cfg.nft.kl_beta > 0), 1


SPEC = NFTSpec()
