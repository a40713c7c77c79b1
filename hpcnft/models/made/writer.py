"""A real repository's folder with random weights (`hpcnft make-weights NAME DIR`): the layout,
configs, shard split and storage dtypes of its manifest (hpcnft.models.made.manifest), each
component's weights drawn by its own class's initialisation from a seeded generator, and
tokenizers of the real vocabularies' sizes (hpcnft.models.made.tokenizers). The real loaders
read it through the same code as the downloaded weights, so a cluster can be rehearsed (memory,
start-up, throughput, preemption) before tens of gigabytes are fetched.

The folder is written beside its final name and moved there once complete and checked."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field

from hpcnft.common.disk import folder_bytes
from hpcnft.models.made import manifest as mf

STORAGE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class MakeError(Exception):
    """A folder that cannot be made (one line)."""


@dataclass
class Made:
    path: str
    bytes: int = 0
    seconds: float = 0.0
    parts: list[tuple[str, int, int, float]] = field(default_factory=list)  # (component, parameters, bytes, s)


def corpus() -> list[str]:
    from hpcnft.models.tiny import CHAR_COVERAGE, PROMPTS

    return PROMPTS + [CHAR_COVERAGE]


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def write_weights(component: dict, folder: str, seed: int, device: str) -> int:
    """One component's config and safetensors shards (save_pretrained at the manifest's shard
    size), drawn in its storage dtype on `device`; returns its parameter count."""
    import torch

    from hpcnft.models.folder_check import state_tensors

    dtype = getattr(torch, STORAGE[component["dtype"]])
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = mf.build(component)
    model.to(dtype)  # floating buffers too (SD3's position table is built in fp32): the repository stores all in one
    n = sum(p.numel() for p in state_tensors(model).values())
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=component["max_shard_size"])
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return n


def write_tokenizer(component: dict, folder: str) -> None:
    from hpcnft.models.made.tokenizers import write_clip_tokenizer, write_t5_tokenizer

    if component["class"] == "CLIPTokenizer":
        write_clip_tokenizer(folder, corpus(), pad_token=component["pad_token"],
                             model_max_length=component["model_max_length"])
    else:
        write_t5_tokenizer(folder, corpus(), model_max_length=component["model_max_length"])


def write_processor(component: dict, folder: str) -> None:
    """CLIP-H's image preprocessing (PickScore's processor): resize the short side, centre crop,
    OpenAI CLIP's mean and std."""
    from transformers import CLIPImageProcessor

    side = component["size"]
    CLIPImageProcessor(do_resize=True, size={"shortest_edge": side}, resample=component["resample"],
                       do_center_crop=True, crop_size={"height": side, "width": side}, do_rescale=True,
                       rescale_factor=1 / 255, do_normalize=True, image_mean=component["image_mean"],
                       image_std=component["image_std"], do_convert_rgb=True).save_pretrained(folder)


def write_model_index(manifest: dict, root: str) -> None:
    import diffusers

    index = {"_class_name": manifest["pipeline"], "_diffusers_version": diffusers.__version__}
    for name, comp in sorted(manifest["components"].items()):
        index[name] = [comp["library"], comp["class"]]
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def make_folder(name: str, out: str, seed: int = 0, device: str = "cpu", say=print) -> Made:
    """Write manifest `name`'s folder at `out` (which must not exist or be empty)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from hpcnft.models.folders import quiet_libraries

    if name not in mf.MANIFESTS:
        raise MakeError(f"no model named {name!r} (one of {', '.join(mf.MANIFESTS)})")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise MakeError(f"{out} exists and is not an empty folder")
    quiet_libraries()
    m = mf.load(name)
    staging = out.rstrip("/") + ".making"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    made = Made(out)
    t_all = time.perf_counter()
    for i, (comp_name, comp) in enumerate(m["components"].items()):
        folder = os.path.join(staging, mf.folder_of(comp_name, comp))
        t0 = time.perf_counter()
        before = folder_bytes(staging)
        n = 0
        if "dtype" in comp:
            say(f"{comp_name or name}: {comp['class']}, {comp['dtype']}, drawing on {device}")
            n = write_weights(comp, folder, seed * 1000 + i, device)
        elif comp["class"].endswith("Tokenizer") or comp["class"].endswith("TokenizerFast"):
            write_tokenizer(comp, folder)
        elif comp["class"] == "CLIPProcessor":
            write_processor(comp, folder)
        else:
            FlowMatchEulerDiscreteScheduler.from_config(comp["config"]).save_pretrained(folder)
        size = folder_bytes(staging) - before
        made.parts.append((comp_name, n, size, time.perf_counter() - t0))
        if n:
            say(f"{comp_name}: {n / 1e9:.3f} B parameters, {size / 2**30:.2f} GiB in "
                f"{time.perf_counter() - t0:.1f} s")
    if m["pipeline"]:
        write_model_index(m, staging)
    missing = sorted(f for f in m["files"] if not os.path.exists(os.path.join(staging, f)))
    if missing:
        raise MakeError(f"{name}: the made folder lacks {', '.join(missing)}")
    from hpcnft.models.folder_check import check_tensors

    check_tensors(f"made {name}", staging)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if os.path.isdir(out):
        os.rmdir(out)
    os.replace(staging, out)
    made.bytes, made.seconds = folder_bytes(out), time.perf_counter() - t_all
    return made
