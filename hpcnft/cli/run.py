"""`hpcnft run` and `hpcnft make-tiny`.

Arguments only: how a run starts (the local spawner, or one rank under a launcher) is
hpcnft/run/start.py.
"""
from __future__ import annotations

import os


def add_arguments(name: str, p) -> None:
    if name == "make-tiny":
        p.add_argument("dir", help="output folder; receives sd35_tiny/, flux1_tiny/, qwen_image_tiny/, "
                                   "wan21_tiny/, pickscore_tiny/ and the reward terms' tiny models "
                                   "(clip_l_tiny/, aesthetic_tiny/, hpsv2_tiny/)")
        return
    from hpcnft.common.recipe_files import recipe_names

    p.add_argument("recipe", nargs="?", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--run-dir", help="where run.h5, checkpoints, logs and samples go")
    p.add_argument("--steps", type=int, help="run until this step (a resumed run may extend it)")


def main(name: str, args) -> int:
    if name == "make-tiny":
        from hpcnft.models.tiny import build_tiny_models, tree_digest

        import shutil

        from hpcnft.rewards.registry import tiny_term_builders

        from hpcnft.models.families import FLUX, QWEN_IMAGE, WAN

        built = list(build_tiny_models(args.dir))
        for name, build in {FLUX.tiny_dirname: FLUX.build_tiny, QWEN_IMAGE.tiny_dirname: QWEN_IMAGE.build_tiny,
                            WAN.tiny_dirname: WAN.build_tiny,
                            **tiny_term_builders()}.items():
            folder = os.path.join(args.dir, name)
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            build(folder)
            built.append(folder)
        for folder in built:
            print(f"{folder}  sha256 {tree_digest(folder)}")
        return 0
    from hpcnft.run.start import start

    return start(args.recipe, args.overrides, args.run_dir, args.steps)
