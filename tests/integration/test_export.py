"""`hpcnft export` writes what diffusers loads, and the loaded weights reproduce the policy: for
each base-model family, its own diffusers pipeline (StableDiffusion3Pipeline, FluxPipeline,
QwenImagePipeline, WanPipeline) with
`load_lora_weights`; the evaluation EMA (eval.policy="ema", the default --policy of such a run)
reproduces the run's eval metric. An existing OUT is refused without --force, replaced only
whole with it, and a failed export leaves nothing behind."""
from __future__ import annotations

import os

import diffusers
import pytest
import torch
from safetensors.torch import load_file

from hardening_tools import small_tmpfs
from jobs import hpcnft
from hpcnft.algo import shared_math
from hpcnft.algo.prompts import PromptStream, read_prompt_file
from hpcnft.algo.reward import pool_frames
from hpcnft.algo.root_config import load_config
from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, initial_noise, null_autocast
from hpcnft.io.runfile import read_run
from hpcnft.models.loading import base_family, load_pickscore, resolve_model_paths
from hpcnft.rewards.pickscore import PickScoreScorer


class Sampler:
    """The family's plain diffusers pipeline with the exported adapters (`load_lora_weights`) and
    PickScore, sampling as the job does: the family's sigma grid, and its guidance (FLUX.1-dev
    embeds rollout.guidance_scale in its one pass; Qwen-Image's true CFG is renormalised)."""

    def __init__(self, recipe: str, lora_dir: str):
        torch.set_num_threads(1)  # the run's determinism.cpu_threads
        self.cfg, cpu = load_config(recipe), torch.device("cpu")
        r, self.family, paths = self.cfg.rollout, base_family(self.cfg), resolve_model_paths(self.cfg)
        self.pipe = self.family.load(paths.base, torch.float32, cpu)
        assert isinstance(self.pipe, getattr(diffusers, self.family.pipeline_class))
        self.pipe.load_lora_weights(lora_dir)
        self.scorer = PickScoreScorer(*load_pickscore(paths.pickscore, paths.pickscore_processor, cpu), cpu)
        self.encode = PromptEncoder(self.pipe, r.max_sequence_length, cpu,
                                    cfg=r.guidance_scale > 1.0 and self.family.cfg_guidance)
        self.latent_shape = self.family.latent_shape(self.pipe, r.height, r.width, r.num_frames)

    def scores(self, texts: list[str], noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        sigmas = self.family.sigma_grid(self.pipe.scheduler, num_steps, self.latent_shape)
        x0 = euler_sample(self.pipe.transformer, noise, sigmas, self.encode(texts), self.cfg.rollout.guidance_scale,
                          torch.float32, null_autocast)
        images = decode_to_uint8(self.pipe.vae, x0, family=self.family)
        if images.dim() == 5:  # a video's frames, scored each and pooled as the reward rank does
            n, f = images.shape[:2]
            frame_texts = [t for t in texts for _ in range(f)]
            frame_scores = self.scorer(frame_texts, images.flatten(0, 1)).reshape(n, f)
            return pool_frames(frame_scores, self.cfg.reward.frame_pooling)
        return self.scorer(texts, images)


def rollout_reward_with(recipe: str, lora_dir: str, step: int) -> float:
    """Step `step`'s rollout of `recipe` with the exported adapters, in the run's chunks."""
    s = Sampler(recipe, lora_dir)
    r = s.cfg.rollout
    prompts = PromptStream(read_prompt_file(s.cfg.data.train_prompts, "p"), False, 0).for_step(step, r.prompts_per_step)
    scores = []
    for start in range(0, r.prompts_per_step * r.samples_per_prompt, r.batch_size):
        ids = list(range(start, start + r.batch_size))
        texts = [prompts[i // r.samples_per_prompt] for i in ids]
        scores.append(s.scores(texts, initial_noise(s.latent_shape, r.seed, step, ids, "rollout_noise"), r.num_steps))
    return shared_math.reward_stats(torch.cat(scores))["raw_mean"]


def eval_pickscore_with(recipe: str, lora_dir: str) -> float:
    """The evaluation of `recipe` (its eval prompts, seed and steps, Euler) with the exported
    adapters, in the chunks of the run's two train ranks."""
    s = Sampler(recipe, lora_dir)
    prompts = read_prompt_file(s.cfg.data.eval_prompts, "p")[:s.cfg.eval.num_prompts]
    scores = []
    for start in range(0, len(prompts), s.cfg.rollout.batch_size):
        ids = list(range(start, min(start + s.cfg.rollout.batch_size, len(prompts))))
        noise = initial_noise(s.latent_shape, s.cfg.eval.seed, 0, ids, "eval_noise")
        scores.append(s.scores([prompts[i] for i in ids], noise, s.cfg.eval.num_steps))
    return torch.tensor(torch.cat(scores).tolist(), dtype=torch.float64).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny", "tiny_flux", "tiny_qwen_image", "tiny_wan"])
def test_exported_old_policy_reproduces_the_next_rollout(recipe, request, tmp_path):
    """From the session's 3-step runs of each family, their checkpoint after step 2."""
    run_dir = request.getfixturevalue("tiny_run").run_dir if recipe == "tiny" else \
        request.getfixturevalue(f"{recipe}_run")
    out = str(tmp_path / "lora")
    r = hpcnft("export", run_dir, out, "--step", "2", "--policy", "old")
    assert "step 2" in r.stdout
    assert "torch.distributed is disabled" not in r.stderr  # one process without a group is by design
    # the rollout of step 3 is sampled by the old policy as it stood after step 2
    expected = read_run(run_dir).metrics["rollout/reward/raw_mean"][2, 1]
    assert rollout_reward_with(recipe, out, 3) == expected


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    r = hpcnft("export", str(tmp_path), str(tmp_path / "out"), check=False)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_evaluation_ema_is_the_default_export_of_a_run_that_evaluates_it(tiny_ema_run, tmp_path):
    """A run with eval.policy="ema": `hpcnft export` without --policy writes the evaluation EMA of
    theta, whose adapters reproduce the run's end-of-run eval/pickscore_mean bit for bit."""
    out = str(tmp_path / "ema")
    r = hpcnft("export", tiny_ema_run, out)
    assert "exported the ema policy's LoRA adapters" in r.stdout and "the default --policy" in r.stdout
    (step, expected), = read_run(tiny_ema_run).metrics["eval/pickscore_mean"].tolist()
    assert step == 2.0 and eval_pickscore_with("tiny", out) == expected
    old = str(tmp_path / "old")
    hpcnft("export", tiny_ema_run, old, "--policy", "old")
    ema_weights, old_weights = (load_file(os.path.join(d, "pytorch_lora_weights.safetensors")) for d in (out, old))
    assert ema_weights.keys() == old_weights.keys()
    assert any(not torch.equal(ema_weights[k], old_weights[k]) for k in ema_weights)


@pytest.mark.slow
def test_a_run_without_the_evaluation_ema_refuses_policy_ema_in_one_line(tiny_run, tmp_path):
    out = tmp_path / "ema"
    r = hpcnft("export", tiny_run.run_dir, str(out), "--policy", "ema", check=False)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no ema policy" in r.stderr and "eval.policy is 'old'" in r.stderr and "--policy old or trained" in r.stderr
    assert not out.exists()


def lora_file(folder) -> str:
    return os.path.join(folder, "pytorch_lora_weights.safetensors")


@pytest.mark.slow
def test_an_existing_folder_is_refused_without_force_and_replaced_whole_with_it(tiny_run, tmp_path):
    out = tmp_path / "lora"
    out.mkdir()
    with open(lora_file(out), "wb") as f:
        f.write(b"an earlier export")
    r = hpcnft("export", tiny_run.run_dir, str(out), check=False)
    assert r.returncode == 2
    assert r.stderr == f"hpcnft export: error: {out}: already exists; pass --force to replace it\n"
    assert os.listdir(out) == ["pytorch_lora_weights.safetensors"]
    assert open(lora_file(out), "rb").read() == b"an earlier export"
    # --force replaces only what an export writes: a folder holding anything else stays as it is
    (out / "notes.txt").write_text("mine")
    r = hpcnft("export", tiny_run.run_dir, str(out), "--force", check=False)
    assert r.returncode == 2 and "'notes.txt', which no export writes" in r.stderr and len(r.stderr.splitlines()) == 1
    assert sorted(os.listdir(out)) == ["notes.txt", "pytorch_lora_weights.safetensors"]
    (out / "notes.txt").unlink()
    r = hpcnft("export", tiny_run.run_dir, str(out), "--force", "--step", "2", "--policy", "old")
    assert "(replacing the earlier export)" in r.stdout
    assert os.listdir(out) == ["pytorch_lora_weights.safetensors"] and load_file(lora_file(out))
    assert os.listdir(tmp_path) == ["lora"]  # nothing left beside it


@pytest.mark.slow
def test_a_failed_export_leaves_no_folder(tiny_run, tmp_path):
    """A file system too small for the adapters: one line, no OUT, nothing beside it."""
    disk = str(tmp_path / "disk")
    with small_tmpfs(disk, "16k"):
        out = os.path.join(disk, "lora")
        r = hpcnft("export", tiny_run.run_dir, out, check=False)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{out}: cannot write the export" in r.stderr and "nothing written" in r.stderr
        assert os.listdir(disk) == []
