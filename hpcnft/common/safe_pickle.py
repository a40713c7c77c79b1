"""Unpickling with an allow-list: only the globals a caller names can be loaded, so a planted
file (an RNG state, checkpoint metadata) cannot run code."""
from __future__ import annotations

import io
import pickle


class AllowListUnpickler(pickle.Unpickler):
    """`allowed(module, name)` decides each global; a refused one raises UnpicklingError with
    `refusal` formatted with "module.name"."""

    def __init__(self, file, allowed, refusal: str):
        super().__init__(file)
        self._allowed, self._refusal = allowed, refusal

    def find_class(self, module, name):
        if self._allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(self._refusal.format(f"{module}.{name}"))


def loads(blob: bytes, allowed, refusal: str):
    return AllowListUnpickler(io.BytesIO(blob), allowed, refusal).load()
