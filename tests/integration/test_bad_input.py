"""`hpcnft run` with bad input: exit 2, one line on stderr naming the problem, no traceback, and
nothing already in the run dir touched (docs/architecture.md, "Contracts the code keeps": bad
input is one line).

Every case runs the real command in a fresh interpreter, with the launcher variables of the
environment removed so that `run` takes its local-spawner path (where the preflight lives).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_", "TORCHELASTIC_")
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPCNFT_LAUNCHER",
                 "SUBMITIT_EXECUTOR"}
SENTINEL = b"pre-existing run dir content \x00\xff\n"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    # should a case wrongly get past the checks, the tiny models land here, not in ~/.cache
    env["HPCNFT_CACHE"] = str(tmp_path / "cache")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            full = Path(dirpath, name)
            st = full.lstat()
            out[str(full.relative_to(root))] = (st.st_mode, full.read_bytes() if full.is_file() else None)
    return out


def _case_missing_model_folder(tmp):
    return ["--set", "models.sd3_dir=/nonexistent", "--set", "models.pickscore_dir=/nonexistent"], \
        ["models.sd3_dir", "/nonexistent"]


def _case_missing_flux_folder(tmp):
    missing = "/nonexistent/FLUX.1-dev"
    return ["tiny_flux", "--set", f"models.flux_dir={missing}"], ["models.flux_dir", missing]


def _case_missing_wan_folder(tmp):
    missing = "/nonexistent/Wan2.1-T2V-1.3B-Diffusers"
    return ["tiny_wan", "--set", f"models.wan_dir={missing}"], ["models.wan_dir", missing]


def _case_wan_frames_not_one_plus_four_k(tmp):
    return ["tiny_wan", "--set", "rollout.num_frames=8"], ["rollout.num_frames", "1 + 4k", "got 8"]


def _case_incomplete_model_folder(tmp):
    d = tmp / "models" / "sd3"
    d.mkdir(parents=True)
    (d / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    return ["--set", f"models.sd3_dir={d}", "--set", f"models.pickscore_dir={d}"], \
        ["models.sd3_dir", str(d), "transformer/config.json"]


def _case_missing_prompt_file(tmp):
    p = tmp / "prompts" / "absent.txt"
    return ["--set", f"data.train_prompts={p}"], ["data.train_prompts", str(p)]


def _case_empty_prompt_file(tmp):
    p = tmp / "blank.txt"
    p.write_text("   \n\n\t\n")
    return ["--set", f"data.eval_prompts={p}"], ["data.eval_prompts", str(p), "empty"]


def _case_drawbench_without_its_column(tmp):
    p = tmp / "DrawBench.csv"
    p.write_text("Prompt,Category\nA red colored car.,Colors\n")
    return ["--set", f"data.eval_prompts=drawbench:{p}#Colors"], ["data.eval_prompts", str(p), "'Prompts'"]


def _case_prompt_file_with_a_nul_byte(tmp):
    p = tmp / "prompts.txt"
    p.write_bytes(b"a red car\na blue\x00 bird\n")  # valid UTF-8: only the NUL gives it away
    return ["--set", f"data.train_prompts={p}"], ["data.train_prompts", str(p), "NUL", "line 2"]


def _case_ocr_prompt_without_quoted_text(tmp):
    p = tmp / "ocr.txt"
    p.write_text('a sign that says "OPEN"\na photo of a cat\n')
    return ["tiny_ocr", "--set", f"data.train_prompts={p}"], \
        ["data.train_prompts", "prompt 2 of 2 has no double-quoted text", "OCR term 'ocr'", "'a photo of a cat'"]


def _case_recipe_file_not_utf8(tmp):
    p = tmp / "latin1.toml"
    p.write_bytes(b"steps = 2\n# caf\xe9\n")
    return [str(p)], [str(p), "not UTF-8", "0xe9", "offset 15"]


def _case_recipe_file_a_directory(tmp):
    d = tmp / "recipes"
    d.mkdir()
    return [f"{d}/"], [f"{d}/", "is a directory"]


def _case_unknown_recipe(tmp):
    return ["no_such_recipe"], ["no_such_recipe", "tiny", "sd35m_pickscore"]


def _case_unknown_config_key(tmp):
    return ["--set", "optim.lrr=1e-3"], ["optim.lrr"]


def _case_wrong_type(tmp):
    # a bare word parses as a string, which is a type error for a float key
    return ["--set", "optim.lr=abc"], ["optim.lr", "abc"]


def _case_out_of_range(tmp):
    return ["--set", "nft.timestep_fraction=1.5"], ["nft.timestep_fraction", "1.5"]


def _case_unknown_tracker(tmp):
    return ["--set", 'logging.trackers=["tensorbord"]'], ["logging.trackers", "tensorbord"]


def _case_run_dir_below_a_regular_file(tmp):
    # Tests run as root, and root ignores permission bits, so `chmod 500` on a parent would not
    # stop it. A path below a regular file fails for everyone (ENOTDIR), root included. The
    # blocking file sits inside the watched run dir, so the snapshot shows it is left as it was.
    run_dir = tmp / "run" / "sentinel.bin" / "run"
    return ["--run-dir", str(run_dir)], [str(run_dir)]


def _case_layout_that_does_not_split_the_samples(tmp):
    # a run dir that does not exist yet: the refusal leaves none behind (tested below)
    return ["--set", "layout.train_ranks=3", "--run-dir", str(tmp / "fresh")], \
        ["16 samples per step", "3 train ranks"]


def _case_grpo_key_under_nft(tmp):
    return ["--set", "grpo.clip_range=0.2"], ["grpo.clip_range", "Flow-GRPO", "algo.name", "nft"]


def _case_nft_key_under_grpo(tmp):
    return ["tiny_learns_grpo", "--set", "nft.beta=2.0"], ["nft.beta", "DiffusionNFT", "flow_grpo"]


def _case_grpo_noise_level_zero(tmp):
    return ["tiny_learns_grpo", "--set", "grpo.noise_level=0"], ["grpo.noise_level", "> 0", "0.0"]


def _sd35m_job(tmp, recipe: str, *sets: str) -> list[str]:
    """`recipe` on an SD3.5-Medium folder (as its transformer's config.json says: the folder check
    and the budget read nothing more before loading) and the tiny prompts."""
    from hpcnft.models.folders import PICKSCORE_REQUIRED, PROCESSOR_REQUIRED, SD3_REQUIRED

    sd3, pick = tmp / "sd3.5-medium", tmp / "PickScore_v1"
    for folder, required in ((sd3, SD3_REQUIRED), (pick, PICKSCORE_REQUIRED + PROCESSOR_REQUIRED)):
        for rel in required:
            path = folder / rel.split("|")[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            if "." in path.name:
                path.write_text("{}")
            else:
                path.mkdir(exist_ok=True)
    (sd3 / "transformer" / "config.json").write_text('{"_class_name": "SD3Transformer2DModel", "num_layers": 24}')
    prompts = tmp / "prompts.txt"
    prompts.write_text("a red car\na blue bird\n")
    return [recipe, "--set", f"models.sd3_dir={sd3}", "--set", f"models.pickscore_dir={pick}",
            "--set", f"models.pickscore_processor_dir={pick}", "--set", f"data.train_prompts={prompts}",
            "--set", f"data.eval_prompts={prompts}", *(x for kv in sets for x in ("--set", kv))]


def _case_recipe_over_its_memory_budget(tmp):
    from hpcnft.perf import memory

    [small] = [r for r in memory.rungs("sd35m") if r.card_gib == 24]
    return _sd35m_job(tmp, "sd35m_pickscore_80gb", "perf.memory_budget_gib=24"), \
        ["perf.memory_budget_gib = 24", "these settings measured", small.recipe, f"{small.peak_gib:.1f} GiB"]


def _case_memory_budget_below_every_measurement(tmp):
    from hpcnft.perf import memory

    smallest = min((r for r in memory.rungs("sd35m") if r.peak_gib), key=lambda r: r.card_gib)
    return _sd35m_job(tmp, "sd35m_pickscore_24gb", "perf.memory_budget_gib=16"), \
        ["perf.memory_budget_gib = 16", f"{smallest.card_gib} GiB cap", smallest.recipe, f"{smallest.peak_gib:.1f}"]


def _case_replicated_base_of_a_full_fine_tune(tmp):
    return ["--set", "perf.replicate_frozen_base=true", "--set", 'train.finetune="full"'], \
        ["perf.replicate_frozen_base", "train.finetune is 'full'"]


CASES = {
    "missing model folder": _case_missing_model_folder,
    "missing FLUX folder": _case_missing_flux_folder,
    "missing Wan folder": _case_missing_wan_folder,
    "Wan frames not 1 + 4k": _case_wan_frames_not_one_plus_four_k,
    "incomplete model folder": _case_incomplete_model_folder,
    "missing prompt file": _case_missing_prompt_file,
    "empty prompt file": _case_empty_prompt_file,
    "DrawBench copy without its column": _case_drawbench_without_its_column,
    "prompt file with a NUL byte": _case_prompt_file_with_a_nul_byte,
    "OCR prompt without quoted text": _case_ocr_prompt_without_quoted_text,
    "recipe file not UTF-8": _case_recipe_file_not_utf8,
    "recipe file a directory": _case_recipe_file_a_directory,
    "unknown recipe": _case_unknown_recipe,
    "unknown config key": _case_unknown_config_key,
    "wrong type": _case_wrong_type,
    "out of range": _case_out_of_range,
    "unknown tracker": _case_unknown_tracker,
    "run dir below a regular file": _case_run_dir_below_a_regular_file,
    "layout that does not split the samples": _case_layout_that_does_not_split_the_samples,
    "Flow-GRPO key under DiffusionNFT": _case_grpo_key_under_nft,
    "DiffusionNFT key under Flow-GRPO": _case_nft_key_under_grpo,
    "Flow-GRPO noise level of 0": _case_grpo_noise_level_zero,
    "recipe over its memory budget": _case_recipe_over_its_memory_budget,
    "memory budget below every measurement": _case_memory_budget_below_every_measurement,
    "a whole frozen base without one": _case_replicated_base_of_a_full_fine_tune,
}


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcnft", "run", *args], capture_output=True, text=True,
                          timeout=120, env=_env(tmp_path), cwd=tmp_path)


def _assert_one_line_exit_2(proc: subprocess.CompletedProcess, names: list[str]) -> None:
    out = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out
    for name in names:
        assert name in lines[0], (name, lines[0])


def _prepare_run_dir(root: Path) -> Path:
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "sentinel.bin").write_bytes(SENTINEL)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "old.log").write_text("an earlier attempt\n")
    return run_dir


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case of CASES, run concurrently (each is a fresh interpreter that mostly imports torch;
    on 2 cores this halves the wall time). case -> (process, names, run dir, snapshot before, root)."""
    from concurrent.futures import ThreadPoolExecutor

    prepared = {}
    for case, make in CASES.items():
        root = tmp_path_factory.mktemp("bad_input")
        run_dir = _prepare_run_dir(root)
        before = _snapshot(run_dir)
        args, names = make(root)
        if "--run-dir" not in args:
            args = [*args, "--run-dir", str(run_dir)]
        prepared[case] = (root, run_dir, before, args, names)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {case: pool.submit(_run, p[3], p[0]) for case, p in prepared.items()}
        return {case: (futures[case].result(), p[4], p[1], p[2], p[0]) for case, p in prepared.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, outcomes):
    proc, names, run_dir, before, root = outcomes[case]
    _assert_one_line_exit_2(proc, names)
    assert _snapshot(run_dir) == before  # same names, modes and bytes
    assert (run_dir / "sentinel.bin").read_bytes() == SENTINEL
    assert not (root / "cache").exists()  # nothing got as far as building models


