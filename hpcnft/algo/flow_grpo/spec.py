"""Flow-GRPO as the rest of hpcnft knows it (hpcnft.algo.spec): its `[grpo]` section, what it
refuses of the shared sections, its run.h5 keys."""
from __future__ import annotations

from hpcnft.algo.flow_grpo.config import GRPOConfig
from hpcnft.algo.spec import AlgorithmSpec
from hpcnft.common.errors import ConfigError

TRAIN_KEYS = tuple(f"train/grpo_{s}" for s in ("loss", "approx_kl", "clipfrac", "ratio_mean", "num_timesteps"))


class FlowGRPOSpec(AlgorithmSpec):
    name, title, section, config = "flow_grpo", "Flow-GRPO", "grpo", GRPOConfig
    loss_key = "train/grpo_loss"
    metric_keys = TRAIN_KEYS
    plot_keys = ("train/grpo_loss", "train/grad_norm")
    old_policy_is = "pi_old, which Flow-GRPO sets to theta after every step: theta, which the rollouts sample with"
    implementation = "hpcnft.algo.flow_grpo.algorithm:FlowGRPO"
    sums_virtual_shards = True
    # its SD3.5-M PickScore recipe's (sd35m_pickscore_grpo): CFG 4.5 in the rollout and the trained
    # forward, the KL to the base, 2 updates a step; DiffusionNFT's v_old levers and the fp8 rollout
    # (which its ratio would measure) refused
    bench_overrides = {"rollout.guidance_scale": 4.5, "grpo.kl_beta": 0.01, "grpo.updates_per_step": 2}
    refused_levers = ("perf.old_pass_batch", "perf.v_old_fp8", "perf.rollout_fp8")

    def rank_sample_parts(self, cfg) -> int:
        return cfg.grpo.updates_per_step

    def pair_passes(self, cfg, guidance_passes: int) -> tuple[int, int]:
        """The trained forward and its backward over CFG's passes, the forward again under gradient
        checkpointing, the frozen base's for a KL term: no v_old pass."""
        return guidance_passes * (1 + cfg.train.grad_checkpointing + (cfg.grpo.kl_beta > 0)), guidance_passes

    def one_update(self, cfg, k: int, micro_batch: int) -> dict[str, object]:
        return {**super().one_update(cfg, k, micro_batch), "grpo.updates_per_step": 1}

    def check(self, cfg) -> None:
        refused = {"rollout.solver": (cfg.rollout.solver != "euler", "Flow-GRPO samples with its own SDE "
                                      "(grpo.noise_level); the ODE solvers are DiffusionNFT's rollout"),
                   "rollout.integer_timesteps": (cfg.rollout.integer_timesteps, "Flow-GRPO's DiT gets the float "
                                                 "1000σ while sampling and training alike"),
                   "perf.old_pass_batch": (cfg.perf.old_pass_batch > 0, "DiffusionNFT's v_old pass; Flow-GRPO has "
                                           "none"),
                   "perf.v_old_fp8": (cfg.perf.v_old_fp8, "DiffusionNFT's v_old pass; Flow-GRPO has none"),
                   "perf.rollout_fp8": (cfg.perf.rollout_fp8, "the ratio of Flow-GRPO's clipped objective would "
                                        "measure the rollout's fp8 rounding"),
                   "grpo.kl_beta": (cfg.grpo.kl_beta > 0 and cfg.train.finetune != "lora", "the KL reference is "
                                    "the frozen base, the DiT with its LoRA adapters off: needs "
                                    "train.finetune=\"lora\"")}
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"{key}: {why} (algo.name = \"flow_grpo\")")
        if cfg.samples_per_step % cfg.grpo.updates_per_step:
            raise ConfigError(f"grpo.updates_per_step: the {cfg.samples_per_step} samples of a step do not split into "
                              f"{cfg.grpo.updates_per_step} equal updates")


SPEC = FlowGRPOSpec()
