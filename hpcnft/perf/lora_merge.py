"""perf.merge_lora_nograd: the LoRA deltas merged into the base weights for the no-grad passes,
and restored bit for bit afterwards."""
from __future__ import annotations

import contextlib

import torch

from hpcnft.common.tensors import full_tensor, local_shard, module_list


def lora_layers(module):
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def _local_rows(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The rows of a full [out, in] delta that this rank holds of `weight` (FSDP2: Shard(0))."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return delta
    (placement,) = weight.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise NotImplementedError(f"perf.merge_lora_nograd: unsupported placement {placement}")
    mesh = weight.device_mesh
    return torch.chunk(delta, mesh.size(), dim=0)[mesh.get_local_rank()]


def set_adapters(layers, enabled: bool) -> None:
    """peft LoRA layers on or off by the flag their forward reads. diffusers' enable/disable_adapters
    walk every module and re-set requires_grad on each adapter (~1,100 calls for the real DiT);
    the merged passes run without gradients, so the trainable set is simply left as it is."""
    for layer in layers:
        layer._disable_adapters = not enabled


@contextlib.contextmanager
def merged(transformer):
    """While inside: the base weights of every LoRA linear hold W + scaling * B @ A (computed in
    fp32, rounded once to the base dtype) and the adapters are off, so a forward is the plain
    base model (no rank-r side matmuls). On exit the saved base weights are copied back (bit
    exact) and the adapters are on again. For no-grad use (rollout, v_old)."""
    tr = transformer
    layers = module_list(tr, "lora_layers", lora_layers)
    saved = []  # (base weights, their saved copies)
    try:
        with torch.no_grad():
            adapters = [_plain_adapter(layer) for layer in layers]
            for group in _merge_groups([(layer, n) for layer, n in zip(layers, adapters) if n is not None]):
                saved.append(_merge_stacked(group))
            for layer, name in zip(layers, adapters):
                if name is None:
                    saved.append(_merge_one(layer))
        set_adapters(layers, False)
        yield
    finally:
        if saved:
            set_adapters(layers, True)
        with torch.no_grad():
            for weights, originals in saved:
                torch._foreach_copy_(weights, originals)


def _plain_adapter(layer) -> str | None:
    """The adapter of a layer merged in stacked groups (one active adapter, weights not sharded,
    [out, in] layout), or None for a layer merged on its own."""
    from torch.distributed.tensor import DTensor

    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(names) != 1 or layer.fan_in_fan_out:
        return None
    tensors = (layer.get_base_layer().weight, layer.lora_A[names[0]].weight, layer.lora_B[names[0]].weight)
    return None if any(isinstance(t, DTensor) for t in tensors) else names[0]


def _merge_groups(named, most: int = 64) -> list[list]:
    """(layer, adapter) pairs whose base and adapter weights have one shape, dtype and device, at
    most `most` a group (the stacked copies stay a few GiB)."""
    groups: dict = {}
    for layer, name in named:
        w, a = layer.get_base_layer().weight, layer.lora_A[name].weight
        groups.setdefault((w.shape, w.dtype, w.device, a.shape, a.dtype), []).append((layer, name))
    return [g[i:i + most] for g in groups.values() for i in range(0, len(g), most)]


def _merge_stacked(group) -> tuple[list, list]:
    """W + scaling * B @ A for a group of (plain LoRA layer, adapter) pairs as one batched product
    (computed in fp32, rounded once to the base dtype) and one foreach copy: per layer, the real
    DiT's ~200 LoRA linears made ~2,000 small kernels whose launches the GPU waited on."""
    weights = [layer.get_base_layer().weight for layer, _ in group]
    a = torch.stack([layer.lora_A[n].weight for layer, n in group]).float()
    b = torch.stack([layer.lora_B[n].weight for layer, n in group]).float()
    scales = [layer.scaling[n] for layer, n in group]
    # one scale (the usual case) as a number: a tensor of scales would be a host-to-device copy
    scaling = scales[0] if len(set(scales)) == 1 else torch.tensor(scales, device=a.device).view(-1, 1, 1)
    original = torch.stack(weights)
    merged = (original.float() + torch.bmm(b, a) * scaling).to(original.dtype)
    torch._foreach_copy_(weights, list(merged.unbind(0)))
    return weights, list(original.unbind(0))


def _merge_one(layer) -> tuple[list, list]:
    """The same for one layer of any kind peft has (several adapters, fan_in_fan_out, FSDP2 shards)."""
    weight = layer.get_base_layer().weight
    local = local_shard(weight)
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=local.device)
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b = full_tensor(layer.lora_A[name].weight), full_tensor(layer.lora_B[name].weight)
        d = b.float() @ a.float()
        delta += (d.T if layer.fan_in_fan_out else d) * layer.scaling[name]
    original = local.clone()
    local.copy_((local.float() + _local_rows(delta, weight)).to(local.dtype))
    return [local], [original]
