"""The `[perf]` section: the speed levers, each documented here once (what it does, then what it
does to the numerics), and `FAST`, the combination `hpcnft bench` measures.

Every lever is off by default; with every lever off the package runs exactly as before (same
code path, same numerics). None changes the NFT math; some change rounding, and deterministic
mode turns the timing-chosen ones off (hpcnft.perf.levers, the one interface through which the
algorithm uses them, says which).

`FAST` is the combination `hpcnft bench` measures as "hpcnft fast"; `hpcnft bench --shapes
sd35m --baseline --levers all` prints what each lever gives alone and together. Measured on one
H200 (docs/bench/README.md): FAST runs an iteration in 14.5 s against 29.7 s for the plain
diffusers + peft stack; channels-last VAE, the flash/efficient SDPA backends (cuDNN's, PyTorch's
own pick, is the fastest there), batches of 64 and overlap_reward gave no gain there and are
left out of FAST.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting

# perf.attention_backend -> the torch.nn.attention.SDPBackend member (None: PyTorch's own choice)
ATTENTION_BACKENDS = {"default": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                      "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
VAE_DECODE_DTYPES = ("auto", "fp32", "fp16", "bf16")  # auto: as loaded (perf.towers.VAE_DTYPES has the others)
PICKSCORE_DTYPES = ("fp32", "fp16")
PREPROCESS = ("cpu", "device")
TEXT_ENCODER_PLACES = ("device", "offload")
# Levers written for SD3's joint attention and blocks (perf.fused_qkv, perf.epilogue, perf.fp8)
SD3_ONLY_LEVERS = ("fuse_qkv", "fused_lora", "gelu_epilogue", "rollout_fp8", "v_old_fp8")
# Levers that read or rewrite the base weights in half precision: not beside perf.base_fp8_storage
BASE_WEIGHT_LEVERS = ("merge_lora_nograd", "fuse_qkv", "fused_lora", "gelu_epilogue", "rollout_fp8", "v_old_fp8")

# The combined set: config overrides (as `--set` would give them).
FAST = {
    "perf.compile_blocks": True,
    "perf.skip_single_rank_fsdp": True,
    "perf.merge_lora_nograd": True,
    "perf.fuse_qkv": True,
    "perf.fused_lora": True,
    "perf.compile_vae": True,
    "perf.cudnn_benchmark": True,
    "perf.pickscore_preprocess": "device",
    "perf.old_pass_batch": 32,
    "perf.vae_dtype": "fp16",
    "perf.pickscore_dtype": "fp16",
    # Larger batches halve the kernel launches per sample: at 16 the train step is bound by the
    # CPU launching kernels (the GPU idles ~27 % of it).
    "rollout.batch_size": 32,
    "train.micro_batch": 32,
    "train.grad_checkpointing": False,
}


@dataclass
class PerfConfig:
    """Speed levers (hpcnft bench measures each; all off by default)."""
    attention_backend: str = setting(
        "default", "SDPA backend of every DiT forward and its backward: `default` (PyTorch's pick), `flash`, "
        "`cudnn`, `efficient`, `math`. Numerics: backend-dependent rounding", choices=tuple(ATTENTION_BACKENDS))
    compile_blocks: bool = setting(
        False, "regional torch.compile of each DiT transformer block (static shapes, raised recompile limit); GPU "
        "only, and only where no FSDP2 group sits inside a block (a half-precision LoRA run under FSDP2 has one per "
        "LoRA linear, and dynamo breaks the graph at each: use it with `skip_single_rank_fsdp`). Numerics: fused "
        "kernels round differently")
    vae_channels_last: bool = setting(
        False, "VAE decode in channels-last memory format (helper: `prepare_vae`). Numerics: conv algorithm choice")
    vae_dtype: str = setting(
        "auto", "VAE decode in `fp32`, `fp16` or `bf16` instead of `auto`, the loaded dtype (helper: `prepare_vae`). "
        "Numerics: half-precision decode", choices=VAE_DECODE_DTYPES)
    pickscore_dtype: str = setting(
        "fp32", "`fp16`: PickScore towers in fp16, embeddings and the score in fp32 (helper: `prepare_scorer`). "
        "Numerics: fp16 towers", choices=PICKSCORE_DTYPES)
    pickscore_preprocess: str = setting(
        "cpu", "`device`: CLIP's resize/crop/normalise as tensor ops on the scorer's device instead of PIL on the "
        "CPU (`rewards.pickscore.clip_pixel_values`), prompts padded to 77 tokens (one text-tower shape). Numerics: "
        "antialiased bicubic of torch, not PIL: pixels within about a grey level; text rounding only",
        choices=PREPROCESS)
    skip_single_rank_fsdp: bool = setting(
        False, "on a one-rank train mesh, keep the plain module (no FSDP2 wrapping: no per-block and "
        "per-LoRA-linear all-gathers). Numerics: identical for LoRA; in a full fine-tune the gradients of the "
        "embedders, which every block uses, differ in the last bits (their blocks' contributions are summed in "
        "another order)")
    merge_lora_nograd: bool = setting(
        False, "the old-policy (no-grad) passes, rollout and v_old, run on W + s·B·A merged into the "
        "half-precision base weights, adapters off; the base weights are restored bit for bit afterwards. "
        "Numerics: one fp16 rounding of W + ΔW instead of two matmuls")
    old_pass_batch: int = setting(
        0, "v_old for all of a step's pairs in batches of this size (0: per micro-batch). Numerics: GEMM batch "
        "size changes rounding")
    fuse_qkv: bool = setting(
        False, "the no-grad passes compute q, k, v (and the text stream's) with one GEMM on concatenated weights "
        "(`perf.fused_qkv`); LoRA needs `merge_lora_nograd`; SD3 only. Numerics: one GEMM's rounding instead of "
        "three")
    fused_lora: bool = setting(
        False, "the trained forward computes a stream's q, k, v with one frozen base GEMM on concatenated weights "
        "and one GEMM on the concatenated LoRA A matrices (`perf.fused_qkv`); LoRA only, not under FSDP2 "
        "per-linear groups; SD3 only. Numerics: GEMM rounding")
    overlap_reward: bool = setting(
        False, "world 1: PickScore of a chunk in a worker thread while the next chunk samples "
        "(`LocalRewardClient`). Numerics: identical", on_resume="free")
    compile_vae: bool = setting(
        False, "torch.compile of the VAE decoder (helper: `prepare_vae`); GPU only. Numerics: fused kernels round "
        "differently")
    cudnn_benchmark: bool = setting(
        False, "cuDNN times its convolution algorithms and keeps the fastest (helper: `prepare_vae`); GPU only. "
        "Numerics: algorithm choice")
    inductor_tuning: bool = setting(
        False, "Inductor tunes the block sizes of every Triton kernel it generates by timing (coordinate descent) "
        "for the compiled blocks and VAE. Numerics: as compile (kernel choice)")
    inductor_autotune: bool = setting(
        False, "Inductor compiles a wider set of block-size configs for each pointwise and reduction kernel it "
        "generates (`max_autotune_pointwise`; in parallel worker processes) and times them at the first call. "
        "Numerics: as compile (kernel choice)")
    gelu_epilogue: bool = setting(
        False, "the no-grad passes (rollout, v_old) compute each feed-forward's first linear and its tanh GELU as "
        "one GEMM with cuBLASLt's GELU epilogue (`perf.epilogue`); SD3 only. Numerics: GELU of the fp32 "
        "accumulator, not of its fp16 rounding")
    rollout_fp8: bool = setting(
        False, "the rollout's DiT blocks multiply in fp8 (e4m3; weights scaled per output channel, activations per "
        "token; `perf.fp8`); v_old (but under `v_old_fp8`), training and evaluation keep their precision; needs fp8 "
        "GEMMs (sm89+, or the CPU); SD3 only. Numerics: fp8 rounding of every block GEMM's inputs: `hpcnft bench` "
        "reports the cost (`rollout_fp8_cost`)")
    v_old_fp8: bool = setting(
        False, "the train step's v_old pass (no grad) multiplies in fp8 the same way; the trained forward, its "
        "backward and the KL reference keep their precision; SD3 only. Numerics: fp8 rounding of the NFT loss's "
        "old velocity: `hpcnft bench` reports the cost in v_old, loss and gradient (`v_old_fp8_cost`, also against "
        "fp32 arithmetic); with π_old == π_θ the two branches no longer agree bit for bit")
    text_encoders: str = setting(
        "device", "where the text encoders (SD3's CLIP-L, CLIP-G and T5-XXL: about 11 GB in fp16) live: `device`, "
        "or `offload`: in CPU memory, moved to the GPU only to encode prompts not yet encoded, and back, with the "
        "prompt embeddings kept in CPU memory (memory lever: the DiT's GPU holds no encoder between encodings). "
        "Numerics: identical", choices=TEXT_ENCODER_PLACES)
    vae_decode_batch: int = setting(
        0, "the rollout's VAE decode in slices of this many images (0: a rollout batch at once) (memory lever: "
        "the decoder's activations grow with the batch). Numerics: conv batch size changes rounding", bound=">= 0")
    fsdp_cpu_offload: bool = setting(
        False, "FSDP2's CPUOffloadPolicy: the DiT's sharded parameters (frozen and trained), their gradients and the "
        "AdamW state live in CPU memory (pinned on GPUs), each block's weights copied to the GPU for its forward and "
        "backward, and the optimizer steps on the CPU; keeps FSDP2 on a one-rank mesh (over "
        "`skip_single_rank_fsdp`); over NCCL the process group gets a gloo backend for the CPU tensors (memory lever: "
        "what a full fine-tune's weights, gradients and AdamW state hold on the GPU). Numerics: the same fp32 "
        "AdamW formulas, on the CPU")
    replicate_frozen_base: bool = setting(
        False, "a LoRA run's frozen base stays whole on every train rank: FSDP2 shards only the trained adapters "
        "(`ignored_params`), so no forward or backward gathers the base over the network, and with the adapters "
        "alone in FSDP2's groups the blocks compile (`compile_blocks`) and fuse (`fused_lora`) on several ranks too "
        "(speed lever: every rank holds the whole base, SD3.5-M's 4.9 GB in fp16, instead of its share). Numerics: "
        "identical", on_resume="free")
    base_fp8_storage: bool = setting(
        False, "a LoRA run's frozen base linears of the DiT's blocks stored in fp8 (e4m3, one fp32 scale per output "
        "channel: half the bytes of fp16) and widened back to the compute dtype for each product "
        "(`perf.fp8_storage`); not with the levers that read or rewrite the base weights (merge_lora_nograd, "
        "fuse_qkv, fused_lora, gelu_epilogue, rollout_fp8, v_old_fp8) (memory lever: the base weights, which "
        "outweigh the rest for SD3.5-L and FLUX.1). Numerics: the base model itself is rounded once to e4m3 (3 "
        "mantissa bits); `hpcnft export` writes the full-precision base with the adapters")
    memory_budget_gib: float = setting(
        0.0, "GiB of GPU memory each train rank may use (0: no budget). Checked before any model loads against "
        "what `hpcnft bench --memory-cap-gib` measured (hpcnft.perf.memory): settings measured to need more, or "
        "that need at least as much as a measured setting over the budget, exit 2 naming the settings that fit",
        bound=">= 0")
