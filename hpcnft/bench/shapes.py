"""The bench's shapes (real SD3.5-M, SD3.5-L, FLUX.1-dev, Qwen-Image and Wan2.1 T2V-1.3B, or tiny
ones), the inputs its stacks feed the models, its pipe and mesh (the random-weight models:
bench.random_models). What differs between model families (the DiT's class, the text tokens and
pooled width it takes, the scheduler, the VAE's latent, a video's frames) is the shapes' `family`
(hpcnft.models.families)."""
from __future__ import annotations

import dataclasses

LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out"]
# FLUX.1-dev's recipe: both stream kinds' attention projections and the double-stream blocks' feed-forwards
FLUX_LORA_TARGETS = LORA_TARGETS + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
# Qwen-Image's recipe: both streams' attention projections and feed-forwards
QWEN_LORA_TARGETS = LORA_TARGETS + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
# Wan2.1's recipes: self-attention (attn1), cross-attention to the text (attn2), the feed-forward
WAN_LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                    "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]
QWEN_PROMPT_TOKENS = 64  # the bench's Qwen-Image prompts: this many text tokens unmasked, the rest padding
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
# FLUX.1-dev's scheduler config: the sigma grid's shift grows with the image's token count
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)
# The SD3.5 VAE (FLUX.1's has the same shape, its own scaling and shift)
SD35_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
# PickScore's CLIP-H (text and vision towers)
PICKSCORE_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      max_position_embeddings=77, vocab_size=49408, hidden_act="gelu", projection_dim=1024)
PICKSCORE_VISION = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                        image_size=224, patch_size=14, hidden_act="gelu", projection_dim=1024)
TRAIN_K = 2  # sigmas per sample in the train-pair phase: two micro-batches per measured step


def _torch():
    import torch  # lazily, so that `hpcnft --help` stays light

    return torch


