"""Whether a model folder, downloaded or made (`hpcnft make-weights`), holds what its own files
promise, checked before anything loads so that a bad folder ends the start in one line naming
the config key and the file, with nothing written to the run dir:

- `check_files` (JSON only, no torch; the starting process): every shard an index names is
  there, every model part has weights, each tokenizer is of the kind model_index.json names and
  its ids fit its text encoder's embedding table;
- `check_tensors` (the ranks, which import torch anyway): every tensor the part's class holds at
  its config.json is in the safetensors headers, at that shape (the classes are built on the meta
  device, the headers read without the weights)."""
from __future__ import annotations

import glob
import json
import os
import struct

from hpcnft.models.folders import ModelError

HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is a damaged file


def _read_json(key: str, root: str, rel: str) -> dict:
    try:
        with open(os.path.join(root, rel)) as f:
            return json.load(f)
    except OSError as e:
        raise ModelError(f"{key}: cannot read {rel} in {root!r} ({e.strerror})") from None
    except ValueError as e:
        raise ModelError(f"{key}: {rel} in {root!r} is not valid JSON ({e})") from None


def _parts(key: str, root: str) -> dict[str, tuple[str, str]]:
    """The folder's parts: {subfolder: (library, class)}; a folder without model_index.json is one
    transformers model (PickScore's CLIPModel) at its root ("")."""
    if not os.path.isfile(os.path.join(root, "model_index.json")):
        config = _read_json(key, root, "config.json")
        return {"": ("transformers", (config.get("architectures") or ["CLIPModel"])[0])}
    index = _read_json(key, root, "model_index.json")
    return {name: (v[0], v[1]) for name, v in index.items()
            if not name.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] and v[1]}


def _is_model(root: str, sub: str) -> bool:
    return os.path.isfile(os.path.join(root, sub, "config.json"))


def weight_files(key: str, root: str, sub: str) -> list[str]:
    """A model part's safetensors files (relative to `root`): those its index names, all there;
    else the ones in its folder."""
    where = os.path.join(root, sub)
    indexes = sorted(glob.glob(os.path.join(where, "*.safetensors.index.json")))
    indexes = [p for p in indexes if ".fp16." not in os.path.basename(p)] or indexes
    if indexes:
        rel_index = os.path.relpath(indexes[0], root)
        weight_map = _read_json(key, root, rel_index).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(where, name)):
                raise ModelError(f"{key}: {os.path.join(sub, name)} is missing ({rel_index} names it) in {root!r}")
        return [os.path.join(sub, name) for name in files]
    files = sorted(p for p in glob.glob(os.path.join(where, "*.safetensors")) if ".fp16." not in os.path.basename(p))
    if not files:
        raise ModelError(f"{key}: {sub or 'the folder'} holds no .safetensors weights in {root!r}")
    return [os.path.relpath(p, root) for p in files]


def _tokenizer_kind(name: str) -> str:
    return "T5" if "T5" in name else "CLIP" if "CLIP" in name else name


def tokenizer_top_id(key: str, root: str, sub: str) -> tuple[int, str]:
    """The largest token id a tokenizer folder can emit, and the file that says so."""
    rel = os.path.join(sub, "tokenizer.json")
    top = -1
    if os.path.isfile(os.path.join(root, rel)):
        data = _read_json(key, root, rel)
        vocab = (data.get("model") or {}).get("vocab") or {}
        top = (len(vocab) - 1) if isinstance(vocab, list) else max(vocab.values(), default=-1)
        top = max([top] + [t.get("id", -1) for t in data.get("added_tokens") or []])
        return top, rel
    rel = os.path.join(sub, "vocab.json")
    if os.path.isfile(os.path.join(root, rel)):
        top = max(_read_json(key, root, rel).values(), default=-1)
        added = os.path.join(sub, "added_tokens.json")
        if os.path.isfile(os.path.join(root, added)):
            top = max([top] + list(_read_json(key, root, added).values()))
        return top, rel
    raise ModelError(f"{key}: {sub or 'the folder'} holds no tokenizer (tokenizer.json or vocab.json) in {root!r}")


def check_tokenizer(key: str, root: str, sub: str, declared: str, encoder_root: str, encoder_config: str) -> None:
    """A tokenizer folder of the kind `declared` whose ids fit the text encoder's vocab_size."""
    config_rel = os.path.join(sub, "tokenizer_config.json")
    if os.path.isfile(os.path.join(root, config_rel)):
        found = _read_json(key, root, config_rel).get("tokenizer_class") or ""
        if found and _tokenizer_kind(found) != _tokenizer_kind(declared):
            raise ModelError(f"{key}: {sub or 'the folder'} holds a {found} ({config_rel}) where a {declared} "
                             f"belongs, in {root!r}")
    top, said_by = tokenizer_top_id(key, root, sub)
    config = _read_json(key, encoder_root, encoder_config)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if vocab and top >= vocab:
        raise ModelError(f"{key}: {sub or 'the tokenizer'}'s ids reach {top} ({said_by}) but {encoder_config}'s "
                         f"vocab_size is {vocab}: a tokenizer of another model, in {root!r}")


