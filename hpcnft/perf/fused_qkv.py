"""Fused attention projections for SD3's joint attentions.

perf.fuse_qkv: in the no-grad passes (rollout, v_old) every SD3 attention computes its query,
key and value with one GEMM over the concatenated weights ([3d, d]) instead of three [d, d]
GEMMs, and the text stream's three added projections likewise.

perf.fused_lora: in the trained forward, q/k/v of a stream come from one frozen base GEMM on
the concatenated base weights plus one GEMM on the concatenated LoRA A matrices ([3r, d]: the
activation is read once for the three adapters), then the three rank-r B products. Gradients
reach the LoRA A and B parameters as through peft's layers; the base stays frozen. Where the
adapters are off (the KL reference, merged no-grad passes) the attention runs diffusers' own
processor.

The fused weights are non-persistent buffers on each `Attention` (never in a state dict or a
checkpoint), refreshed from the live projection weights each time the context is entered, so
they always hold what the three projections hold at that moment (merged LoRA, the EMA shadow,
a full fine-tune's latest weights). The processor is diffusers' `JointAttnProcessor2_0` with
the projections fused; the q/k RMS norms are kept (diffusers' own `FusedJointAttnProcessor2_0`
drops them, which SD3.5 needs).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hpcnft.common.tensors import full_tensor, module_list

WEIGHT, BIAS = "hpcnft_qkv_weight", "hpcnft_qkv_bias"
ADDED_WEIGHT, ADDED_BIAS = "hpcnft_added_qkv_weight", "hpcnft_added_qkv_bias"
BASE = "hpcnft_base_"  # prefix of the fused_lora copies of the frozen base weights


def _base(linear):
    """The nn.Linear under a peft LoRA wrapper (or the layer itself)."""
    return linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear


def _concat(linears, attr: str):
    parts = [getattr(_base(lin), attr) for lin in linears]
    if any(p is None for p in parts):
        return None
    return torch.cat([full_tensor(p.detach()) for p in parts])


def _store(attn, name: str, value) -> None:
    """Copy into the existing buffer when it fits (no reallocation between entries)."""
    current = getattr(attn, name, None)
    if value is None:
        attn.register_buffer(name, None, persistent=False)
    elif current is not None and current.shape == value.shape and current.dtype == value.dtype:
        current.copy_(value)
    else:
        attn.register_buffer(name, value.clone(), persistent=False)


def _joint_attentions(transformer):
    """SD3's attentions: diffusers' JointAttnProcessor2_0, or ours for the trained forward."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    kinds = (JointAttnProcessor2_0, FusedLoRAProcessor)
    return [m for m in _attentions(transformer) if isinstance(getattr(m, "processor", None), kinds)]


def _attentions(transformer):
    """Every attention module (one with to_q) of the model, found once (fast.module_list)."""
    return module_list(transformer, "attentions", lambda t: [m for m in t.modules() if hasattr(m, "to_q")])


def _split_heads(t: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    return t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2)


def joint_attention(attn, hidden_states, encoder_hidden_states, project):
    """JointAttnProcessor2_0's computation (diffusers) with the projections supplied:
    `project(x, context)` gives the ([B, S, d],) * 3 q, k, v of the image stream (context False)
    or of the text stream (context True). q/k RMS norms, joint SDPA and the output projections as there."""
    batch, heads = hidden_states.shape[0], attn.heads
    q, k, v = (_split_heads(t, batch, heads) for t in project(hidden_states, False))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if encoder_hidden_states is not None:
        cq, ck, cv = (_split_heads(t, batch, heads) for t in project(encoder_hidden_states, True))
        if attn.norm_added_q is not None:
            cq = attn.norm_added_q(cq)
        if attn.norm_added_k is not None:
            ck = attn.norm_added_k(ck)
        q, k, v = torch.cat([q, cq], dim=2), torch.cat([k, ck], dim=2), torch.cat([v, cv], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1]).to(q.dtype)
    if encoder_hidden_states is None:
        return attn.to_out[1](attn.to_out[0](out))
    n_image = hidden_states.shape[1]
    out, context = out[:, :n_image], out[:, n_image:]
    if not attn.context_pre_only:
        context = attn.to_add_out(context)
    return attn.to_out[1](attn.to_out[0](out)), context


