"""The bench's shapes (real SD3.5-M or tiny) and its random-weight models, pipe and mesh."""
from __future__ import annotations

import dataclasses

LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out"]
CLIP_TOKENS = 77
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
    size: int  # image side, px
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

    @property
    def samples(self) -> int:
        return self.prompts * self.per_prompt

    @property
    def text_tokens(self) -> int:
        return CLIP_TOKENS + self.t5_tokens


def sd35m_shapes() -> Shapes:
    from hpcnft.rewards.clip_l import VIT_L_14
    from hpcnft.rewards.hpsv2 import VIT_H_14

    return Shapes(
        name="sd35m", recipe="sd35m_pickscore",
        dit=dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                 num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                 dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        vae=dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                 up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                 layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                 scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
        clip_text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       max_position_embeddings=77, vocab_size=49408, hidden_act="gelu", projection_dim=1024),
        clip_vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                         image_size=224, patch_size=14, hidden_act="gelu", projection_dim=1024),
        clip_projection=1024, size=512, t5_tokens=256, prompts=8, per_prompt=8, num_steps=10,
        rollout_batches=(8, 16), micro_batches=(4, 16), ceiling_n=8192, lora_rank=32, lora_alpha=64,
        warm=2, reps=5, hpsv2_arch=VIT_H_14, clip_l=VIT_L_14)


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


SHAPES = {"sd35m": sd35m_shapes, "tiny": tiny_shapes}


# -- random-weight models -------------------------------------------------------------------
def build_dit(S: Shapes, dev):
    torch = _torch()
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    with torch.device(dev):
        return SD3Transformer2DModel(**S.dit)


def build_vae(S: Shapes, dev):
    torch = _torch()
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    with torch.device(dev):
        return AutoencoderKL(**S.vae).eval().requires_grad_(False)


def build_clip(S: Shapes, dev):
    torch = _torch()
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(2)
    cfg = CLIPConfig(text_config=S.clip_text, vision_config=S.clip_vision, projection_dim=S.clip_projection)
    with torch.device(dev):
        return CLIPModel(cfg).eval().requires_grad_(False)


_PROCESSOR = []


def clip_processor():
    """The CLIP-H preprocessing and a CLIP BPE tokenizer, from the tiny models (built offline)."""
    if not _PROCESSOR:
        from transformers import AutoProcessor

        from hpcnft.models.folders import quiet_libraries
        from hpcnft.models.tiny import ensure_tiny_models
        from hpcnft.models.tiny_cache import cache_dir

        quiet_libraries()
        _, ps = ensure_tiny_models(cache_dir())
        _PROCESSOR.append(AutoProcessor.from_pretrained(ps, local_files_only=True))
    return _PROCESSOR[0]


def scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def prompt_list(n: int) -> list[str]:
    from hpcnft.models.tiny import PROMPTS

    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def random_images(S: Shapes, n: int):
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (n, S.size, S.size, 3), generator=g, dtype=torch.uint8)


def smooth_images(S: Shapes, n: int):
    """Random 16x16 colours upsampled bilinearly to the image size: smooth like decoded images."""
    torch = _torch()
    g = torch.Generator().manual_seed(4)
    low = torch.rand(n, 3, 16, 16, generator=g) * 255
    up = torch.nn.functional.interpolate(low, size=(S.size, S.size), mode="bilinear", align_corners=False)
    return up.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


# -- what the Learner needs around the models ------------------------------------------------------
class _Pipe:
    """What the Learner uses of a StableDiffusion3Pipeline: the scheduler, the VAE, the DiT's config
    and encode_prompt (here: a fixed random embedding per prompt at the real text shapes)."""

    def __init__(self, transformer, vae, S: Shapes, dtype, device):
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler()
        self.S, self.dtype, self.device = S, dtype, device

    def encode_prompt(self, prompt, prompt_2=None, prompt_3=None, device=None, do_classifier_free_guidance=False,
                      max_sequence_length=256, **_):
        torch = _torch()
        from hpcnft.common.determinism import stable_hash

        g = torch.Generator().manual_seed(stable_hash("bench_prompt", prompt))
        pe = torch.randn(1, CLIP_TOKENS + max_sequence_length, self.S.dit["joint_attention_dim"], generator=g)
        pooled = torch.randn(1, self.S.dit["pooled_projection_dim"], generator=g)
        return pe.to(device or self.device, self.dtype), None, pooled.to(device or self.device, self.dtype), None


_MESH = []


def world1_mesh(dev):
    """A one-rank process group and train mesh, as hpcnft.dist.groups.setup makes for world 1."""
    if not _MESH:
        torch = _torch()
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from hpcnft.dist.groups import free_port

        if not dist.is_initialized():
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kwargs = {"device_id": dev} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    **kwargs)
        _MESH.append(DeviceMesh(dev.type, torch.tensor([0])))
    return _MESH[0]
