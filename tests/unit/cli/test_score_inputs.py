"""What `hpcnft score` reads (hpcnft.cli.score_inputs): each file named takes its own prompt, in
order, even a file named twice; a 16-bit greyscale PNG reads as its 8-bit picture, not white;
transparency is composited onto white as transformers' CLIP processor does; 32-bit and float
pixels are refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from hpcnft.cli.score_inputs import inputs, read_image
from hpcnft.common.errors import UsageError


def _gradient() -> np.ndarray:
    return np.tile(np.arange(0, 256, 4, dtype=np.uint8), (8, 1))  # [8, 64]


def test_a_file_named_twice_takes_a_prompt_each_time(tmp_path):
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    Image.fromarray(_gradient()).save(a)
    Image.fromarray(_gradient()).save(b)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\nthird\n")
    assert [(item.label, item.prompt) for item in inputs([a, b, a], None, str(prompts))] == [
        (a, "first"), (b, "second"), (a, "third")]


def test_a_16_bit_greyscale_png_reads_as_its_8_bit_picture(tmp_path):
    grey = _gradient()
    path = tmp_path / "deep.png"
    Image.fromarray(grey.astype(np.uint16) * 257).save(path)  # the picture at 16 bits, as tools export it
    with Image.open(path) as im:
        assert im.mode == "I;16"  # what Pillow makes of it; convert("RGB") would clip it to white
    assert np.array_equal(read_image(str(path)), np.repeat(grey[..., None], 3, axis=2))


def test_transparency_is_composited_onto_white_as_the_clip_processor_does(tmp_path):
    from transformers.image_transforms import convert_to_rgb

    rgba = np.zeros((8, 64, 4), np.uint8)  # black where transparent: dropping alpha would leave it black
    rgba[..., 0] = _gradient()
    rgba[..., 3] = _gradient()[:, ::-1]
    rgba[0, 0] = 0  # wholly transparent
    cases = {"rgba.png": Image.fromarray(rgba, "RGBA"), "la.png": Image.fromarray(rgba[..., [0, 3]], "LA")}
    palette = Image.fromarray(_gradient() // 64, "P")
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    palette.info["transparency"] = 0  # a PNG's transparent colour: no alpha band
    cases["palette.png"] = palette
    for name, im in cases.items():
        im.save(tmp_path / name)
        with Image.open(tmp_path / name) as opened:
            official = convert_to_rgb(opened, return_numpy=True)
        got = read_image(str(tmp_path / name))
        assert np.array_equal(got, official), name
    assert read_image(str(tmp_path / "rgba.png"))[0, 0].tolist() == [255, 255, 255]
    assert read_image(str(tmp_path / "palette.png"))[0, 0].tolist() == [255, 255, 255]  # colour 0: clear


def test_32_bit_and_float_pixels_are_refused_in_one_line(tmp_path):
    for mode, name in (("I", "int.tif"), ("F", "float.tif")):
        Image.new(mode, (4, 4), 70000).save(tmp_path / name)
        with pytest.raises(UsageError) as e:
            read_image(str(tmp_path / name))
        assert str(e.value).startswith(f"{tmp_path / name}: ") and "hpcnft scores 8- or 16-bit images" in str(e.value)
        assert len(str(e.value).splitlines()) == 1
