"""`hpcnft bench`: its arguments, the checks made before anything is built, and the run."""
from __future__ import annotations

import argparse
import os
import sys

from hpcnft.algo.registry import ALGORITHMS
from hpcnft.bench.levers import expand_levers, fast_overrides
from hpcnft.bench.memory_caps import parse_caps
from hpcnft.bench.report import markdown
from hpcnft.bench.run import Bench
from hpcnft.bench.shapes import REAL_SHAPES, SHAPES, tiny_shapes_name, with_sets
from hpcnft.bench.stack import DEFAULT_ALGO, bench_config
from hpcnft.common.errors import UsageError

PHASES = ("rollout", "vae", "pickscore", "train", "iteration", "reward_terms")
ALGOS = tuple(ALGORITHMS)  # algo.name's choices
DEFAULT_PHASES = ("rollout", "vae", "pickscore", "train", "iteration")


def _names_of(what: str, choices: tuple[str, ...]):
    """An argparse type: a comma-separated list of `choices` (a `what` each)."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)} "
                                             f"(choose from {', '.join(choices)})")
        return names
    return parse


_phase_list = _names_of("phase", PHASES)
_algo_list = _names_of("algorithm", ALGOS)


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", choices=list(SHAPES), default="sd35m",
                   help="random weights at real shapes, each with its family's VAE and PickScore's CLIP-H (need "
                        "CUDA): sd35m (SD3.5-Medium, fp16), sd35l (SD3.5-Large, fp16), flux1dev (FLUX.1-dev, bf16, "
                        "LoRA r64, gradient checkpointing), qwen_image (Qwen-Image, bf16, LoRA r64, gradient "
                        "checkpointing), wan21_1_3b (Wan2.1-T2V-1.3B, videos of 41 frames of 832x480, bf16, LoRA "
                        "r128, gradient checkpointing); or the tiny models (a CPU is fine): tiny (SD3), tiny_flux "
                        "(FLUX.1-dev), tiny_qwen_image (Qwen-Image), tiny_wan (Wan2.1, 5 frames)")
    p.add_argument("--baseline", action="store_true",
                   help="also measure the plain diffusers + peft eager stack, and print the ratios")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON here (rewritten after every phase)")
    p.add_argument("--levers", nargs="*", default=[], metavar="KEY=VALUE",
                   help="single levers measured one at a time against hpcnft default, e.g. "
                        "attention_backend=cudnn perf.compile_blocks=true, or 'all' for the standard sweep")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change the 'hpcnft fast' combination (default: hpcnft.perf.levers.FAST), repeatable; "
                        "rollout.prompts_per_step, samples_per_prompt and num_steps change the shapes (every stack)")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also measure 'hpcnft fast' with these changes on top (a KEY without a dot is perf.*), "
                        "after it in the same process, at its phases and batch sizes; repeatable")
    p.add_argument("--iteration", choices=["fast", "all", "none"], default="fast",
                   help="which stacks run a whole iteration: fast (+ eager with --baseline), all, none")
    p.add_argument("--iteration-warm", type=int, default=1,
                   help="untimed whole iterations of every stack first (default 1: an iteration meets shapes "
                        "its phases do not, the VAE and v_old at the rollout batch, and compiles them)")
    p.add_argument("--iteration-reps", type=int, default=1,
                   help="timed whole iterations of the hpcnft stacks, median (default 1; eager: always 1)")
    p.add_argument("--all-shapes", action="store_true",
                   help="measure 'hpcnft fast' at every rollout batch and micro-batch too (more compiles)")
    p.add_argument("--phases", type=_phase_list, default=list(DEFAULT_PHASES), metavar="NAME[,NAME]",
                   help=f"measure only these phases of every stack (default: {','.join(DEFAULT_PHASES)}); "
                        "e.g. 'iteration' for whole iterations alone; 'reward_terms': the HPSv2, CLIP score, "
                        "aesthetic, JPEG size and OCR terms beside PickScore, in the fast stack (OCR: the real "
                        "recognizer of the ocr extra, on 512-pixel images with text)")
    p.add_argument("--own-shapes", action="store_true",
                   help="measure 'hpcnft fast' at its own rollout batch and micro-batch only, not also at the "
                        "eager stack's (fewer compiles)")
    p.add_argument("--no-default", action="store_true", help="skip the 'hpcnft default' stack")
    p.add_argument("--memory-cap-gib", dest="memory_caps", type=parse_caps, default=[], metavar="N[,N]",
                   help="after 'hpcnft fast', run its phases and iteration again with the process capped at N GiB "
                        "of GPU memory, once per N, at the settings hpcnft.perf.memory has for a card that size "
                        "(recorded with memory_cap_gib, the peak and the times in the JSON)")
    p.add_argument("--text-encoders", choices=["embeddings", "real"], default="embeddings",
                   help="what the whole iteration encodes prompts with: fixed random embeddings (default), or "
                        "SD3.5's CLIP-L, CLIP-G and T5-XXL at their real shapes (11 GB more, and their time)")
    p.add_argument("--algo", type=_algo_list, default=[DEFAULT_ALGO], metavar="NAME[,NAME]",
                   help=f"the algorithms measured, in this process ({', '.join(ALGOS)}): {DEFAULT_ALGO} (DiffusionNFT: "
                        "every stack, --baseline, --levers, --variant); any other: its train pairs and iteration "
                        "at its SD3.5-M recipe's values with the fast stack's levers, and in the default stack "
                        f"unless --no-default ('hpcnft fast, NAME'); e.g. {','.join(ALGOS)} (default: {DEFAULT_ALGO})")
    p.add_argument("--budget-s", type=float, help="skip the remaining measurements after this many seconds")
    p.add_argument("--profile", metavar="DIR",
                   help="after the 'hpcnft fast' phases, profile one rollout forward and one train-pairs call "
                        "(torch.profiler): DIR/profile-*.txt, and a summary by kernel kind in the JSON")


def main(name: str, args: argparse.Namespace) -> int:
    args.argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv[1:2] else []
    import torch

    S = SHAPES[args.shapes]()
    if args.shapes in REAL_SHAPES and not torch.cuda.is_available():
        tiny = tiny_shapes_name(S.family)
        raise UsageError(f"--shapes {args.shapes} needs a CUDA device and none is available "
                         f"(use --shapes {tiny} on a CPU)")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if DEFAULT_ALGO not in args.algo and (args.baseline or args.levers or args.variants):
        raise UsageError(f"--baseline, --levers and --variant measure DiffusionNFT: add {DEFAULT_ALGO} to --algo")
    fast_over = fast_overrides(S, dev, args.overrides)
    S = with_sets(S, fast_over)
    for name in (n for n in args.algo if n != DEFAULT_ALGO):
        from hpcnft.bench.algo_stack import algorithm_overrides

        for over in (fast_over, {}):
            bench_config(S, dev, algorithm_overrides(name, over, S.family))
    for over in expand_levers(args.levers, dev, S) + [fast_over] + [
            {**fast_over, **change} for change in expand_levers(args.variants, dev, S, "--variant")]:
        bench_config(S, dev, over)  # bad specs and config values fail before anything is built
    if args.memory_caps and dev.type != "cuda":
        raise UsageError("--memory-cap-gib caps GPU memory and needs a CUDA device")
    if args.text_encoders == "real" and S.family != "sd3":
        raise UsageError(f"--text-encoders real: SD3's encoders only, not with --shapes {args.shapes}")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d):
            raise UsageError(f"--json {args.json!r}: folder {d!r} does not exist")
    if args.profile:
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--profile {args.profile!r}: {e.strerror or e}") from None
    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    bench = Bench(args, S, dev)
    try:
        doc = bench.run()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(markdown(doc))
    return 0
