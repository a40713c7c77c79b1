"""Python's cyclic garbage collector over a process's life.

torch, diffusers and transformers leave about a million long-lived objects behind their
imports and model loading, and every automatic collection, the interpreter's last one at exit
included, walks all of them: on 2 CPU cores, about 0.5 s of a rank's start and 1 s of its exit.
So collections are held off while a process starts (`hold_off`), the objects alive once the
models are loaded are frozen out of every later collection (`settle`: gc.freeze), and frozen
again before the process exits (`before_exit`). Objects are still freed by reference counting;
only the walks for cycles among them are skipped.
"""
from __future__ import annotations

import gc


def hold_off() -> None:
    """No automatic collection until `settle`: imports and model loading make no garbage cycles
    worth the walks."""
    gc.disable()


def settle() -> None:
    """The long-lived objects are made: freeze them, then collect as usual."""
    gc.freeze()
    gc.enable()


def before_exit(enabled_before: bool) -> None:
    """Spare the interpreter's final collection over every object still alive; a caller in the
    same process (a test calling the command's main) gets collections back as they were."""
    gc.freeze()
    if enabled_before:
        gc.enable()
