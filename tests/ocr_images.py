"""Images for the OCR term's tests: text drawn with PIL in matplotlib's DejaVu Sans (matplotlib is
one of hpcnft's dependencies, so the font is there wherever the tests run), and noise."""
from __future__ import annotations

import numpy as np


def drawn(text: str, size: int, xy: tuple[int, int], side: int = 512, colour=(20, 20, 20),
          background=(245, 240, 230)) -> np.ndarray:
    """uint8 [side, side, 3]: `text` at `xy` in DejaVu Sans of `size` pixels."""
    from matplotlib import font_manager
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans", fallback_to_default=False), size)
    im = Image.new("RGB", (side, side), background)
    ImageDraw.Draw(im).text(xy, text, fill=colour, font=font)
    return np.array(im)


def noise(seed: int, side: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
