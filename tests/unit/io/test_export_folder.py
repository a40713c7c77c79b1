"""`hpcnft export`'s output folder: what an existing OUT may be replaced by --force, and the
export written beside OUT, renamed into place whole or not at all."""
from __future__ import annotations

import os

import pytest

from hpcnft.io.export_folder import refusal, written_beside


def folder(path, *names):
    path.mkdir()
    for name in names:
        (path / name).write_text(name)
    return str(path)


def test_a_new_folder_is_written_and_an_existing_one_only_with_force(tmp_path):
    out = str(tmp_path / "out")
    assert refusal(out, False) is None and refusal(out, True) is None
    folder(tmp_path / "out", "pytorch_lora_weights.safetensors")
    assert refusal(out, False) == f"{out}: already exists; pass --force to replace it"
    assert refusal(out, True) is None


@pytest.mark.parametrize("names", [(), ("config.json", "diffusion_pytorch_model.safetensors"),
                                   ("config.json", "diffusion_pytorch_model-00001-of-00002.safetensors",
                                    "diffusion_pytorch_model-00002-of-00002.safetensors",
                                    "diffusion_pytorch_model.safetensors.index.json")])
def test_force_replaces_an_earlier_export_of_either_kind_or_an_empty_folder(tmp_path, names):
    assert refusal(folder(tmp_path / "out", *names), True) is None


def test_force_never_replaces_anything_else(tmp_path):
    run = folder(tmp_path / "run", "run.h5", "pytorch_lora_weights.safetensors")
    assert refusal(run, True) == (f"{run}: holds 'run.h5', which no export writes; --force replaces only an "
                                  "earlier export (or an empty folder)")
    nested = folder(tmp_path / "nested")
    os.mkdir(os.path.join(nested, "config.json"))  # an export's name, but a folder
    assert "holds 'config.json'" in refusal(nested, True)
    (tmp_path / "file").write_text("x")
    os.symlink(folder(tmp_path / "target"), tmp_path / "link")
    for path in (tmp_path / "file", tmp_path / "link"):
        assert refusal(str(path), True) == (f"{path}: not a folder (a file or a link); --force replaces only an "
                                            "earlier export's folder")


def test_the_export_replaces_out_whole_and_leaves_nothing_beside_it(tmp_path):
    out = folder(tmp_path / "out", "pytorch_lora_weights.safetensors")
    with written_beside(out) as new:
        assert os.path.dirname(new) == str(tmp_path) and os.listdir(new) == []
        (tmp_path / new / "config.json").write_text("new")
    assert os.listdir(out) == ["config.json"] and os.listdir(tmp_path) == ["out"]
    with written_beside(str(tmp_path / "a" / "b")) as new:  # the parents are made
        open(os.path.join(new, "x"), "w").close()
    assert os.listdir(tmp_path / "a" / "b") == ["x"]


def test_a_failed_export_leaves_out_as_it_was(tmp_path):
    out = folder(tmp_path / "out", "pytorch_lora_weights.safetensors")
    with pytest.raises(OSError):
        with written_beside(out) as new:
            open(os.path.join(new, "pytorch_lora_weights.safetensors"), "w").write("half")
            raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == ["out"]
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").read_text() == "pytorch_lora_weights.safetensors"
    with pytest.raises(KeyboardInterrupt):
        with written_beside(str(tmp_path / "fresh")):
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("umask, file_mode, folder_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                           (0o002, 0o664, 0o775)])
def test_the_export_takes_its_modes_from_the_umask_whatever_safetensors_writes(tmp_path, umask, file_mode,
                                                                                folder_mode):
    import torch
    from safetensors.torch import save_file

    out = str(tmp_path / "lora")
    old = os.umask(umask)
    try:
        with written_beside(out) as new:
            save_file({"w": torch.ones(2)}, os.path.join(new, "pytorch_lora_weights.safetensors"))  # as diffusers
            with open(os.path.join(new, "config.json"), "w") as f:  # as save_pretrained writes its config
                f.write("{}")
    finally:
        os.umask(old)
    assert {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)} == {
        "pytorch_lora_weights.safetensors": file_mode, "config.json": file_mode}
    assert os.stat(out).st_mode & 0o777 == folder_mode