def test_a_layout_refused_before_any_rank_leaves_no_run_dir(outcomes):
    root = outcomes["layout that does not split the samples"][4]
    assert not (root / "fresh").exists()


@pytest.mark.parametrize("rank,said", [(0, True), (1, False)])
def test_under_a_launcher_a_layout_that_does_not_fit_is_refused_before_the_rendezvous_said_by_rank_0(
        tmp_path, rank, said):
    """torchrun's variables for 4 ranks of which 3 train 16 samples: every rank exits 2 before
    loading anything or meeting its peers; rank 0 alone says why."""
    error_file = tmp_path / "error.json"  # where torchrun has each worker leave its failure for its summary
    env = {**_env(tmp_path), "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",  # nothing listens there
           "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--run-dir", str(tmp_path / "run"),
                           "--set", "layout.train_ranks=3"], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    if said:
        _assert_one_line_exit_2(proc, ["16 samples per step", "3 train ranks"])
    else:
        assert (proc.returncode, proc.stderr) == (2, ""), proc.stderr
    import json

    # torchrun's summary names a root-cause rank: whichever it is, it gives hpcnft's reason
    message = json.loads(error_file.read_text())["message"]
    assert message.startswith("hpcnft: rollout: 16 samples per step") and "3 train ranks" in message
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_preflight_checks_the_processor_folder_with_tiny_models(tmp_path):
    # in-process: the tiny models need no model folders, so only the processor override is checked
    from hpcnft.algo.root_config import load_config
    from hpcnft.common.errors import UsageError
    from hpcnft.run.rundir import preflight

    cfg = load_config("tiny", ["models.pickscore_processor_dir=/nonexistent"], run_dir=str(tmp_path / "run"))
    with pytest.raises(UsageError, match="models.pickscore_processor_dir"):
        preflight(cfg)


