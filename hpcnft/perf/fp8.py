"""perf.rollout_fp8 and perf.v_old_fp8: the old policy's no-grad DiT forwards with fp8 (e4m3)
GEMMs, in the rollout and in the train step's v_old pass.

While `blocks_in_fp8` is entered, every large linear of the DiT's transformer blocks (the
attention projections, fused q/k/v included, and the feed-forwards) multiplies in fp8 through
`torch._scaled_mm`: weights quantized once at entry with one scale per output channel,
activations quantized per row (per token) at each call, products summed by the tensor cores'
fast fp8 accumulation, rescaled and rounded to bf16 (what row-wise scaled GEMMs produce), then
cast to the compute dtype. The modulation linears (one row per sample), the embedders and the
final projection stay in half precision. Under FSDP2 each rank quantizes the gathered weights at
entry. No-grad forwards only: the trained forward, its backward and evaluation keep their
precision, so the gradients and the eval rewards are those of the half-precision model.

Each feed-forward (linear, tanh GELU, linear) runs as fp8 GEMM, `gelu_quantize_rows` (bias,
GELU and the per-row quantization of the hidden activation in one op; on CUDA one Triton pass
per row, `perf.fp8_kernels`), fp8 GEMM: the [tokens, 4d] hidden activation goes from the first
GEMM's bf16 output straight to the second GEMM's e4m3 input.

Rounding: e4m3 keeps 3 mantissa bits, so each input carries up to 2^-4 relative error; summed
over K products the errors largely average out, and the bf16 output adds 2^-9. `hpcnft bench`
reports what each costs at the real shapes: the rollout's in velocity, latents and PickScore
(`rollout_fp8_cost`), v_old's in v_old, the NFT loss and the gradient (`v_old_fp8_cost`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hpcnft.common.tensors import full_tensor, linear_dtype, mixed_in, module_list
from hpcnft.perf import fused_qkv

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Per-sample linears (AdaLayerNorm modulation) have one row per sample: nothing to gain in fp8.
# peft's own A/B linears stay as they are (rank r: small GEMMs; with merge_lora_nograd, unused).
KEEP = ("norm1.", "norm1_context.", "norm2.", "norm2_context.", "lora_")
WEIGHT, SCALE = "hpcnft_fp8_weight", "hpcnft_fp8_scale"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] fp32) with x ~ q * scale; each row's largest
    magnitude maps to the largest e4m3 value."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@torch.library.custom_op("hpcnft::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows(h: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(gelu(h + bias, approximate="tanh")) for h [M, N], in fp32 (the reference;
    CUDA has its one-pass kernel)."""
    g = h.float() if bias is None else h.float() + bias.float()
    return quantize_rows(F.gelu(g, approximate="tanh"))


@gelu_quantize_rows.register_kernel("cuda")
def _gelu_quantize_rows_cuda(h, bias):
    from hpcnft.perf import fp8_kernels

    return fp8_kernels.gelu_quantize_rows(h, bias)


@gelu_quantize_rows.register_fake
def _gelu_quantize_rows_fake(h, bias):
    return torch.empty_like(h, dtype=E4M3), h.new_empty((h.shape[0], 1), dtype=torch.float32)


def _scaled_rows(xq, xs, weight_q, weight_scale) -> torch.Tensor:
    # Row-wise scaled fp8 GEMMs produce bf16; compiled, a cast fuses into the consumer.
    return torch._scaled_mm(xq, weight_q.t(), scale_a=xs, scale_b=weight_scale.t(),
                            out_dtype=torch.bfloat16, use_fast_accum=True)


