"""`hpcnft bench`: time, FLOPs and MFU of each phase of one DiffusionNFT iteration.

Random weights at the real shapes (`--shapes sd35m`: the SD3.5-M DiT, the SD3.5 VAE and a
PickScore-shaped CLIP-H; `sd35l`: SD3.5-Large's 8.1 B DiT; `flux1dev`: FLUX.1-dev's 11.9 B DiT
in bf16 with FLUX's VAE, T5's 512 tokens, LoRA r64 and gradient checkpointing; `qwen_image`:
Qwen-Image's 20.4 B DiT likewise, with its 3D VAE and 512 masked text tokens, built in host memory;
`wan21_1_3b`: Wan2.1-T2V-1.3B's 1.4 B DiT on videos of 41 frames of 832x480 with its causal 3D VAE,
UMT5's 512 tokens, LoRA r128 and gradient checkpointing, its VAE decode and PickScore per video
(every frame scored, the mean per video); nothing is downloaded) or at the tiny shapes (`--shapes
tiny`, `tiny_flux`, `tiny_qwen_image`, `tiny_wan`: run on a CPU). Each phase is
timed after warm-up (CUDA events on a GPU, the median of the repeats), its FLOPs counted with
FlopCounterMode's formulas (hpcnft.perf.mfu.FlopCount) over the phase itself (run eagerly once;
not under a memory cap), and its
achieved TFLOP/s set against a dense matmul in the shapes' compute dtype (fp16; bf16 for FLUX)
measured in the same process.

Stacks, each measured in turn in this process:
  eager          the plain diffusers + peft stack (half-precision DiT, LoRA, autocast, default
                 SDPA; FLUX as FluxPipeline calls its DiT) written out here without any package
                 code (with --baseline);
  hpcnft default the package's own path (Policy under FSDP2, Trainer.step, Learner.iteration,
                 euler_sample, decode_to_uint8, PickScoreScorer) with every perf lever off;
  hpcnft fast    the same path with the levers of hpcnft.perf.levers.FAST (change with --set).
`--levers` measures single levers against "hpcnft default", one at a time.
`--algo nft,NAME` adds another algorithm's path beside DiffusionNFT's, in the same process
(bench.algo_stack: "hpcnft fast, NAME" and "hpcnft default, NAME", at the values its spec gives for
the bench): its train pairs (Flow-GRPO's: the trained forward with CFG, the KL reference, backward)
and its whole iteration (Flow-GRPO's: SDE rollout, decode, PickScore, two updates) at the shapes'
sizes.

Phases (sd35m's batch sizes; the others' in bench.shapes): rollout DiT forward (batch 8/16), VAE
decode, PickScore of one iteration's images, the train pair (v_old + v_theta + backward through
Trainer.step, micro-batch 4/16) and one whole
iteration of the recipe (64 samples x 10 steps at 512 px, 64 decodes and PickScores, 576 pairs).
`--phases reward_terms` (not a default phase) adds the other reward terms on one iteration's
images (the video shapes: as many frames, timed per frame) in the fast stack: HPSv2, CLIP score,
aesthetic (random-weight towers at the real shapes, fp32, as a job loads them), JPEG size and OCR
(the real PP-OCRv4 of the `ocr` extra, on one CPU thread, on 512² images that show their prompt's
text, at every shapes).
`--profile DIR` adds a torch.profiler table and a kernel summary of the "hpcnft fast" rollout
forward and train pairs.

Modules: shapes (shapes, inputs, pipe and mesh), random_models (the random-weight models), terms
(the reward terms beside PickScore), timing, eager (the baseline stack), stack (the package's
path), algo_stack (another algorithm's path), levers, report, profiling, run (Bench and the
command line).
"""
from __future__ import annotations

from hpcnft.bench.command import add_arguments, main
from hpcnft.bench.run import Bench

__all__ = ["Bench", "add_arguments", "main"]
