"""The OCR reward's text side, as the official DiffusionNFT scorer computes it
(NVlabs/DiffusionNFT's ocr.py): the target is the prompt's first double-quoted span
(`prompt.split('"')[1]`); the recognized text (the recognizer's lines of confidence > 0,
joined) and the target are lower-cased with their spaces removed; the distance is 0 where the
target occurs in the text, else their Levenshtein distance (the `Levenshtein` package, as
there), capped at the target's length; the reward is 1 - distance / len(target), so 0 for a
text with nothing of the target, or a recognition that failed.

Pure functions, no torch and no recognizer: the config's prompt check imports this module
without the `ocr` extra (only `distance` needs the Levenshtein package)."""
from __future__ import annotations

from hpcnft.common.errors import ConfigError

QUOTE = '"'
SHOWN_CHARS = 80  # of a refused prompt, in its error line


def quoted_span(prompt: str) -> str | None:
    """The text between the prompt's first two double quotes; None where it has no such pair
    (the official code takes what follows a lone quote, and fails on a prompt without one)."""
    parts = prompt.split(QUOTE)
    return parts[1] if len(parts) >= 3 else None


def normalized(text: str) -> str:
    """Lower-cased, spaces removed (spaces only, as the reference: tabs and newlines stay)."""
    return text.replace(" ", "").lower()


def target(prompt: str) -> str:
    """The normalized text the image should show; ValueError where the prompt has none."""
    span = quoted_span(prompt)
    if span is None:
        raise ValueError("no double-quoted text")
    if not normalized(span):
        raise ValueError("an empty double-quoted text")
    return normalized(span)


def recognized_text(lines) -> str:
    """The recognizer's (text, confidence) lines, in reading order, as one text: the lines of
    confidence > 0 joined without separator (the reference's join)."""
    return "".join(text for text, confidence in lines if confidence > 0)


def distance(recognized: str, wanted: str) -> int:
    """The reference's distance of a recognized text to the normalized target `wanted`."""
    import Levenshtein

    text = normalized(recognized)
    if wanted in text:
        return 0
    return min(Levenshtein.distance(text, wanted), len(wanted))


def reward(recognized: str, wanted: str) -> float:
    """1 - distance / len(target), in [0, 1]."""
    return 1.0 - distance(recognized, wanted) / len(wanted)


def check_prompts(prompts: list[str], key: str, term: str) -> None:
    """ConfigError (one line) naming the first prompt the OCR term `term` could not score."""
    for i, prompt in enumerate(prompts):
        try:
            target(prompt)
        except ValueError as e:
            shown = prompt if len(prompt) <= SHOWN_CHARS else prompt[:SHOWN_CHARS - 3] + "..."
            raise ConfigError(f"{key}: prompt {i + 1} of {len(prompts)} has {e} for the OCR term {term!r} to "
                              f"read (put the text the image should show in double quotes): {shown!r}") from None
