"""`hpcnft score`: image files scored by the terms' own code, one line per image and term or one
JSON document, each file with its prompt; a run's sample grid scored cell by cell against the
prompts its cells were made from (their mean is the run's rollout reward of that step); bad files
and missing prompts one line and exit 2."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from jobs import hpcnft
from hpcnft.cli.main import main
from hpcnft.io.runfile import read_run

OPEN_LATE = 'a sign that says "OPEN LATE"'


def sign(path, text="OPEN LATE", fmt="PNG") -> str:
    from matplotlib import font_manager
    from PIL import ImageDraw, ImageFont

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans", fallback_to_default=False), 56)
    im = Image.new("RGB", (512, 512), (250, 250, 245))
    ImageDraw.Draw(im).text((60, 220), text, fill=(10, 10, 10), font=font)
    im.save(path, format=fmt, quality=90)
    return str(path)


def noise(path) -> str:
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_a_drawn_sign_scores_high_and_noise_low_with_the_ocr_term(tmp_path):
    pytest.importorskip("rapidocr_onnxruntime")
    files = [sign(tmp_path / "sign.png"), sign(tmp_path / "sign.jpg", fmt="JPEG"), noise(tmp_path / "noise.png")]
    r = hpcnft("score", "--term", "ocr", "--term", "jpeg_incompressibility", "--prompt", OPEN_LATE, *files)
    lines = [line.split() for line in r.stdout.strip().splitlines()]
    terms = ("ocr", "jpeg_incompressibility")
    assert [(path, term) for path, term, _ in lines] == [(f, t) for f in files for t in terms]
    ocr = {path: float(score) for path, term, score in lines if term == "ocr"}
    assert ocr[files[0]] >= 0.9 and ocr[files[1]] >= 0.9 and ocr[files[2]] <= 0.3, r.stdout
    kb = {path: float(score) for path, term, score in lines if term == "jpeg_incompressibility"}
    assert kb[files[2]] > 10 * kb[files[0]]  # the noise is far larger as a JPEG: the term's own code ran
    assert r.stderr == ""


def test_a_16_bit_and_a_transparent_sign_read_as_they_look(tmp_path):
    """Once read as white (16-bit greyscale) and as black on black (alpha dropped): both scored 0."""
    pytest.importorskip("rapidocr_onnxruntime")
    grey = np.asarray(Image.open(sign(tmp_path / "sign.png")).convert("L"))
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "deep.png")
    clear = np.zeros((512, 512, 4), np.uint8)  # black ink on a transparent field that is black beneath
    clear[..., 3] = 255 - grey
    Image.fromarray(clear, "RGBA").save(tmp_path / "clear.png")
    files = [str(tmp_path / "deep.png"), str(tmp_path / "clear.png")]
    r = hpcnft("score", "--term", "ocr", "--prompt", OPEN_LATE, *files)
    scores = [float(line.split()[2]) for line in r.stdout.strip().splitlines()]
    assert min(scores) >= 0.9, r.stdout


def test_a_runs_sample_grid_is_scored_against_the_prompts_of_its_cells(tiny_run, tmp_path):
    grid = os.path.join(tiny_run.run_dir, "samples", "step_000001.png")
    files = [noise(tmp_path / "a.png"), noise(tmp_path / "b.png")]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond prompt\n")  # the plain files' prompts; the grid has its own
    # the tiny recipe's term: its tiny PickScore, as the run scored
    doc = json.loads(hpcnft("score", "--json", "--prompts", str(prompts), files[0], grid, files[1]).stdout)
    assert doc["terms"] == ["pickscore"] and doc["warnings"] == []
    rows = doc["images"]
    assert [(row["image"], row["prompt"]) for row in (rows[0], rows[-1])] == [(files[0], "first prompt"),
                                                                              (files[1], "second prompt")]
    rows = rows[1:-1]
    run = read_run(tiny_run.run_dir)
    from hpcnft.algo.prompts import train_stream
    from hpcnft.algo.root_config import config_from_dict

    cfg = config_from_dict(run.config)
    assert len(rows) == cfg.samples_per_step  # the tiny run's grid shows every sample of the step
    step_prompts = train_stream(cfg).for_step(1, cfg.rollout.prompts_per_step)
    assert [row["prompt"] for row in rows] == [p for p in step_prompts for _ in range(cfg.rollout.samples_per_prompt)]
    assert [row["image"] for row in rows] == [f"{grid}#{k}" for k in range(len(rows))]
    mean = np.mean([row["scores"]["pickscore"] for row in rows])
    # the run scored chunks of rollout.batch_size, here one image at a time: rounding apart, the same
    assert mean == pytest.approx(run.metrics["rollout/reward/raw_mean"][0, 1], rel=1e-5, abs=1e-6)


def bad(argv, capsys) -> str:
    assert main(["score", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    good = noise(tmp_path / "good.png")
    (tmp_path / "text.png").write_text("not an image")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(open(good, "rb").read()[:3000])
    term = ["--term", "jpeg_compressibility"]
    assert bad([*term, "--prompt", "p", str(tmp_path / "text.png")], capsys) == (
        f"hpcnft score: error: {tmp_path / 'text.png'}: not an image file Pillow can read "
        f"(cannot identify image file '{tmp_path / 'text.png'}')")
    assert "not an image file Pillow can read" in bad([*term, "--prompt", "p", str(truncated)], capsys)
    assert bad([*term, "--prompt", "p", str(tmp_path / "gone.png")], capsys).endswith("gone.png: no such file")
    assert bad([*term, "--prompt", "p", str(tmp_path)], capsys).endswith("a directory, not an image file")
    assert bad([*term, good], capsys) == (f"hpcnft score: error: no prompt for {good}: give --prompt TEXT or "
                                          "--prompts FILE")
    two = tmp_path / "two.txt"
    two.write_text("a\nb\n")
    assert "2 prompts for 3 image files" in bad([*term, "--prompts", str(two), good, good, good], capsys)
    assert "prompt file" in bad([*term, "--prompts", str(tmp_path / "none.txt"), good], capsys)
    assert "unknown term 'nope'" in bad(["--term", "nope", "--prompt", "p", good], capsys)
    assert bad(["--term", "ocr", "--prompt", "a sign", good], capsys) == (
        f"hpcnft score: error: the prompt of {good}: has no double-quoted text for the OCR term 'ocr' to read "
        "(put the text the image should show in double quotes): 'a sign'")


def test_score_is_a_command_with_its_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["score", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--prompt" in out and "--prompts FILE" in out and "RUN_DIR/samples/step_*.png" in out and "ocr" in out