@dataclasses.dataclass
class Shapes:
    name: str
    recipe: str
    dit: dict
    vae: dict
    clip_text: dict
    clip_vision: dict
    clip_projection: int
    size: int  # image side, px (the height where `width` is set)
    t5_tokens: int  # rollout.max_sequence_length
    prompts: int  # P
    per_prompt: int  # G
    num_steps: int
    rollout_batches: tuple
    micro_batches: tuple
    ceiling_n: int
    lora_rank: int
    lora_alpha: int
    warm: int
    reps: int
    hpsv2_arch: dict  # the HPSv2 term's CLIP, as an open_clip model config
    clip_l: dict  # the clipscore and aesthetic terms' CLIP (hpcnft.rewards.clip_l's layout)
    family: str = "sd3"  # hpcnft.models.families: the DiT's class, its text inputs, the sigma grid
    precision: str = "fp16"  # train.precision on a GPU (fp32 on a CPU)
    grad_checkpointing: bool = False  # every stack, the fast one included
    lora_targets: tuple = tuple(LORA_TARGETS)
    scheduler: dict = dataclasses.field(default_factory=lambda: dict(SD3_SCHEDULER))
    host_build: bool = False  # the DiT built in host memory first (Qwen-Image's fp32 copy outgrows an 80 GB card)
    width: int = 0  # image width, px, where it is not `size` (Wan2.1's 832 x 480)
    num_frames: int = 1  # rollout.num_frames: a video's frames (Wan: 1 + 4k); 1, an image
    # The eager stack's classifier-free guidance: Wan's recipe's rollout.guidance_scale, as WanPipeline
    # guides (the conditional DiT call, then the negative prompt's); 1.0: none (the image shapes' eager stacks)
    cfg_scale: float = 1.0
    timestep_fraction: float = 0.99  # the recipe's: int(num_steps x fraction) sigma trained per sample

    @property
    def hw(self) -> tuple[int, int]:
        """An image's (a video frame's) height and width, px."""
        return self.size, self.width or self.size

    @property
    def video(self) -> bool:
        return self.num_frames > 1

    @property
    def unit(self) -> str:
        """What one sample is to the VAE and the reward: an image, or a video of num_frames."""
        return "video" if self.video else "image"

    @property
    def trained_steps(self) -> int:
        return int(self.num_steps * self.timestep_fraction)

    @property
    def samples(self) -> int:
        return self.prompts * self.per_prompt

    @property
    def text_tokens(self) -> int:
        """The length of the prompt embeddings the DiT takes: SD3's CLIP-L/G (77) and T5 side by
        side, FLUX's T5 alone (its CLIP gives the pooled embedding only)."""
        from hpcnft.models.families import family_named

        return family_named(self.family).prompt_tokens(self.t5_tokens)

    @property
    def text_dim(self) -> int:
        """The width of the prompt embeddings the DiT takes (Wan's UMT5: text_dim)."""
        return self.dit["text_dim"] if self.family == "wan" else self.dit["joint_attention_dim"]

    @property
    def pooled_width(self) -> int:
        """The second conditioning tensor's width: the pooled embedding's, Qwen-Image's text mask's,
        Wan's none (an empty [n, 0])."""
        if self.family == "wan":
            return 0
        return self.text_tokens if self.family == "qwen_image" else self.dit["pooled_projection_dim"]

    def conditioning(self, n: int, seed: int, dtype):
        """Random prompt embeddings [n, L, D] and a pooled embedding, in `dtype`; Qwen-Image's mask for the
        latter, Wan's empty [n, 0]."""
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        pe = torch.randn(n, self.text_tokens, self.text_dim, generator=g).to(dtype)
        if self.family == "qwen_image":
            mask = torch.zeros(n, self.text_tokens, dtype=torch.long)
            mask[:, :min(QWEN_PROMPT_TOKENS, self.text_tokens)] = 1
            return pe, mask
        return pe, torch.randn(n, self.pooled_width, generator=g).to(dtype)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The VAE latent [C, h, w] of an image ([C, F', h, w] of a Wan video): the space of the
        sampler and the NFT loss (FLUX's and Qwen-Image's DiTs pack it into tokens themselves)."""
        h, w = self.hw
        if "z_dim" in self.vae:  # AutoencoderKLQwenImage, AutoencoderKLWan: 2x per temporal-downsample entry
            f = 2 ** len(self.vae["temperal_downsample"])
            if self.family == "wan":
                from hpcnft.models.families.wan import latent_frames

                return (self.vae["z_dim"], latent_frames(self.num_frames), h // f, w // f)
            return (self.vae["z_dim"], h // f, w // f)
        f = 2 ** (len(self.vae["block_out_channels"]) - 1)
        return (self.vae["latent_channels"], h // f, w // f)


def sd35m_shapes() -> Shapes:
    from hpcnft.rewards.clip_l import VIT_L_14
    from hpcnft.rewards.hpsv2 import VIT_H_14

    return Shapes(
        name="sd35m", recipe="sd35m_pickscore",
        dit=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                 num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                 dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        vae=dict(SD35_VAE), clip_text=dict(PICKSCORE_TEXT), clip_vision=dict(PICKSCORE_VISION),
        clip_projection=1024, size=512, t5_tokens=256, prompts=8, per_prompt=8, num_steps=10,
        rollout_batches=(8, 16), micro_batches=(4, 16), ceiling_n=8192, lora_rank=32, lora_alpha=64,
        warm=2, reps=5, hpsv2_arch=VIT_H_14, clip_l=VIT_L_14)


def sd35l_shapes() -> Shapes:
    """SD3.5-Large: the 8.1 B MMDiT (38 blocks of width 2432, no dual-attention blocks), the SD3.5
    VAE and text widths, PickScore's CLIP-H; fp16 like SD3.5-M. Micro-batches 2 (the recipe's) and
    4 without checkpointing: about 7 GB of activations a sample beside 16 GB of fp16 weights."""
    from hpcnft.rewards.clip_l import VIT_L_14
    from hpcnft.rewards.hpsv2 import VIT_H_14

    return Shapes(
        name="sd35l", recipe="sd35l_pickscore",
        dit=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                 num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, dual_attention_layers=(),
                 qk_norm="rms_norm"),
        vae=dict(SD35_VAE), clip_text=dict(PICKSCORE_TEXT), clip_vision=dict(PICKSCORE_VISION),
        clip_projection=1024, size=512, t5_tokens=256, prompts=8, per_prompt=8, num_steps=10,
        rollout_batches=(8, 16), micro_batches=(2, 4), ceiling_n=8192, lora_rank=32, lora_alpha=64,
        warm=1, reps=3, hpsv2_arch=VIT_H_14, clip_l=VIT_L_14)


def flux1dev_shapes() -> Shapes:
    """FLUX.1-dev: the 11.9 B DiT (19 double- and 38 single-stream blocks of width 3072, the
    guidance embedding), FLUX's VAE (SD3.5's shape, its own scaling and shift), T5-XXL's 512
    tokens and CLIP-L's pooled 768, PickScore's CLIP-H; bf16, LoRA r64 on the recipe's 12
    targets, gradient checkpointing (about 14 GB of activations a sample without it, beside 24 GB
    of bf16 weights)."""
    from hpcnft.rewards.clip_l import VIT_L_14
    from hpcnft.rewards.hpsv2 import VIT_H_14

    return Shapes(
        name="flux1dev", recipe="flux1dev_pickscore",
        dit=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
        vae=dict(SD35_VAE, scaling_factor=0.3611, shift_factor=0.1159), clip_text=dict(PICKSCORE_TEXT),
        clip_vision=dict(PICKSCORE_VISION), clip_projection=1024, size=512, t5_tokens=512, prompts=8, per_prompt=8,
        num_steps=10, rollout_batches=(4, 8), micro_batches=(2, 4), ceiling_n=8192, lora_rank=64, lora_alpha=128,
        warm=1, reps=3, hpsv2_arch=VIT_H_14, clip_l=VIT_L_14, family="flux", precision="bf16",
        grad_checkpointing=True, lora_targets=tuple(FLUX_LORA_TARGETS), scheduler=dict(FLUX_SCHEDULER))


def tiny_shapes() -> Shapes:
    from hpcnft.models.tiny import TINY_PICKSCORE, TINY_TRANSFORMER, TINY_VAE
    from hpcnft.rewards.clip_l import TINY_CLIP_L
    from hpcnft.rewards.hpsv2 import TINY_EMBED_DIM, TINY_TEXT, TINY_VISION

    return Shapes(
        name="tiny", recipe="tiny", dit=dict(TINY_TRANSFORMER), vae=dict(TINY_VAE),
        clip_text=dict(TINY_PICKSCORE["text"], vocab_size=1024), clip_vision=dict(TINY_PICKSCORE["vision"]),
        clip_projection=TINY_PICKSCORE["projection_dim"], size=64, t5_tokens=16, prompts=2, per_prompt=4,
        num_steps=10, rollout_batches=(4, 8), micro_batches=(4, 8), ceiling_n=512, lora_rank=8, lora_alpha=16,
        warm=1, reps=2, hpsv2_arch={"embed_dim": TINY_EMBED_DIM, "vision_cfg": TINY_VISION, "text_cfg": TINY_TEXT},
        clip_l=TINY_CLIP_L)


def tiny_flux_shapes() -> Shapes:
    """The tiny FLUX.1-dev (hpcnft.models.tiny_flux) at the tiny shapes: the FLUX paths on a CPU."""
    from hpcnft.models.tiny_flux import TINY_FLUX_SCHEDULER, TINY_FLUX_TRANSFORMER, TINY_FLUX_VAE

    S = tiny_shapes()
    return dataclasses.replace(S, name="tiny_flux", recipe="tiny_flux", dit=dict(TINY_FLUX_TRANSFORMER),
                               vae=dict(TINY_FLUX_VAE), family="flux", precision="bf16",
                               lora_targets=tuple(FLUX_LORA_TARGETS), scheduler=dict(TINY_FLUX_SCHEDULER))


def qwen_image_shapes() -> Shapes:
    """Qwen-Image: the 20.4 B MMDiT (60 double-stream blocks of width 3072, text at Qwen2.5-VL's 3584), its 3D VAE,
    512 text tokens, CLIP-H; bf16, LoRA r64 on 12 targets, checkpointing; built on the host (fp32: 82 GB)."""
    from hpcnft.models.tiny_qwen_image import QWEN_IMAGE_SCHEDULER

    S = flux1dev_shapes()
    return dataclasses.replace(
        S, name="qwen_image", recipe="qwen_image_pickscore", family="qwen_image",
        dit=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True]),
        prompts=3, per_prompt=16, rollout_batches=(4, 8), micro_batches=(1, 2), lora_targets=tuple(QWEN_LORA_TARGETS),
        scheduler=dict(QWEN_IMAGE_SCHEDULER), host_build=True)


def tiny_qwen_image_shapes() -> Shapes:
    """The tiny Qwen-Image (hpcnft.models.tiny_qwen_image) at the tiny shapes: its paths on a CPU."""
    from hpcnft.models.tiny_dims import TINY_QWEN_IMAGE_TRANSFORMER
    from hpcnft.models.tiny_qwen_image import QWEN_IMAGE_SCHEDULER, TINY_QWEN_VAE

    return dataclasses.replace(tiny_shapes(), name="tiny_qwen_image", recipe="tiny_qwen_image", family="qwen_image",
                               dit=dict(TINY_QWEN_IMAGE_TRANSFORMER), vae=dict(TINY_QWEN_VAE), precision="bf16",
                               lora_targets=tuple(QWEN_LORA_TARGETS), scheduler=dict(QWEN_IMAGE_SCHEDULER))


def wan21_1_3b_shapes() -> Shapes:
    """Wan2.1-T2V-1.3B at the wan21_1_3b_pickscore recipe's sizes: the 1.4 B DiT (30 blocks of width 1536, UMT5's
    512 tokens at 4096), AutoencoderKLWan; 41 frames of 832 x 480 (11 latent frames of 104 x 60), 12 steps, no CFG,
    4 sigma trained per sample; bf16, LoRA r128 on the 10 targets, checkpointing; batch 2, micro-batch 1."""
    from hpcnft.models.tiny_wan import TINY_WAN_SCHEDULER

    return dataclasses.replace(
        flux1dev_shapes(), name="wan21_1_3b", recipe="wan21_1_3b_pickscore", family="wan",
        dit=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                 text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True]),  # latents_mean/std: AutoencoderKLWan's defaults
        size=480, width=832, num_frames=41, prompts=3, per_prompt=16, num_steps=12, rollout_batches=(1, 2),
        micro_batches=(1, 2), lora_rank=128, lora_alpha=128, lora_targets=tuple(WAN_LORA_TARGETS),
        scheduler=dict(TINY_WAN_SCHEDULER), timestep_fraction=0.34)


def tiny_wan_shapes() -> Shapes:
    """The tiny Wan2.1 (hpcnft.models.tiny_wan) at the tiny shapes with the tiny_wan recipe's videos (5 frames,
    2 latent frames) and guidance 4.5: its paths on a CPU."""
    from hpcnft.models.tiny_dims import TINY_WAN_TRANSFORMER
    from hpcnft.models.tiny_wan import TINY_WAN_SCHEDULER, TINY_WAN_VAE

    return dataclasses.replace(tiny_shapes(), name="tiny_wan", recipe="tiny_wan", family="wan",
                               dit=dict(TINY_WAN_TRANSFORMER), vae=dict(TINY_WAN_VAE), num_frames=5, cfg_scale=4.5,
                               precision="bf16", lora_targets=tuple(WAN_LORA_TARGETS),
                               scheduler=dict(TINY_WAN_SCHEDULER))


SHAPES = {"sd35m": sd35m_shapes, "sd35l": sd35l_shapes, "flux1dev": flux1dev_shapes, "qwen_image": qwen_image_shapes,
          "wan21_1_3b": wan21_1_3b_shapes, "tiny": tiny_shapes, "tiny_flux": tiny_flux_shapes,
          "tiny_qwen_image": tiny_qwen_image_shapes, "tiny_wan": tiny_wan_shapes}
# What each needs: the real shapes a CUDA device, the tiny ones run on a CPU
REAL_SHAPES = ("sd35m", "sd35l", "flux1dev", "qwen_image", "wan21_1_3b")


# -- what the stacks feed the models ---------------------------------------------------------------
def scheduler(S: Shapes | None = None):
    """The flow-matching scheduler of the shapes' family (SD3's without shapes)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**(S.scheduler if S is not None else SD3_SCHEDULER))