def _linear_out(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The [rows, N] GEMM result y as F.linear(x, ...) would give it: bias added, x's leading
    shape, in linear_dtype(x)."""
    out_dtype = linear_dtype(x)
    y = y.to(out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, b) with W = weight_q * weight_scale ([N, K] e4m3, [N, 1]) and x quantized
    per row. The result has the dtype F.linear would give: the autocast dtype, else x's."""
    return _linear_out(_scaled_rows(*quantize_rows(x.reshape(-1, x.shape[-1])), weight_q, weight_scale), bias, x)


def feed_forward(x: torch.Tensor, first: torch.nn.Module, second: torch.nn.Module) -> torch.Tensor:
    """second(gelu(first(x))) for two Fp8Linear modules: the hidden activation quantized per row
    from the first GEMM's output by one op (bias and GELU included)."""
    hidden = _scaled_rows(*quantize_rows(x.reshape(-1, x.shape[-1])), getattr(first, WEIGHT), getattr(first, SCALE))
    hq, hs = gelu_quantize_rows(hidden, first.bias)
    return _linear_out(_scaled_rows(hq, hs, getattr(second, WEIGHT), getattr(second, SCALE)), second.bias, x)


def supported(weight: torch.Tensor) -> bool:
    """_scaled_mm needs both GEMM dimensions divisible by 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


class Fp8Linear(torch.nn.Linear):
    """An nn.Linear whose forward runs on its fp8 buffers (the class is swapped in and out by
    `blocks_in_fp8`; the module keeps its own weight and bias untouched)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_linear(x, getattr(self, WEIGHT), getattr(self, SCALE), self.bias)


@torch.no_grad()
def quantize_into(entries) -> None:
    """(module, weight, buffer prefix) -> the fp8 weight and its row scales in the module's buffers
    (in place once they exist). Weights of one shape are quantized as one stacked tensor and
    written with one foreach copy: one at a time, the ~1,700 small kernels of the real DiT's
    entry left the GPU waiting on their launches. Row-wise, so the same values either way."""
    groups: dict = {}
    for module, weight, prefix in entries:
        groups.setdefault((weight.shape, weight.dtype, weight.device), []).append((module, weight, prefix))
    for group in groups.values():
        q, scale = quantize_rows(torch.stack([w for _, w, _ in group]))
        for name, values in ((WEIGHT, q.unbind(0)), (SCALE, scale.unbind(0))):
            _store_all([(m, prefix + name) for m, _, prefix in group], values)


def _store_all(targets, values) -> None:
    current = [getattr(m, name, None) for m, name in targets]
    if all(c is not None and c.shape == v.shape and c.dtype == v.dtype for c, v in zip(current, values)):
        torch._foreach_copy_(current, list(values))
    else:
        for (m, name), v in zip(targets, values):
            fused_qkv._store(m, name, v)


def block_linears(transformer, skip=()) -> list[torch.nn.Linear]:
    """The plain nn.Linear layers of the DiT blocks that go fp8 (peft's base layers under LoRA),
    but those in `skip`."""
    skip = {id(m) for m in skip}
    return [m for name, m in transformer.transformer_blocks.named_modules()
            if type(m) is torch.nn.Linear and id(m) not in skip and not any(k in name for k in KEEP)
            and supported(m.weight)]


class Fp8FusedQKVProcessor:
    """fused_qkv's processor with the fused q/k/v GEMMs in fp8 (one object for dynamo)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        def project(x, context: bool):
            prefix = "added_" if context else ""
            bias = getattr(attn, fused_qkv.ADDED_BIAS if context else fused_qkv.BIAS)
            return scaled_linear(x, getattr(attn, prefix + WEIGHT), getattr(attn, prefix + SCALE), bias).chunk(3, dim=-1)
        return fused_qkv.joint_attention(attn, hidden_states, encoder_hidden_states, project)


_FUSED = Fp8FusedQKVProcessor()


class Fp8FeedForwardMixin:
    """Mixed into the class of a diffusers FeedForward (linear, tanh GELU, dropout, linear)
    whose two linears are fp8, while `blocks_in_fp8` is entered."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return feed_forward(hidden_states, self.net[0].proj, self.net[2])


def fusable_feed_forwards(transformer, fp8_linears) -> list:
    """The blocks' FeedForwards that `feed_forward` computes: [GELU(tanh) with a biased linear,
    Dropout that drops nothing, linear], both linears among `fp8_linears`."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    fp8_ids = {id(m) for m in fp8_linears}
    out = []
    for m in transformer.transformer_blocks.modules():
        if type(m) is not FeedForward or len(m.net) != 3:
            continue
        act, drop, second = m.net
        if (isinstance(act, GELU) and act.approximate == "tanh" and act.proj.bias is not None
                and isinstance(drop, torch.nn.Dropout) and (drop.p == 0 or not drop.training)
                and id(act.proj) in fp8_ids and id(second) in fp8_ids):
            out.append(m)
    return out


@contextlib.contextmanager
def blocks_in_fp8(transformer, lever: str = "perf.rollout_fp8"):
    """While inside, the blocks' linears (and fused q/k/v) run in fp8 on weights quantized at
    entry; on exit the classes and processors are put back (the weights are never changed).
    `lever` is the config key a GPU without fp8 GEMMs is told to turn off."""
    fused = [m for m in fused_qkv._attentions(transformer)
             if isinstance(getattr(m, "processor", None), fused_qkv.FusedQKVProcessor)
             and supported(getattr(m, fused_qkv.WEIGHT))]
    projections = [fused_qkv._base(getattr(a, n)) for a in fused for n in ("to_q", "to_k", "to_v", "add_q_proj",
                                                                    "add_k_proj", "add_v_proj")
                   if getattr(a, n, None) is not None]  # unused while fused
    # the same linears at every entry as long as the same attentions are fused (found once per set)
    linears = module_list(transformer, ("fp8_linears", tuple(id(a) for a in fused)),
                          lambda t: block_linears(t, skip=projections))
    device = next(transformer.parameters()).device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"{lever}: fp8 GEMMs need a GPU of compute capability 8.9 or newer "
                           f"(this one: {major}.{minor}); set {lever}=false")
    # Under FSDP2 each rank keeps a whole fp8 copy (gathered here, collectively, at entry); the
    # blocks' all-gathers still run, but their half-precision weights go unused.
    entries = [(m, full_tensor(m.weight.detach()), "") for m in linears]
    for attn in fused:
        entries.append((attn, getattr(attn, fused_qkv.WEIGHT), ""))
        added = getattr(attn, fused_qkv.ADDED_WEIGHT)
        if added is not None:
            entries.append((attn, added, "added_"))
    quantize_into(entries)
    ffs = module_list(transformer, ("fp8_feed_forwards", tuple(id(a) for a in fused)),
                      lambda t: fusable_feed_forwards(t, linears))
    saved = [a.processor for a in fused]
    try:
        for m in linears:
            m.__class__ = Fp8Linear
        for attn in fused:
            attn.processor = _FUSED
        with mixed_in(ffs, Fp8FeedForwardMixin, "Fp8"):
            yield len(linears) + len(fused)
    finally:
        for m in linears:
            m.__class__ = torch.nn.Linear
        for attn, proc in zip(fused, saved):
            attn.processor = proc