def check_files(key: str, root: str) -> None:
    """Every part's weights and tokenizer as its folder's own files promise (JSON only)."""
    parts = _parts(key, root)
    for sub, (_, cls) in parts.items():
        if _is_model(root, sub):
            weight_files(key, root, sub)
        elif cls.endswith(("Tokenizer", "TokenizerFast")):
            encoder = sub.replace("tokenizer", "text_encoder")
            if _is_model(root, encoder):
                check_tokenizer(key, root, sub, cls, root, os.path.join(encoder, "config.json"))


def check_processor(key: str, processor_root: str, model_root: str) -> None:
    """A CLIP processor folder whose tokenizer fits the CLIP model's text vocabulary."""
    check_tokenizer(key, processor_root, "", "CLIPTokenizer", model_root, "config.json")


def read_header(key: str, root: str, rel: str) -> dict[str, list[int]]:
    """A safetensors file's tensors (name -> shape), read from its header alone."""
    path = os.path.join(root, rel)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= HEADER_LIMIT:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(n))
        return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    except OSError as e:
        raise ModelError(f"{key}: cannot read {rel} in {root!r} ({e.strerror})") from None
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelError(f"{key}: {rel} in {root!r} is not a safetensors file ({e})") from None


def state_tensors(model) -> dict:
    """The model's state dict in its order with tied copies once (the first name of a shared
    parameter), as save_pretrained writes it; works on the meta device."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    owner = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if owner.get(k, k) == k}


def aliases(model) -> dict[str, set[str]]:
    """Every name of each parameter, by its saved (first) name: a folder may hold a tied copy
    under another of its names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: set(group) for group in names.values()}


def _expected(key: str, root: str, sub: str, library: str, cls: str):
    """(saved tensor name -> shape, saved name -> every name of that parameter) of the part's
    class at its config.json, built on the meta device."""
    import importlib

    import torch

    try:
        klass = getattr(importlib.import_module(library), cls)
    except (ImportError, AttributeError):
        raise ModelError(f"{key}: model_index.json names {library}.{cls}, which this install lacks") from None
    where = os.path.join(root, sub)
    try:
        with torch.device("meta"):
            if library == "diffusers":
                model = klass.from_config(klass.load_config(where, local_files_only=True))
            else:
                model = klass(klass.config_class.from_pretrained(where, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - a config the class refuses: one line
        from hpcnft.common.errors import one_line

        raise ModelError(f"{key}: {os.path.join(sub, 'config.json')} in {root!r} does not build a {cls} "
                         f"({one_line(e)})") from None
    tensors, names = state_tensors(model), aliases(model)
    if library == "transformers":
        saved = saved_names(model, list(tensors))
        tensors = {saved[k]: v for k, v in tensors.items()}
        names = {saved.get(k, k): v | {saved.get(n, n) for n in v} for k, v in names.items()}
    return {k: list(v.shape) for k, v in tensors.items()}, names


def saved_names(model, names: list[str]) -> dict[str, str]:
    """Each of the model's tensor names as save_pretrained writes it: transformers 5 reverts the
    renamings it loads a class's checkpoints through (Qwen2.5-VL's model.language_model.* and
    model.visual.* saved as model.* and visual.*)."""
    import torch

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 renames nothing
        return {n: n for n in names}
    tags = {n: torch.empty(0, device="meta") for n in names}  # one object per name, followed through
    back = {id(t): new for new, t in revert_weight_conversion(model, dict(tags)).items()}
    return {n: back.get(id(t), n) for n, t in tags.items()}


def check_tensors(key: str, root: str) -> None:
    """check_files, then every model part's tensors against its class at its config.json."""
    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    check_files(key, root)
    for sub, (library, cls) in _parts(key, root).items():
        if not _is_model(root, sub):
            continue
        files = weight_files(key, root, sub)
        held: dict[str, tuple[list[int], str]] = {}
        for rel in files:
            for name, shape in read_header(key, root, rel).items():
                held[name] = (shape, rel)
        expected, names = _expected(key, root, sub, library, cls)
        config = os.path.join(sub, "config.json")
        for name, shape in expected.items():
            found = next((held[n] for n in sorted(names.get(name, {name})) if n in held), None)
            if found is None:
                raise ModelError(f"{key}: {name} is in no file of {sub or 'the folder'} ({', '.join(files)}) but "
                                 f"{config}'s {cls} has it, in {root!r}")
            if list(found[0]) != shape:
                raise ModelError(f"{key}: {found[1]} holds {name} as {list(found[0])} but {config} makes it "
                                 f"{shape}, in {root!r}")
