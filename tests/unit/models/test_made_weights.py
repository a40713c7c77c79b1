"""`hpcnft make-weights`: the real repositories' manifests against the installed classes and the
published file sizes, tokenizers of the real vocabularies, and folders at the real shapes that the
real loaders read (the small parts here; PickScore whole in the slow tier; SD3.5-M whole on a GPU,
tests/gpu/test_real_scale_job.py)."""
from __future__ import annotations

import copy
import hashlib
import os

import pytest

from hpcnft.models.made import manifest as mf


@pytest.mark.parametrize("name", mf.MANIFESTS)
def test_the_manifest_is_the_classes_at_its_configs_split_as_the_repository_is(name):
    """Each part's tensor table is its class's state dict at the config; the shards of those
    tensors, split as save_pretrained splits them, are the published files, each the published
    size less a header of under 1 MiB (SD3.5-M's transformer size is not recorded)."""
    assert mf.problems(mf.load(name)) == []


def test_a_config_off_by_one_width_misses_the_published_sizes():
    m = copy.deepcopy(mf.load("flux1dev"))
    m["components"]["text_encoder_2"]["config"]["d_ff"] = 10112
    found = mf.problems(m)
    assert any("text_encoder_2: the table differs" in line for line in found), found
    assert any("text_encoder_2/model-00001-of-00002.safetensors" in line and "where the published file has 4994582224"
               in line for line in found), found


def test_tables_fold_block_indices_and_unfold_to_the_same_names():
    table = {"a.0.w": [2, 2], "a.1.w": [2, 2], "a.2.w": [2, 2], "a.4.w": [2, 2], "a.3.b": [1], "c.w": [3],
             "d.0.e.1.w": [1]}
    folded = mf.compact(table)
    assert folded == {"a.{0-2,4}.w": [2, 2], "a.{3}.b": [1], "c.w": [3], "d.0.e.1.w": [1]}
    assert mf.expand(folded) == table


def test_tokenizers_span_the_real_vocabularies(tmp_path):
    from transformers import AutoTokenizer

    from hpcnft.models.made.tokenizers import write_clip_tokenizer, write_t5_tokenizer
    from hpcnft.models.made.writer import corpus

    clip = write_clip_tokenizer(str(tmp_path / "clip"), corpus(), pad_token="!")
    t5 = write_t5_tokenizer(str(tmp_path / "t5"), corpus())
    clip, t5 = AutoTokenizer.from_pretrained(str(tmp_path / "clip")), AutoTokenizer.from_pretrained(str(tmp_path / "t5"))
    assert (len(clip), clip.bos_token_id, clip.eos_token_id, clip.pad_token_id) == (49408, 49406, 49407, 0)
    ids = clip("zebra quokka xylophone")["input_ids"]  # words the corpus never saw: filler merges
    assert ids[0] == 49406 and ids[-1] == 49407 and max(ids[1:-1]) > 40000
    assert (len(t5), t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (32100, 0, 1, 2)
    assert t5.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"]) == [32099, 32000]
    assert max(t5("zebra quokka xylophone")["input_ids"]) > 20000


def _dtype(path, name: str) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_slice(name).get_dtype()


def _digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def test_parts_at_the_real_shapes_are_the_manifest_bit_for_bit_per_seed_and_load(tmp_path):
    """SD3.5's VAE and CLIP-L, made at their real shapes: the headers are the manifest's table in
    its dtype, one seed makes the same bytes twice, and diffusers and transformers load them."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModelWithProjection

    from hpcnft.models.folder_check import read_header
    from hpcnft.models.made.writer import write_weights

    m = mf.load("sd35m")
    for part in ("vae", "text_encoder"):
        comp = m["components"][part]
        write_weights(comp, str(tmp_path / "a" / part), seed=7, device="cpu")
        file = os.path.join(part, mf.weights_name(comp))
        assert read_header(part, str(tmp_path / "a"), file) == mf.expand(comp["tensors"])
        assert {_dtype(tmp_path / "a" / file, name) for name in mf.expand(comp["tensors"])} == {comp["dtype"]}
        assert abs(os.path.getsize(tmp_path / "a" / file) - m["files"][file]) < mf.HEADER_MAX  # the published size
    write_weights(m["components"]["vae"], str(tmp_path / "b" / "vae"), seed=7, device="cpu")
    assert _digest(str(tmp_path / "a" / "vae")) == _digest(str(tmp_path / "b" / "vae"))
    vae = AutoencoderKL.from_pretrained(str(tmp_path / "a" / "vae"))
    assert vae.config.latent_channels == 16 and vae.dtype.is_floating_point
    clip = CLIPTextModelWithProjection.from_pretrained(str(tmp_path / "a" / "text_encoder"))
    assert clip.config.projection_dim == 768


def test_make_weights_refuses_a_folder_in_use_in_one_line(tmp_path, capsys):
    from hpcnft.cli.main import main

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine\n")
    assert main(["make-weights", "pickscore", str(tmp_path / "busy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpcnft make-weights: error: {tmp_path / 'busy'} exists and is not an empty folder"]
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]


@pytest.mark.slow
def test_a_made_pickscore_loads_through_the_real_loader_and_scores(tmp_path, capsys):
    """PickScore_v1's folder whole (0.99 B parameters in fp32, 3.7 GiB): made by the command, it
    passes the run's folder check and loads through models.loading as the downloaded one does."""
    import torch

    from hpcnft.cli.main import main
    from hpcnft.models.folder_check import check_tensors
    from hpcnft.models.loading import load_pickscore

    out = str(tmp_path / "PickScore_v1")
    assert main(["make-weights", "pickscore", out, "--seed", "3"]) == 0
    said = capsys.readouterr().out
    assert f"hpcnft make-weights: {out}: 3.68 GiB in" in said
    assert sorted(mf.load("pickscore")["files"]) == sorted(os.listdir(out))
    check_tensors("models.pickscore_dir", out)
    processor, model = load_pickscore(out, out, torch.device("cpu"))
    assert len(processor.tokenizer) == 49408 and model.config.vision_config.hidden_size == 1280
