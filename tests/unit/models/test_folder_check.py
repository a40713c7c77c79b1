"""A model folder's own files checked before anything loads (hpcnft.models.folder_check): a
missing shard, a tensor at another shape than its config makes, or a tokenizer of another model
is one ModelError line naming the config key and the file. On copies of the tiny SD3 folder,
one part re-saved in shards as the real repositories shard their T5."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from hpcnft.models.folder_check import check_files, check_tensors
from hpcnft.models.folders import ModelError

KEY = "models.sd3_dir"


@pytest.fixture
def folder(tiny_models, tmp_path):
    """A copy of the tiny SD3 folder whose text_encoder_3 is saved in three shards with an index."""
    from transformers import T5EncoderModel

    path = str(tmp_path / "sd3")
    shutil.copytree(tiny_models[0], path)
    t5 = os.path.join(path, "text_encoder_3")
    model = T5EncoderModel.from_pretrained(t5)
    for name in os.listdir(t5):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(t5, name))
    model.save_pretrained(t5, max_shard_size="150KB")
    assert len(shards(path)) >= 3
    return path


def shards(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(folder, "text_encoder_3")) if n.endswith(".safetensors"))


def test_the_tiny_and_a_sharded_folder_pass(folder, tiny_models):
    check_tensors(KEY, folder)
    check_tensors("models.pickscore_dir", tiny_models[1])


def test_a_missing_shard_names_the_shard_and_the_index_that_lists_it(folder):
    second = shards(folder)[1]
    os.remove(os.path.join(folder, "text_encoder_3", second))
    with pytest.raises(ModelError) as e:
        check_files(KEY, folder)
    text = str(e.value)
    assert text.startswith(KEY) and f"text_encoder_3/{second} is missing" in text
    assert "text_encoder_3/model.safetensors.index.json names it" in text and "\n" not in text


def test_a_part_without_weights_is_named(folder):
    os.remove(os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ModelError, match=r"models.sd3_dir: vae holds no .safetensors weights"):
        check_files(KEY, folder)


def test_a_tensor_at_another_shape_names_the_file_the_tensor_and_the_config(folder):
    config = os.path.join(folder, "transformer", "config.json")
    with open(config) as f:
        data = json.load(f)
    data["joint_attention_dim"] *= 2  # what the file's context_embedder was not made for
    with open(config, "w") as f:
        json.dump(data, f)
    check_files(KEY, folder)  # the JSON alone cannot see it
    with pytest.raises(ModelError) as e:
        check_tensors(KEY, folder)
    text = str(e.value)
    assert "transformer/diffusion_pytorch_model.safetensors holds context_embedder.weight as" in text
    assert "but transformer/config.json makes it" in text and text.startswith(KEY)


def test_a_tensor_missing_from_every_shard_is_named(folder):
    from safetensors.torch import load_file, save_file

    shard = os.path.join(folder, "text_encoder_3", shards(folder)[-1])
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"{dropped} is in no file of text_encoder_3 .* but "
                                         r"text_encoder_3/config.json's T5EncoderModel has it"):
        check_tensors(KEY, folder)


def test_a_damaged_shard_is_named(folder):
    first = shards(folder)[0]
    with open(os.path.join(folder, "text_encoder_3", first), "r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(ModelError, match=f"text_encoder_3/{first} in .* is not a safetensors"):
        check_tensors(KEY, folder)


def test_a_tokenizer_of_another_kind_is_named(folder):
    shutil.rmtree(os.path.join(folder, "tokenizer"))
    shutil.copytree(os.path.join(folder, "tokenizer_3"), os.path.join(folder, "tokenizer"))
    with pytest.raises(ModelError, match=r"models.sd3_dir: tokenizer holds a T5Tokenizer \(tokenizer/tokenizer_config"
                                         r".json\) where a CLIPTokenizer belongs"):
        check_files(KEY, folder)


def test_a_tokenizer_whose_ids_outrun_the_encoder_is_named(folder, tmp_path):
    """A CLIP tokenizer of the real vocabulary beside the tiny CLIP-G (a vocabulary of hundreds)."""
    from hpcnft.models.made.tokenizers import write_clip_tokenizer

    shutil.rmtree(os.path.join(folder, "tokenizer_2"))
    write_clip_tokenizer(os.path.join(folder, "tokenizer_2"), ["a photo of a cat"], pad_token="!")
    with pytest.raises(ModelError, match=r"tokenizer_2's ids reach 49407 \(tokenizer_2/tokenizer.json\) but "
                                         r"text_encoder_2/config.json's vocab_size is \d+: a tokenizer of another"):
        check_files(KEY, folder)