def prompt_list(n: int) -> list[str]:
    from hpcnft.models.tiny import PROMPTS

    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def random_images(S: Shapes, n: int, videos: bool = False):
    """Uniform uint8 noise: n images [n, H, W, 3] at the shapes' image (a video's frame) size;
    `videos`: n of the shapes' videos, their frames [n, F, H, W, 3]."""
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (n, *((S.num_frames,) if videos else ()), *S.hw, 3), generator=g, dtype=torch.uint8)


def smooth_images(S: Shapes, n: int):
    """Random 16x16 colours upsampled bilinearly to the image (a video's frame) size: smooth like decoded images."""
    torch = _torch()
    g = torch.Generator().manual_seed(4)
    low = torch.rand(n, 3, 16, 16, generator=g) * 255
    up = torch.nn.functional.interpolate(low, size=S.hw, mode="bilinear", align_corners=False)
    return up.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


# -- what the Learner needs around the models ------------------------------------------------------
class _Pipe:
    """What the Learner uses of the family's pipeline: the scheduler, the VAE, the DiT and
    encode_prompt (here: a fixed random embedding per prompt at the real text shapes, returned as
    the family's pipeline returns it)."""

    def __init__(self, transformer, vae, S: Shapes, dtype, device):
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler(S)
        self.S, self.dtype, self.device = S, dtype, device

    def encode_prompt(self, prompt, *_, device=None, max_sequence_length=256, **__):
        torch = _torch()
        from hpcnft.common.determinism import stable_hash
        from hpcnft.models.families import family_named

        g = torch.Generator().manual_seed(stable_hash("bench_prompt", prompt))
        tokens = family_named(self.S.family).prompt_tokens(max_sequence_length)
        pe = torch.randn(1, tokens, self.S.text_dim, generator=g)
        pooled = torch.randn(1, self.S.pooled_width, generator=g)
        dev = device or self.device
        pe, pooled = pe.to(dev, self.dtype), pooled.to(dev, self.dtype)
        if self.S.family == "flux":  # FluxPipeline.encode_prompt: (embeddings, pooled, text ids)
            return pe, pooled, torch.zeros(max_sequence_length, 3, device=dev, dtype=self.dtype)
        if self.S.family in ("qwen_image", "wan"):  # Qwen: no padding, no mask; WanPipeline: (embeddings, negative)
            return pe, None
        return pe, None, pooled, None


