"""hpcnft.models: a model folder's pickles (.bin weights) are never loaded, only safetensors."""
from __future__ import annotations

import os
import shutil

import pytest
import torch




@pytest.fixture(scope="module")
def hostile_models(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-models")
    sd3, ps = (shutil.copytree(p, str(base / os.path.basename(p))) for p in tiny_models)
    return sd3, ps, base


def _plant_bin(folder: str, bin_name: str, marker: str, keep_safetensors: bool) -> None:
    torch.save({"weight": torch.zeros(1), "x": __import__("hardening_tools").Payload(marker)},
               os.path.join(folder, bin_name))
    if not keep_safetensors:
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                os.rename(os.path.join(folder, name), os.path.join(folder, name + ".away"))


def _restore(folder: str, bin_name: str) -> None:
    os.remove(os.path.join(folder, bin_name))
    for name in os.listdir(folder):
        if name.endswith(".away"):
            os.rename(os.path.join(folder, name), os.path.join(folder, name[:-len(".away")]))


@pytest.mark.parametrize("keep_safetensors", [False, True], ids=["bin-only", "bin-and-safetensors"])
@pytest.mark.parametrize("part,bin_name", [("transformer", "diffusion_pytorch_model.bin"),
                                           ("text_encoder", "pytorch_model.bin"),
                                           ("pickscore", "pytorch_model.bin")])
def test_model_folder_pickles_are_never_loaded(hostile_models, part, bin_name, keep_safetensors):
    from hpcnft.models.loading import ModelError, load_pickscore, load_sd3_pipeline

    sd3, ps, base = hostile_models
    marker = str(base / f"MARKER-{part}-{keep_safetensors}")
    folder = ps if part == "pickscore" else os.path.join(sd3, part)
    _plant_bin(folder, bin_name, marker, keep_safetensors)
    try:
        load = (lambda: load_pickscore(ps, ps, torch.device("cpu"))) if part == "pickscore" else \
            (lambda: load_sd3_pipeline(sd3, torch.float32, torch.device("cpu")))
        if keep_safetensors:
            load()  # the safetensors weights load; the .bin beside them is ignored
        else:
            with pytest.raises(ModelError) as e:
                load()
            key = "models.pickscore_dir" if part == "pickscore" else "models.sd3_dir"
            assert str(e.value).startswith(f"{key}: cannot load") and len(str(e.value).splitlines()) == 1
            assert "safetensors" in str(e.value)
    finally:
        _restore(folder, bin_name)
    assert not os.path.exists(marker)