def test_bad_command_line_argument_is_one_line(tmp_path):
    proc = _run(["--steps", "abc", "--run-dir", str(tmp_path / "run")], tmp_path)
    _assert_one_line_exit_2(proc, ["--steps", "abc"])


def test_a_recipe_file_without_base_says_what_it_starts_from_and_warns_of_a_long_step_on_a_cpu(tmp_path):
    """`steps = 2` alone: the sd35m_pickscore sizes on the tiny models. Said before the preflight,
    whose refusal (a missing prompt file here) then ends the start at once."""
    recipe = tmp_path / "mine.toml"
    recipe.write_text("steps = 2\n")
    proc = _run([str(recipe), "--set", "layout.device=cpu", "--set", "data.train_prompts=/nonexistent",
                 "--run-dir", str(tmp_path / "run")], tmp_path)
    out = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 2 and "Traceback" not in out, out
    (note,) = proc.stdout.splitlines()
    assert note.startswith(f"hpcnft: recipe file {str(recipe)!r} names no base: ") and 'base = "tiny"' in note, out
    warning, error = proc.stderr.splitlines()
    assert warning.startswith("hpcnft: warning: this config runs real-size shapes (512x512, 64 samples a step) on "
                              "the tiny models on a CPU: about ") and warning.endswith('base = "tiny"?'), out
    assert "data.train_prompts" in error and not (tmp_path / "cache").exists()