_MESH = []


def world1_mesh(dev):
    """A one-rank process group and train mesh, as hpcnft.distributed.groups.setup makes for world 1."""
    if not _MESH:
        torch = _torch()
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            # gloo beside NCCL for CPU tensors: a stack under perf.fsdp_cpu_offload reduces them
            backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
            kwargs = {}
            if dev.type == "cuda":  # a group of two backends binds NCCL to an indexed device ("cuda" is refused)
                index = torch.cuda.current_device() if dev.index is None else dev.index
                kwargs["device_id"] = torch.device("cuda", index)
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # a port of the kernel's choice
            dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        _MESH.append(DeviceMesh(dev.type, torch.tensor([0])))
    return _MESH[0]


def tiny_shapes_name(family: str) -> str:
    """The tiny shapes of a model family (what a CPU can run in place of its real shapes)."""
    return {"flux": "tiny_flux", "qwen_image": "tiny_qwen_image", "wan": "tiny_wan"}.get(family, "tiny")


# --set keys that change the shapes themselves: the step's sample count, the sampler's steps and the
# T5 length. The bench follows them everywhere (the eager stack, the per-sample rates), so that it
# can be set beside a job at the job's own settings (bench/job_settings.py).
SHAPE_KEYS = {"rollout.prompts_per_step": "prompts", "rollout.samples_per_prompt": "per_prompt",
              "rollout.num_steps": "num_steps", "rollout.max_sequence_length": "t5_tokens"}


def with_sets(S: Shapes, overrides: dict) -> Shapes:
    """S with the values of the SHAPE_KEYS that --set names."""
    return dataclasses.replace(S, **{field: int(overrides[k]) for k, field in SHAPE_KEYS.items() if k in overrides})