class FusedQKVProcessor:
    """One processor for every fused attention (dynamo sees one object)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        def project(x, context: bool):
            w, b = (ADDED_WEIGHT, ADDED_BIAS) if context else (WEIGHT, BIAS)
            return F.linear(x, getattr(attn, w), getattr(attn, b)).chunk(3, dim=-1)
        return joint_attention(attn, hidden_states, encoder_hidden_states, project)


_PROCESSOR = FusedQKVProcessor()


def _streams(attn) -> dict:
    """{weight buffer name: (bias buffer name, the three projections or None)}: the image stream,
    and the text stream's added projections where the attention has them (not attn2)."""
    added = getattr(attn, "add_q_proj", None) is not None
    return {WEIGHT: (BIAS, (attn.to_q, attn.to_k, attn.to_v)),
            ADDED_WEIGHT: (ADDED_BIAS, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if added else None)}


@torch.no_grad()
def refresh(transformer, attns=None, prefix: str = "") -> list:
    """Concatenate the current projection weights into each joint attention's buffers (in place
    where they exist); returns the attentions it fused."""
    attns = _joint_attentions(transformer) if attns is None else attns
    for attn in attns:
        for weight, (bias, linears) in _streams(attn).items():
            _store(attn, prefix + weight, _concat(linears, "weight") if linears else None)
            _store(attn, prefix + bias, _concat(linears, "bias") if linears else None)
    return attns


@contextlib.contextmanager
def fused(transformer):
    """While inside, each joint attention runs FusedQKVProcessor on weights copied in at entry.
    For no-grad use: the buffers are copies, so no gradient reaches the projections."""
    attns = refresh(transformer)
    saved = [attn.processor for attn in attns]
    try:
        for attn in attns:
            attn.processor = _PROCESSOR
        yield
    finally:
        for attn, proc in zip(attns, saved):
            attn.processor = proc


# -- the trained forward: fused base GEMM + fused LoRA A --------------------------------------------
def _lora_parts(linears):
    """(A weights, B weights, scaling) of three peft LoRA linears with one active plain adapter,
    or None where a projection has no adapter (the base alone then)."""
    from peft.tuners.lora import LoraLayer

    if not all(isinstance(lin, LoraLayer) for lin in linears):
        return None
    names = [lin.active_adapters for lin in linears]
    if any(n != ["default"] for n in names) or any(lin.lora_variant for lin in linears):
        raise NotImplementedError("perf.fused_lora: one plain LoRA adapter per projection is supported")
    if any(not isinstance(lin.lora_dropout["default"], torch.nn.Identity) for lin in linears):
        raise NotImplementedError("perf.fused_lora: LoRA dropout is not supported")
    scales = {lin.scaling["default"] for lin in linears}
    if len(scales) != 1:
        raise NotImplementedError("perf.fused_lora: the three projections need one LoRA scaling")
    return ([lin.lora_A["default"].weight for lin in linears], [lin.lora_B["default"].weight for lin in linears],
            scales.pop())


def _lora_qkv(x, weight, bias, linears):
    """q, k, v of one stream: base GEMM on [3d, d] + (x A_cat^T) split three ways through B."""
    y = F.linear(x, weight, bias).chunk(3, dim=-1)
    parts = _lora_parts(linears)
    if parts is None:
        return y
    a, b, scaling = parts
    h = F.linear(x, torch.cat(a)).chunk(3, dim=-1)
    return tuple(base + F.linear(hi, bi) * scaling for base, hi, bi in zip(y, h, b))


def _adapters_on(attn) -> bool:
    return not getattr(attn.to_q, "disable_adapters", True)


class FusedLoRAProcessor:
    """JointAttnProcessor2_0 for the trained forward with fused q/k/v (see the module docstring)."""

    def __init__(self):
        from diffusers.models.attention_processor import JointAttnProcessor2_0

        self.fallback = JointAttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if not _adapters_on(attn):  # the frozen base or merged weights: the three projections as they are
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

        def project(x, context: bool):
            if context:
                return _lora_qkv(x, getattr(attn, BASE + ADDED_WEIGHT), getattr(attn, BASE + ADDED_BIAS),
                                 (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            return _lora_qkv(x, getattr(attn, BASE + WEIGHT), getattr(attn, BASE + BIAS),
                             (attn.to_q, attn.to_k, attn.to_v))
        return joint_attention(attn, hidden_states, encoder_hidden_states, project)


def install_fused_lora(transformer) -> int:
    """Copy the frozen base q/k/v weights (as they are now: call before any merge) into buffers
    and give every joint attention the FusedLoRAProcessor; returns how many it took."""
    attns = _joint_attentions(transformer)
    refresh(transformer, attns, prefix=BASE)
    processor = FusedLoRAProcessor()
    for attn in attns:
        attn.processor = processor
    return len(attns)
