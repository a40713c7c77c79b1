"""`hpcnft make-weights NAME DIR`: a real model repository's folder with random weights
(hpcnft.models.made.writer), to rehearse a cluster at the real shapes before the weights are
downloaded."""
from __future__ import annotations

import sys

from hpcnft.common.errors import EXIT_BAD_INPUT, EXIT_FAILED


def add_arguments(name: str, p) -> None:
    from hpcnft.models.made.manifest import MANIFESTS

    p.add_argument("model", choices=MANIFESTS, metavar="MODEL",
                   help=f"which repository's layout: {', '.join(MANIFESTS)} (hpcnft/models/made/manifests/)")
    p.add_argument("dir", help="the folder to write (must not exist, or be empty); point models.sd3_dir, "
                               "models.flux_dir or models.pickscore_dir at it")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0): one seed, one folder, bit for bit")
    p.add_argument("--device", default="", help="where the random weights are drawn: cuda is many times faster "
                                                "than one CPU core per tensor (default: cuda where present, else cpu)")


def main(name: str, args) -> int:
    import torch

    from hpcnft.models.folders import ModelError
    from hpcnft.models.made.writer import MakeError, make_folder

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        made = make_folder(args.model, args.dir, seed=args.seed, device=device,
                           say=lambda text: print(f"hpcnft make-weights: {text}", flush=True))
    except (MakeError, ModelError) as e:
        print(f"hpcnft make-weights: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"hpcnft make-weights: error: {args.dir}: {e.strerror or e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"hpcnft make-weights: {made.path}: {made.bytes / 2**30:.2f} GiB in {made.seconds:.0f} s (seed {args.seed})",
          flush=True)
    return 0
