"""What the rest of hpcnft knows of an RL algorithm without importing torch: an AlgorithmSpec, one
per folder under hpcnft/algo/ (its spec.py), found by name through hpcnft.algo.registry. The
config asks it for its section, the keys only it reads and its recipe checks; run.h5, the
terminal, `hpcnft plot` and `hpcnft show` for its metric keys; the start-up estimate for the DiT
passes of a train pair. Its iteration (sampler, advantages, train step) is the class that
`implementation` names, built by hpcnft.algo.registry.algorithm_for (hpcnft.algo.protocol)."""
from __future__ import annotations

import dataclasses


class AlgorithmSpec:
    name: str = ""  # algo.name
    title: str = ""  # how the docs and the terminal call it
    section: str = ""  # its config section ([nft], [grpo], ...)
    config: type = type(None)  # that section's dataclass
    # the other sections that only this algorithm reads: set away from their defaults under
    # another algorithm, they are refused (with `why`)
    owns: dict[str, str] = {}
    loss_key: str = ""  # the run.h5 key written first every step: a run's last step is its last row
    metric_keys: tuple[str, ...] = ()  # its train/* keys in run.h5, loss_key first
    plot_keys: tuple[str, ...] = ()  # the training curves `hpcnft plot` draws by default
    # what `eval.policy = "old"` evaluates (and `hpcnft export` exports) when this algorithm sets pi_old
    # in its own way; empty: pi_old, the rollout policy
    old_policy_is: str = ""
    implementation: str = ""  # "module:Class" of its hpcnft.algo.protocol.Algorithm
    # `hpcnft bench --algo NAME`: the values its SD3.5-M recipe gives it, and the perf levers it refuses
    bench_overrides: dict[str, object] = {}
    refused_levers: tuple[str, ...] = ()
    # determinism.layout_invariant: its trainer sums a step's virtual shards in a fixed order
    sums_virtual_shards: bool = False

    def section_of(self, cfg):
        return getattr(cfg, self.section)

    def timestep_fraction(self, cfg) -> float:
        """The fraction of the sampler's steps each sample is trained at."""
        return self.section_of(cfg).timestep_fraction

    def trained_steps(self, cfg) -> int:
        """K, the sampler steps each sample is trained at (at most: an algorithm may train fewer
        at some steps)."""
        return int(cfg.rollout.num_steps * self.timestep_fraction(cfg))

    def rank_sample_parts(self, cfg) -> int:
        """The equal parts each train rank's samples of a step split into (optimizer updates per
        rollout, every train rank taking part in each with as many samples)."""
        return 1

    def check(self, cfg) -> None:
        """Refuse, with ConfigError naming the key, what this algorithm cannot run."""

    def pair_passes(self, cfg, guidance_passes: int) -> tuple[int, int]:
        """(DiT forwards, DiT backwards) of one train pair, for the start-up estimate; a guided
        pass counts `guidance_passes` (SD3's CFG: 2)."""
        raise NotImplementedError

    def one_update(self, cfg, k: int, micro_batch: int) -> dict[str, object]:
        """The keys that make a train step one optimizer update over k sampler steps a sample at
        `micro_batch` (what `hpcnft bench` times as a train-pairs call)."""
        return {f"{self.section}.timestep_fraction": k / cfg.rollout.num_steps, "train.micro_batch": micro_batch}

    def changed_keys(self, cfg) -> list[tuple[str, str]]:
        """(key, why) of this algorithm's owned keys set away from their defaults."""
        out = []
        for name, why in {self.section: f"a {self.title} key", **self.owns}.items():
            values, defaults = getattr(cfg, name), type(getattr(cfg, name))()
            out += [(f"{name}.{f.name}", why) for f in dataclasses.fields(values)
                    if getattr(values, f.name) != getattr(defaults, f.name)]
        return out
