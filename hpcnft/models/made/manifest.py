"""The real model repositories as data (hpcnft/models/made/manifests/NAME.json): the files a
loader reads with their published sizes, the files hpcnft never reads, and each component's
library class, config, storage dtype, shard size and tensor table (name pattern -> shape).

The tensor tables are the classes' state dicts at the configs, tied copies once (as
save_pretrained writes them); a shard plan of those tensors, split as huggingface_hub splits a
state dict, must give the published file names, and each shard's bytes the published size less
its header. `python3 -m hpcnft.models.made.manifest` checks both for every manifest (and
`--write-tables` rewrites the tables from the installed libraries)."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

MANIFESTS = ("sd35m", "sd35l", "flux1dev", "pickscore")
HERE = os.path.join(os.path.dirname(__file__), "manifests")
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8}
HEADER_MAX = 1 << 20  # a shard's safetensors header (its JSON table) is well under 1 MiB


def load(name: str) -> dict:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return json.load(f)


def weight_components(manifest: dict) -> dict[str, dict]:
    """The components that hold weights (a class with a dtype), by name."""
    return {k: c for k, c in manifest["components"].items() if "dtype" in c}


def folder_of(name: str, component: dict) -> str:
    return component.get("folder", name)


def weights_name(component: dict) -> str:
    """The weights' file name as the component's library saves it (unsharded)."""
    return "diffusion_pytorch_model.safetensors" if component["library"] == "diffusers" else "model.safetensors"


# -- the classes ------------------------------------------------------------------------------
def model_class(component: dict):
    import importlib

    return getattr(importlib.import_module(component["library"]), component["class"])


def config_of(component: dict, config: dict):
    """The component's library config object for a config.json's contents."""
    cls = model_class(component)
    if component["library"] == "diffusers":
        return dict(config)
    keys = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    return cls.config_class(**keys)


def build(component: dict, config: dict | None = None):
    """The component's model at `config` (default: the manifest's) on the current device and dtype."""
    cls = model_class(component)
    cfg = config_of(component, component["config"] if config is None else config)
    return cls.from_config(cfg) if component["library"] == "diffusers" else cls(cfg)


def meta_tensors(component: dict, config: dict | None = None) -> dict[str, list[int]]:
    """name -> shape of what the component's folder must hold (built on the meta device: free)."""
    import torch

    from hpcnft.models.folder_check import state_tensors

    with torch.device("meta"):
        model = build(component, config)
    return {k: list(v.shape) for k, v in state_tensors(model).items()}


# -- compact tables -----------------------------------------------------------------------------
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def compact(table: dict[str, list[int]]) -> dict[str, list[int]]:
    """Fold names that differ in one block index into "blocks.{0-23}.attn.weight" (same shape)."""
    groups: dict[tuple, list[tuple[str, list[int]]]] = {}
    for name, shape in table.items():
        parts = _INDEX.split(name)
        idx = _INDEX.findall(name)
        if len(idx) == 1:
            groups.setdefault((parts[0], parts[1], tuple(shape)), []).append((idx[0], shape))
        else:
            groups.setdefault((name, None, tuple(shape)), []).append(("", shape))
    out: dict[str, list[int]] = {}
    for (head, tail, shape), members in groups.items():
        if tail is None:
            out[head] = list(shape)
            continue
        out[f"{head}{{{_ranges(sorted(int(i) for i, _ in members))}}}{tail}"] = list(shape)
    return out


def _ranges(values: list[int]) -> str:
    spans, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(spans)


def expand(table: dict[str, list[int]]) -> dict[str, list[int]]:
    """compact's inverse."""
    out: dict[str, list[int]] = {}
    for pattern, shape in table.items():
        m = re.search(r"\{([\d,\-]+)\}", pattern)
        if not m:
            out[pattern] = shape
            continue
        for span in m.group(1).split(","):
            lo, _, hi = span.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                out[pattern[:m.start()] + str(i) + pattern[m.end():]] = shape
    return out


# -- shards -----------------------------------------------------------------------------------
@dataclass
class Shard:
    file: str  # relative to the component's folder
    names: list[str]
    data_bytes: int


def shard_plan(component: dict, table: dict[str, list[int]]) -> list[Shard]:
    """How save_pretrained splits the component's tensors (huggingface_hub's split of a state
    dict, in state-dict order, at the component's max_shard_size)."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[component["dtype"]]
    fake = {k: torch.empty(shape, dtype=dtype, device="meta") for k, shape in table.items()}
    stem = weights_name(component).removesuffix(".safetensors")
    split = split_torch_state_dict_into_shards(fake, filename_pattern=stem + "{suffix}.safetensors",
                                               max_shard_size=component["max_shard_size"])
    width = DTYPE_BYTES[component["dtype"]]
    return [Shard(f, list(names), sum(math.prod(table[n]) for n in names) * width)
            for f, names in split.filename_to_tensors.items()]


def index_name(component: dict) -> str:
    return weights_name(component) + ".index.json"


def parameters(table: dict[str, list[int]]) -> int:
    return sum(math.prod(s) for s in table.values())


# -- the check ----------------------------------------------------------------------------------
def problems(m: dict) -> list[str]:
    """What in manifest `m` disagrees with the installed classes or the published sizes."""
    name = m["name"]
    found = []
    for comp_name, comp in weight_components(m).items():
        table = meta_tensors(comp)
        if compact(table) != comp["tensors"]:
            found.append(f"{name}/{comp_name}: the table differs from {comp['class']} at its config")
        folder = folder_of(comp_name, comp)
        shards = shard_plan(comp, table)
        files = {os.path.join(folder, s.file) for s in shards}
        if len(shards) > 1:
            files.add(os.path.join(folder, index_name(comp)))
        listed = {f for f in m["files"] if os.path.dirname(f) == folder and ".safetensors" in f}
        if files != listed:
            found.append(f"{name}/{comp_name}: shards {sorted(files)} where the repository has {sorted(listed)}")
        for s in shards:
            published = m["files"].get(os.path.join(folder, s.file))
            if published is not None and not 0 < published - s.data_bytes < HEADER_MAX:
                found.append(f"{name}/{folder}/{s.file}: {s.data_bytes} bytes of tensors where the published "
                             f"file has {published}")
    return found


def write_tables() -> None:
    for name in MANIFESTS:
        m = load(name)
        for comp in weight_components(m).values():
            comp["tensors"] = compact(meta_tensors(comp))
        with open(os.path.join(HERE, f"{name}.json"), "w") as f:
            f.write(dumps(m))


def dumps(manifest: dict) -> str:
    """JSON with every list of numbers or strings on one line (a table row a line)."""
    text = json.dumps(manifest, indent=1)
    return re.sub(r"\[\s*([^\[\]{}]*?)\s*\]", lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m hpcnft.models.made.manifest", description=__doc__.splitlines()[0])
    p.add_argument("--write-tables", action="store_true", help="rewrite the tensor tables from the installed classes")
    args = p.parse_args(argv)
    if args.write_tables:
        write_tables()
    found = [line for name in MANIFESTS for line in problems(load(name))]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
