"""Which prompts a step uses (the files, text or a CSV column such as DrawBench's, are read by
hpcnft.io.prompt_files).

Step k (1-based) takes prompts (k-1)*P .. k*P-1 of an endless stream over the file: in file
order, or, with shuffle, in a seeded permutation per pass. The cursor is a pure function of the
step, so a resumed run reads exactly the prompts an uninterrupted one would."""
from __future__ import annotations

import torch

from hpcnft.common.determinism import stable_hash
from hpcnft.io.prompt_files import PromptFileError, read_prompt_file  # noqa: F401 (the job imports both from here)


class PromptStream:
    def __init__(self, prompts: list[str], shuffle: bool, seed: int):
        self.prompts, self.shuffle, self.seed = prompts, shuffle, seed
        self._perm_cache: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(stable_hash("prompt_shuffle", self.seed, epoch))
            self._perm_cache = {epoch: torch.randperm(len(self.prompts), generator=g).tolist()}
        return self._perm_cache[epoch]

    def at(self, position: int) -> str:
        epoch, offset = divmod(position, len(self.prompts))
        return self.prompts[self._order(epoch)[offset] if self.shuffle else offset]

    def for_step(self, step: int, per_step: int) -> list[str]:
        start = (step - 1) * per_step
        return [self.at(start + j) for j in range(per_step)]

    def for_samples(self, step: int, sample_ids, per_step: int, per_prompt: int) -> list[str]:
        """The prompt each sample of a step is generated from and scored against: a step's
        samples come `per_prompt` to a prompt, in the order of the step's prompts."""
        return [self.at((step - 1) * per_step + i // per_prompt) for i in sample_ids]


def pass_of(step: int, per_step: int, num_prompts: int) -> int:
    """The pass over the prompts step k belongs to: that of its first prompt (0-based)."""
    return ((step - 1) * per_step) // num_prompts


def pass_last_step(p: int, per_step: int, num_prompts: int) -> int:
    """The step that holds the last prompt of pass p, which ends it."""
    return ((p + 1) * num_prompts - 1) // per_step + 1


def train_stream(cfg) -> PromptStream:
    """The run's stream of training prompts (every rank holds its own copy)."""
    return PromptStream(read_prompt_file(cfg.data.train_prompts, "data.train_prompts"), cfg.data.shuffle,
                        cfg.train.seed)
