"""MixGRPO as the rest of hpcnft knows it (hpcnft.algo.spec): its `[mixgrpo]` section, what it
refuses of the shared sections, its run.h5 keys."""
from __future__ import annotations

from hpcnft.algo.mixgrpo.config import MixGRPOConfig
from hpcnft.algo.spec import AlgorithmSpec
from hpcnft.common.errors import ConfigError

TRAIN_KEYS = tuple(f"train/mix_{s}" for s in ("loss", "approx_kl", "clipfrac", "ratio_mean", "num_timesteps",
                                                  "window_start"))


class MixGRPOSpec(AlgorithmSpec):
    name, title, section, config = "mixgrpo", "MixGRPO", "mixgrpo", MixGRPOConfig
    loss_key = "train/mix_loss"
    metric_keys = TRAIN_KEYS
    plot_keys = ("train/mix_loss", "train/grad_norm", "train/mix_window_start")
    old_policy_is = "pi_old, which MixGRPO sets to theta after every step: theta, which the rollouts sample with"
    implementation = "hpcnft.algo.mixgrpo.algorithm:MixGRPO"
    sums_virtual_shards = True
    refused_levers = ("perf.old_pass_batch", "perf.v_old_fp8", "perf.rollout_fp8")

    def trained_steps(self, cfg) -> int:
        return min(cfg.mixgrpo.window_size, cfg.rollout.num_steps - 2)  # the window's most

    def rank_sample_parts(self, cfg) -> int:
        return cfg.mixgrpo.updates_per_step

    def one_update(self, cfg, k: int, micro_batch: int) -> dict[str, object]:
        return {"mixgrpo.window_size": k, "mixgrpo.updates_per_step": 1, "train.micro_batch": micro_batch}

    def pair_passes(self, cfg, guidance_passes: int) -> tuple[int, int]:
        """The trained forward and its backward over CFG's passes, the forward again under gradient
        checkpointing: no v_old pass, no KL reference."""
        return guidance_passes * (1 + cfg.train.grad_checkpointing), guidance_passes

    def check(self, cfg) -> None:
        refused = {"rollout.solver": (cfg.rollout.solver != "euler", "MixGRPO samples with the ODE's Euler step "
                                      "and Flow-GRPO's SDE in its window"),
                   **{lever: (bool(getattr(cfg.perf, lever.split(".")[1])), "DiffusionNFT's, or one the ratio of "
                              "the clipped objective would measure") for lever in self.refused_levers},
                   "rollout.samples_per_prompt": (cfg.rollout.samples_per_prompt < 2, "MixGRPO's advantages take "
                                                  "each prompt's samples' std (N - 1): at least 2 a prompt")}
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"{key}: {why} (algo.name = \"mixgrpo\")")
        if cfg.rollout.num_steps < 3:
            raise ConfigError("rollout.num_steps: MixGRPO's window lies within the first T - 2 sampler steps: "
                              f"at least 3, got {cfg.rollout.num_steps}")
        if cfg.samples_per_step % cfg.mixgrpo.updates_per_step:
            raise ConfigError(f"mixgrpo.updates_per_step: the {cfg.samples_per_step} samples of a step do not split "
                              f"into {cfg.mixgrpo.updates_per_step} equal updates")


SPEC = MixGRPOSpec()
