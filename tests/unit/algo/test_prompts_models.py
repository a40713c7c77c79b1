"""Prompt files and streams (hpcnft.algo.prompts), model folders (hpcnft.models), tiny models
(hpcnft.models.tiny) and the PickScore formula (hpcnft.rewards.pickscore, nft_spec.md §4)."""
from __future__ import annotations

import json
import math
import os
from importlib import resources

import numpy as np
import pytest
import torch
from PIL import Image

from hpcnft.algo.prompts import PromptFileError, PromptStream, read_prompt_file
from hpcnft.models.folders import PICKSCORE_REQUIRED, SD3_REQUIRED, ModelError, check_folder
from hpcnft.models.loading import load_pickscore, load_sd3_pipeline

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ---------------------------------------------------------------------------------------------
# prompt files
# ---------------------------------------------------------------------------------------------
def test_missing_prompt_file_names_key_and_path(tmp_path):
    path = str(tmp_path / "nope.txt")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path, "data.train_prompts")
    assert "data.train_prompts" in str(e.value) and path in str(e.value)


def test_empty_prompt_file_names_key_and_path(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("  \n\t\n\n   \n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(str(p), "data.eval_prompts")
    assert "data.eval_prompts" in str(e.value) and str(p) in str(e.value) and "empty" in str(e.value)


def test_unreadable_prompt_file_names_key_and_path(tmp_path):
    # Tests run as root, who can read any mode; bytes that are not UTF-8 are unreadable for root too.
    p = tmp_path / "binary.txt"
    p.write_bytes(b"a cat\n\xff\xfe\xfa\x80 not utf-8\n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(str(p), "data.train_prompts")
    assert "data.train_prompts" in str(e.value) and str(p) in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["{p}", "csv:{p}#prompt"])
def test_a_nul_byte_is_refused_naming_the_file_and_line(tmp_path, spec):
    # NUL is valid UTF-8, so the bytes decode; no prompt holds one
    p = tmp_path / "prompts.bin"
    p.write_bytes(b"prompt\r\na red cat\r\na blue\x00 dog\r\n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(spec.format(p=p), "data.train_prompts")
    assert str(e.value) == f"data.train_prompts: prompt file {str(p)!r} has a NUL byte on line 3 (not a text file?)"


def test_a_directory_is_not_a_prompt_file(tmp_path):
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(str(tmp_path), "data.train_prompts")
    assert "data.train_prompts" in str(e.value) and str(tmp_path) in str(e.value)


def test_a_directory_is_not_reported_as_missing(tmp_path):
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(str(tmp_path), "data.train_prompts")
    assert "does not exist" not in str(e.value)
    assert "director" in str(e.value) or "not a file" in str(e.value)


def test_prompt_file_lines_are_stripped_and_blank_lines_dropped(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("  a red cat \n\n\tb dog\r\nc  \n")
    assert read_prompt_file(str(p), "k") == ["a red cat", "b dog", "c"]


@pytest.mark.parametrize("name", ["tiny_train_prompts.txt", "tiny_eval_prompts.txt"])
def test_builtin_prompt_files_load(name):
    text = (resources.files("hpcnft.data") / name).read_text(encoding="utf-8")
    expected = [line.strip() for line in text.splitlines() if line.strip()]
    prompts = read_prompt_file(f"builtin:{name}", "data.train_prompts")
    assert prompts == expected and len(prompts) > 0


def test_unknown_builtin_is_refused():
    with pytest.raises(PromptFileError, match="data.train_prompts"):
        read_prompt_file("builtin:nope.txt", "data.train_prompts")


# ---------------------------------------------------------------------------------------------
# prompt stream
# ---------------------------------------------------------------------------------------------
PROMPTS = [f"p{i}" for i in range(5)]


def test_stream_in_file_order_wraps_around():
    s = PromptStream(PROMPTS, shuffle=False, seed=0)
    assert s.for_step(1, 2) == ["p0", "p1"]
    assert s.for_step(2, 2) == ["p2", "p3"]
    assert s.for_step(3, 2) == ["p4", "p0"]
    assert s.for_step(4, 2) == ["p1", "p2"]
    assert s.for_step(1, 7) == ["p0", "p1", "p2", "p3", "p4", "p0", "p1"]


def test_stream_is_a_pure_function_of_the_step():
    for shuffle in (False, True):
        a = PromptStream(PROMPTS, shuffle=shuffle, seed=3)
        forward = [a.for_step(k, 3) for k in range(1, 12)]
        b = PromptStream(PROMPTS, shuffle=shuffle, seed=3)
        backward = [b.for_step(k, 3) for k in range(11, 0, -1)][::-1]
        c = PromptStream(PROMPTS, shuffle=shuffle, seed=3)
        jumping = {k: c.for_step(k, 3) for k in (7, 2, 11, 1, 7, 5, 3, 4, 6, 8, 9, 10)}
        assert forward == backward == [jumping[k] for k in range(1, 12)]


def test_shuffled_stream_is_a_seeded_permutation_per_pass():
    prompts = [f"q{i}" for i in range(10)]
    s = PromptStream(prompts, shuffle=True, seed=42)
    passes = [[s.at(e * 10 + j) for j in range(10)] for e in range(4)]
    for p in passes:
        assert sorted(p) == sorted(prompts)  # each pass is a permutation of the file
    assert passes[0] != prompts  # actually shuffled
    assert len({tuple(p) for p in passes}) > 1  # a new permutation per pass
    # the same across instances with the same seed, different with another seed
    t = PromptStream(prompts, shuffle=True, seed=42)
    assert [[t.at(e * 10 + j) for j in range(10)] for e in range(4)] == passes
    u = PromptStream(prompts, shuffle=True, seed=43)
    assert [[u.at(e * 10 + j) for j in range(10)] for e in range(4)] != passes
    # for_step reads the same endless stream: 3 per step -> step 4 straddles passes 0 and 1
    assert s.for_step(4, 3) == [passes[0][9], passes[1][0], passes[1][1]]


# ---------------------------------------------------------------------------------------------
# model folders
# ---------------------------------------------------------------------------------------------
def _fake_sd3_folder(root, skip: str):
    for rel in SD3_REQUIRED:
        if rel == skip:
            continue
        full = os.path.join(root, rel)
        if rel.endswith(".json"):
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write("{}")
        else:
            os.makedirs(full, exist_ok=True)


def test_check_folder_refuses_a_missing_folder(tmp_path):
    path = str(tmp_path / "absent")
    with pytest.raises(ModelError) as e:
        check_folder("models.sd3_dir", path, SD3_REQUIRED)
    assert "models.sd3_dir" in str(e.value) and path in str(e.value)


def test_check_folder_refuses_an_empty_path():
    with pytest.raises(ModelError, match="models.pickscore_dir"):
        check_folder("models.pickscore_dir", "", PICKSCORE_REQUIRED)


def test_check_folder_names_the_missing_file(tmp_path):
    _fake_sd3_folder(str(tmp_path), skip="transformer/config.json")
    with pytest.raises(ModelError) as e:
        check_folder("models.sd3_dir", str(tmp_path), SD3_REQUIRED)
    msg = str(e.value)
    assert "models.sd3_dir" in msg and "transformer/config.json" in msg and str(tmp_path) in msg
    # complete -> accepted
    _fake_sd3_folder(str(tmp_path), skip="")
    check_folder("models.sd3_dir", str(tmp_path), SD3_REQUIRED)


def test_check_folder_alternatives(tmp_path):
    req = ("preprocessor_config.json|processor_config.json",)
    with pytest.raises(ModelError, match="preprocessor_config.json or processor_config.json"):
        check_folder("models.pickscore_processor_dir", str(tmp_path), req)
    (tmp_path / "processor_config.json").write_text("{}")
    check_folder("models.pickscore_processor_dir", str(tmp_path), req)


def test_load_sd3_pipeline_refuses_an_incomplete_folder_in_one_line(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ModelError) as e:
        load_sd3_pipeline(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "models.sd3_dir" in str(e.value) and "transformer/config.json" in str(e.value)


def test_load_pickscore_turns_a_broken_model_into_one_line(tmp_path, tiny_models):
    _, ps = tiny_models
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelError) as e:
        load_pickscore(str(broken), ps, torch.device("cpu"))
    msg = str(e.value)
    assert msg.startswith("models.pickscore_dir") and str(broken) in msg and "\n" not in msg
    with pytest.raises(ModelError, match="models.pickscore_processor_dir"):
        load_pickscore(ps, str(broken), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_models_build_byte_identical_twice(tmp_path):
    from hpcnft.models.tiny import build_tiny_models, tree_digest

    sd3_a, ps_a = build_tiny_models(str(tmp_path / "a"))
    sd3_b, ps_b = build_tiny_models(str(tmp_path / "b"))
    assert os.path.isfile(os.path.join(sd3_a, "transformer", "config.json"))
    assert tree_digest(sd3_a) == tree_digest(sd3_b)
    assert tree_digest(ps_a) == tree_digest(ps_b)
    assert tree_digest(sd3_a) != tree_digest(ps_a)
    # the digest does see a one-byte change
    cfg = os.path.join(sd3_b, "scheduler", "scheduler_config.json")
    with open(cfg, "a") as f:
        f.write(" ")
    assert tree_digest(sd3_a) != tree_digest(sd3_b)


def test_tiny_folders_pass_the_preflight_checks(tiny_models):
    from hpcnft.models.folders import PROCESSOR_REQUIRED

    sd3, ps = tiny_models
    check_folder("models.sd3_dir", sd3, SD3_REQUIRED)
    check_folder("models.pickscore_dir", ps, PICKSCORE_REQUIRED)
    check_folder("models.pickscore_processor_dir", ps, PROCESSOR_REQUIRED)
    with open(os.path.join(sd3, "scheduler", "scheduler_config.json")) as f:
        sched = json.load(f)
    assert sched["shift"] == 3.0 and sched["num_train_timesteps"] == 1000


# ---------------------------------------------------------------------------------------------
# PickScore
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pickscore(tiny_models):
    _, ps = tiny_models
    return load_pickscore(ps, ps, torch.device("cpu"))


def _emb(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_pickscore_formula(pickscore):
    from hpcnft.rewards.pickscore import PickScoreScorer

    processor, model = pickscore
    prompts = ["a photo of a cat sitting on a red chair", "a panda eating bamboo in the forest",
               "two dogs playing in the snow at sunrise"]
    images = np.random.default_rng(0).integers(0, 256, size=(3, 64, 80, 3), dtype=np.uint8)
    scores = PickScoreScorer(processor, model, torch.device("cpu"))(prompts, images)
    assert scores.shape == (3,) and scores.dtype == torch.float32

    pixels = processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")["pixel_values"]
    text = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = _emb(model.get_image_features(pixel_values=pixels))
        txt = _emb(model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"]))
        cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
        expected = model.logit_scale.exp() * cos / 26
        # the same through CLIP's own forward: diagonal of logits_per_image, divided by 26
        logits = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"],
                       pixel_values=pixels).logits_per_image
    assert torch.allclose(scores, expected.float(), rtol=1e-5, atol=1e-7)
    assert torch.allclose(scores, torch.diagonal(logits).float() / 26, rtol=1e-5, atol=1e-7)
    # the tiny model keeps CLIPConfig's logit_scale_init_value 2.6592 (~ ln(1/0.07)): scale 14.28,
    # far from 1, so a scorer that forgot exp() (or the scale) would fail the checks above
    assert model.logit_scale.exp().item() == pytest.approx(math.exp(2.6592), rel=1e-6)
    # a torch uint8 batch gives the same scores; prompt i is scored against image i only
    assert torch.equal(PickScoreScorer(processor, model, torch.device("cpu"))(prompts, torch.from_numpy(images)),
                       scores)
    swapped = PickScoreScorer(processor, model, torch.device("cpu"))(prompts[::-1], images[::-1].copy())
    assert torch.allclose(swapped, scores.flip(0), rtol=1e-5, atol=1e-7)


def test_pickscore_processor_config_is_clip_h(pickscore):
    ip = pickscore[0].image_processor
    assert ip.do_resize and ip.size["shortest_edge"] == 224
    assert ip.do_center_crop and (ip.crop_size["height"], ip.crop_size["width"]) == (224, 224)
    assert int(ip.resample) == 3  # bicubic
    assert ip.do_rescale and ip.rescale_factor == pytest.approx(1 / 255)
    assert ip.do_normalize
    assert tuple(ip.image_mean) == pytest.approx(CLIP_MEAN, abs=1e-8)
    assert tuple(ip.image_std) == pytest.approx(CLIP_STD, abs=1e-8)


def test_pickscore_processor_resizes_crops_and_normalizes(pickscore):
    processor = pickscore[0]
    # 112 x 224 (h x w): a blue band in columns 40..183, red elsewhere. Shortest side -> 224
    # (x2, 224 x 448); the 224 center crop takes resized columns 112..335 = input 56..167,
    # inside the blue band with a margin well beyond the bicubic kernel.
    im = np.zeros((112, 224, 3), dtype=np.uint8)
    im[:, :, 0] = 255
    im[:, 40:184] = (0, 0, 255)
    px = processor(images=[Image.fromarray(im)], return_tensors="pt")["pixel_values"]
    assert px.shape == (1, 3, 224, 224)
    blue = [(c / 255 - m) / s for c, m, s in zip((0, 0, 255), CLIP_MEAN, CLIP_STD)]
    for ch in range(3):
        assert torch.allclose(px[0, ch], torch.full((224, 224), blue[ch]), atol=1e-3), ch
    # a constant image of another size: every pixel is (c / 255 - mean) / std
    c = (10, 200, 128)
    px = processor(images=[Image.fromarray(np.full((64, 64, 3), c, dtype=np.uint8))],
                   return_tensors="pt")["pixel_values"]
    assert px.shape == (1, 3, 224, 224)
    for ch in range(3):
        assert math.isclose(px[0, ch].mean().item(), (c[ch] / 255 - CLIP_MEAN[ch]) / CLIP_STD[ch], abs_tol=1e-3)
        assert (px[0, ch].max() - px[0, ch].min()).item() < 1e-3
