"""The interface a base-model family implements (see the package's docstring)."""
from __future__ import annotations

import warnings

import torch

from hpcnft.common.errors import one_line
from hpcnft.models.folders import ModelError, check_folder, quiet_libraries


class Family:
    name: str = ""
    dir_key: str = ""  # the config key of the family's model folder ("models.sd3_dir")
    tiny_dirname: str = ""  # the tiny model's folder in the tiny-model cache
    required: tuple[str, ...] = ()  # what the folder must hold (models.folders.check_folder)
    pipeline_class: str = ""  # diffusers' pipeline for this family
    transformer_class: str = ""
    # True: rollout.guidance_scale > 1 means classifier-free guidance (two DiT passes); False: the
    # DiT embeds the guidance value itself (guidance-distilled) and is always called once.
    cfg_guidance: bool = True
    # CFG's two halves in one DiT call ([negative, positive], SD3's pipeline), or two calls, the
    # positive first (WanPipeline's: the same bits as it, which one call of twice the batch is not)
    cfg_batched: bool = True
    video: bool = False  # latents [C, F', h, w] with a frame axis, decoded to frames (rollout.num_frames)

    def owns(self, transformer) -> bool:
        import diffusers

        return isinstance(transformer, getattr(diffusers, self.transformer_class))

    # -- folders and loading ---------------------------------------------------------------
    def model_dir(self, models_cfg) -> str:
        return getattr(models_cfg, self.dir_key.split(".", 1)[1])

    def load(self, path: str, dtype: torch.dtype, device: torch.device, text_encoder_device=None,
             text_encoder_dtype: torch.dtype | None = None, transformer_dtype: torch.dtype | None = None):
        """The family's real diffusers pipeline from a local folder (safetensors only), frozen and
        in eval mode: the VAE on `device`, the text encoders on `text_encoder_device` where given
        (else `device`) in `text_encoder_dtype` where given (else `dtype`), the transformer in
        host memory in `transformer_dtype` where given (else `dtype`). Policy casts the transformer
        to the compute dtype (and perf.base_fp8_storage's fp8) before it moves it to `device`, so
        the GPU never holds a wider copy than it keeps."""
        check_folder(self.dir_key, path, self.required)
        quiet_libraries()
        import diffusers

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dtypes = {"default": dtype}
                if text_encoder_dtype is not None:
                    dtypes.update({name: text_encoder_dtype for name in self.text_encoder_names})
                if transformer_dtype is not None:
                    dtypes["transformer"] = transformer_dtype
                pipe = getattr(diffusers, self.pipeline_class).from_pretrained(
                    path, local_files_only=True, use_safetensors=True, dtype=dtypes)
        except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
            raise ModelError(f"{self.dir_key}: cannot load {path!r} ({one_line(e)})") from None
        pipe.set_progress_bar_config(disable=True)
        for part in self.text_encoders(pipe):  # perf.text_encoders="offload": kept in CPU memory
            # whole in text_encoder_dtype: transformers keeps some modules in fp32 (T5's wo)
            part.to(text_encoder_device or device, text_encoder_dtype).requires_grad_(False).eval()
        pipe.vae.to(device).requires_grad_(False).eval()
        pipe.transformer.requires_grad_(False).eval()
        return pipe

    def build_tiny(self, out_dir: str) -> None:
        raise NotImplementedError

    # -- prompts ---------------------------------------------------------------------------
    text_encoder_names: tuple[str, ...] = ()  # the pipeline's text encoder components

    def text_encoders(self, pipe) -> list:
        return [getattr(pipe, name) for name in self.text_encoder_names]

    def encode_prompt(self, pipe, prompt: str, max_sequence_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt's (token embeddings [1, L, D], the family's second conditioning tensor [1, ...]):
        SD3's and FLUX's pooled embedding [1, P]. Every prompt's L is the same (prompt_tokens), so
        that a batch is a cat of its prompts; a family whose encoder gives varying lengths pads them
        and passes what its DiT needs to know of the padding (a mask) as the second tensor."""
        raise NotImplementedError

    def token_limits(self, pipe, max_sequence_length: int) -> list[tuple[str, object, int]]:
        """(encoder name, tokenizer, tokens it keeps) for every text encoder."""
        raise NotImplementedError

    def prompt_tokens(self, max_sequence_length: int) -> int:
        """The length L of encode_prompt's token embeddings [1, L, D] at this T5 length."""
        raise NotImplementedError

    # -- latents, time and the DiT ---------------------------------------------------------
    def latent_shape(self, pipe, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """The VAE latent [C, h, w] of an image (a video family's [C, F', h, w] of `num_frames`),
        the space the sampler and the NFT loss work in."""
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        return (pipe.vae.config.latent_channels, height // factor, width // factor)

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's pixels in [-1, 1], channels second ([B, 3, H, W]; a video family's [B, 3, F, H, W]),
        of the sampler's latents: the latent scaling and shift undone as the family's pipeline does."""
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z, return_dict=False)[0]

    @staticmethod
    def latents_unnormalised(vae, z: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, F, h, w] with the per-channel normalisation of a VAE that keeps
        latents_mean and latents_std (Qwen-Image's, Wan's) undone, as their pipelines undo it."""
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        return z / inv_std + mean

    def sigma_grid(self, scheduler, num_steps: int, latent_shape: tuple[int, int, int]) -> torch.Tensor:
        """The sampler's sigmas for `num_steps` steps, terminal 0 included (float32, CPU)."""
        raise NotImplementedError

    def velocity(self, transformer, x: torch.Tensor, sigma: torch.Tensor, prompt_embeds: torch.Tensor,
                 pooled: torch.Tensor, dtype: torch.dtype, integer_timesteps: bool, guidance: float) -> torch.Tensor:
        """The DiT's velocity at latents x [B, C, h, w] and flow time sigma [B], shaped like x."""
        raise NotImplementedError

    def guide(self, v_neg: torch.Tensor, v_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance's velocity from the negative and the conditional one (float32,
        [B, C, h, w]), as the family's pipeline combines them."""
        return v_neg + scale * (v_pos - v_neg)

    def prepare_dit(self, transformer) -> None:
        """Process-wide settings the family's DiT needs on its device (called once it is there)."""

    def unreached(self, transformer) -> list[torch.nn.Module]:
        """The DiT's modules whose parameters its output does not depend on (Qwen-Image's last
        block's text stream): the policy keeps them frozen, as no gradient would reach them (and
        an optimizer would keep no state for them, which a checkpoint then could not load)."""
        return []

    def fsdp_blocks(self, transformer) -> list[torch.nn.Module]:
        """The DiT's repeated blocks, each its own FSDP2 unit."""
        raise NotImplementedError