NO_WANDB = "import sys; sys.modules['wandb'] = None; from hpcnft.cli import main; sys.exit(main(sys.argv[1:]))"


def test_a_tracker_whose_package_is_missing_is_refused_before_any_rank_starts(tmp_path):
    """wandb made unimportable the way Python marks a missing module (sys.modules[name] = None)."""
    run_dir = _prepare_run_dir(tmp_path)
    before = _snapshot(run_dir)
    proc = subprocess.run([sys.executable, "-c", NO_WANDB, "run", "tiny", "--run-dir", str(run_dir), "--set",
                           'logging.trackers=["tensorboard", "wandb"]'], capture_output=True, text=True,
                          timeout=120, env=_env(tmp_path), cwd=tmp_path)
    _assert_one_line_exit_2(proc, ["logging.trackers", "wandb", "pip install 'hpcnft[wandb]'"])
    assert _snapshot(run_dir) == before
    assert not (tmp_path / "cache").exists()


def test_under_a_launcher_rank_0_refuses_a_missing_tracker_package_before_the_rendezvous(tmp_path):
    """torchrun's variables, no preflight: rank 0 of 3 exits 2 with the line, without waiting for peers."""
    env = {**_env(tmp_path), "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # nothing listens there: reaching the rendezvous would fail differently
    proc = subprocess.run([sys.executable, "-c", NO_WANDB, "run", "tiny", "--run-dir", str(tmp_path / "run"),
                           "--set", 'logging.trackers=["wandb"]'], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    _assert_one_line_exit_2(proc, ["logging.trackers", "wandb", "pip install 'hpcnft[wandb]'"])
    assert not (tmp_path / "cache").exists()


def _folder_copy(tiny_models, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "sd3"
    shutil.copytree(tiny_models[0], copy)
    return copy


def test_a_model_folder_missing_a_shard_is_refused_before_any_rank_starts(tiny_models, tmp_path):
    """The index names a shard that is not there: the starting process says which, reading JSON."""
    import json

    folder = _folder_copy(tiny_models, tmp_path)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.rename(folder / "vae" / "diffusion_pytorch_model-00001-of-00002.safetensors")
    (folder / "vae" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"encoder.conv_in.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
                                        "decoder.conv_out.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}}))
    run_dir = _prepare_run_dir(tmp_path)
    before = _snapshot(run_dir)
    proc = _run(["--set", f"models.sd3_dir={folder}", "--run-dir", str(run_dir)], tmp_path)
    _assert_one_line_exit_2(proc, ["models.sd3_dir", "vae/diffusion_pytorch_model-00002-of-00002.safetensors is missing",
                                   "vae/diffusion_pytorch_model.safetensors.index.json names it"])
    assert _snapshot(run_dir) == before and not (tmp_path / "cache").exists()


def test_a_model_folder_whose_tensor_has_another_shape_is_refused_by_the_ranks_writing_nothing(tiny_models, tmp_path):
    """A config that does not make the file's tensors: the ranks build its class on the meta
    device and read the headers before the rendezvous; the run dir this start made is gone."""
    import json

    folder = _folder_copy(tiny_models, tmp_path)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooled_projection_dim": 48}))
    proc = _run(["--set", f"models.sd3_dir={folder}", "--run-dir", str(tmp_path / "fresh")], tmp_path)
    _assert_one_line_exit_2(proc, ["rank 0", "models.sd3_dir", "transformer/diffusion_pytorch_model.safetensors holds",
                                   "but transformer/config.json makes it"])
    assert not (tmp_path / "fresh").exists()
