"""The guard against reward hacking ([watch] guard_*) and the best checkpoint
(checkpoint.keep_best): what each evaluation says, from the metrics alone. Every train rank
holds the same state (the metrics are the same on every rank); a start rebuilds it from run.h5's
rows, so a resumed run decides as the uninterrupted one would."""
from __future__ import annotations

from dataclasses import dataclass

TRAINED = "rollout/reward/raw_mean"  # the trained reward the guard compares


@dataclass
class Best:
    """The best value of a metric so far, its step, and the trained reward at that step (None at
    the base's evaluation, step 0: then the first trained reward the run has)."""
    value: float | None = None
    step: int = 0
    reward: float | None = None

    def offer(self, step: int, value: float, reward: float | None) -> bool:
        """Take (step, value) if it beats the best (higher is better); whether it did."""
        if self.value is None or value > self.value:
            self.value, self.step, self.reward = value, step, reward
            return True
        return False


@dataclass
class Verdict:
    fired: bool = False  # the held-out metric fell past the drop while the trained reward rose
    text: str = ""  # the line that says so
    new_best: bool = False  # checkpoint.keep_best's metric set a new best at this step


class Guard:
    """`metric` (a held-out judge) against the trained reward: fires at an evaluation where the
    metric is more than `drop` below its best while the trained reward is above its value at
    that best. `keep_best` (another metric, or the same) says where a new best is."""

    def __init__(self, metric: str, drop: float, keep_best: str):
        self.metric, self.drop, self.keep_best = metric, drop, keep_best
        self.best, self.kept = Best(), Best()

    def observe(self, step: int, metrics: dict) -> Verdict:
        """One step's verdict from its metrics (eval/* only where it evaluated). Step 0, the base's
        evaluation (eval.at_start), counts for the guard's best, not for the best checkpoint (there
        is no checkpoint of step 0)."""
        verdict = Verdict()
        reward = metrics.get(TRAINED)
        if self.best.value is not None and self.best.reward is None:
            self.best.reward = reward  # a best at step 0: the reward to beat is the first one trained
        if self.keep_best and self.keep_best in metrics and step > 0:
            verdict.new_best = self.kept.offer(step, metrics[self.keep_best], reward)
        if not self.metric or self.metric not in metrics:
            return verdict
        value = metrics[self.metric]
        if self.best.offer(step, value, reward) or reward is None or self.best.reward is None:
            return verdict
        fell, rose = self.best.value - value, reward - self.best.reward
        if fell > self.drop and rose > 0:
            verdict.fired = True
            verdict.text = (f"guard: {self.metric} fell {fell:.4g} from its best {self.best.value:.4g} (step "
                            f"{self.best.step}) to {value:.4g} while the trained reward rose {rose:.4g} "
                            f"({self.best.reward:.4g} -> {reward:.4g})")
        return verdict

    def replay(self, rows: dict[int, dict]) -> None:
        """The state after `rows` (run.h5's rows by step), observed in step order as the run
        observed them."""
        for step in sorted(rows):
            self.observe(step, rows[step])
