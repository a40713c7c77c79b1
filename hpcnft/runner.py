"""The run on one rank, from start (or resume) to finish: a train rank's loop, or the reward
rank's service. Failures become one line naming the rank and its reason."""
from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from hpcnft import determinism, distributed
from hpcnft.config import Config, ConfigError
from hpcnft.launch import LaunchInfo
from hpcnft.loop import (EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, TrainRank, fail_line, hpcnft_version, log,
                         log_exception, print_err, progress_line, save_grid, seed_everything, setup_logging)
from hpcnft.models import ModelError, load_pickscore, load_sd3_pipeline, resolve_model_paths
from hpcnft.prompts import PromptFileError, PromptStream, read_prompt_file
from hpcnft.reward import PickScoreScorer
from hpcnft.reward_service import EVAL, LocalRewardClient, RemoteRewardClient, RewardServiceError, serve

BAD_INPUT = (ModelError, PromptFileError, ConfigError)


def default_run_dir(recipe: str) -> str:
    return os.path.join("runs", f"{os.path.splitext(os.path.basename(recipe))[0]}-{time.strftime('%Y%m%d-%H%M%S')}")


def agree_run_dir(cfg: Config, recipe: str, topo) -> str:
    """Every rank must write into the same run dir: rank 0's choice wins."""
    choice = [cfg.run_dir or default_run_dir(recipe)]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    return cfg.run_dir


def make_score_fn(cfg: Config, scorer: PickScoreScorer):
    """(kind, step, images, sample ids) -> scores; the prompts come from this rank's own copy
    of the prompt files, by the same rule the train ranks use."""
    stream = PromptStream(read_prompt_file(cfg.data.train_prompts, "data.train_prompts"), cfg.data.shuffle,
                          cfg.train.seed)
    eval_prompts = read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
    p, g = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt

    def score(kind: int, step: int, images: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if kind == EVAL:
            prompts = [eval_prompts[i] for i in ids]
        else:
            prompts = [stream.at((step - 1) * p + i // g) for i in ids]
        return scorer(prompts, images)

    return score


def load_scorer(cfg: Config, device: torch.device) -> PickScoreScorer:
    paths = resolve_model_paths(cfg)
    return PickScoreScorer(*load_pickscore(paths.pickscore, paths.pickscore_processor, device), device)


def comm_device(topo) -> torch.device:
    return topo.device if topo.backend == "nccl" else torch.device("cpu")


def reward_main(cfg: Config, topo) -> int:
    score_fn = make_score_fn(cfg, load_scorer(cfg, topo.device))
    log.info("reward rank %d serving train ranks %s", topo.rank, topo.clients_of(topo.rank))
    stats = serve(topo.clients_of(topo.rank), score_fn, comm_device(topo), cfg.layout.timeout_s, log)
    log.info("reward rank done: busy %.1f s, idle %.1f s", stats["busy_s"], stats["idle_s"])
    return EXIT_OK


def build_train_rank(cfg: Config, topo, group, mesh) -> TrainRank:
    from hpcnft.trainer import Policy, Trainer

    seed_everything(cfg)
    paths = resolve_model_paths(cfg)
    pipe = load_sd3_pipeline(paths.sd3, torch.float32, topo.device)
    if topo.device.type == "cuda" and cfg.train.precision != "fp32":
        dtype = torch.float16 if cfg.train.precision == "fp16" else torch.bfloat16
        for enc in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            enc.to(dtype)
    if topo.role == "colocated":
        client = LocalRewardClient(make_score_fn(cfg, load_scorer(cfg, topo.device)))
    else:
        client = RemoteRewardClient(topo.reward_rank_for(topo.rank), comm_device(topo), cfg.layout.timeout_s)
    policy = Policy(cfg, pipe.transformer, topo.device, mesh)
    trainer = Trainer(cfg, policy, group, len(topo.train_ranks))
    return TrainRank(cfg, topo, group, mesh, client, pipe, policy, trainer)


def train_main(cfg: Config, topo, group, mesh) -> int:
    from hpcnft.runfile import RunFileWriter

    tr = build_train_rank(cfg, topo, group, mesh)
    writer = None
    try:
        if topo.rank == 0:
            writer = RunFileWriter(os.path.join(cfg.run_dir, "run.h5"), cfg.to_json(), hpcnft_version())
            writer.set_topology(topo.as_attrs())
        start_step = 0
        if writer:
            writer.add_attempt({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": start_step,
                                "slurm_job_id": topo.job_id or "", "restart_count": topo.restart_count,
                                "launcher": topo.launcher, "world_size": topo.world_size})
            writer.event(start_step, "start", f"{topo.launcher} launch, world {topo.world_size}, "
                                              f"train ranks {topo.train_ranks}, reward ranks {topo.reward_ranks}")
        if cfg.eval.at_start and start_step == 0:
            m = tr.evaluate()
            if writer:
                writer.append_metrics(0, m)
        t_begin = time.perf_counter()
        for step in range(start_step + 1, cfg.steps + 1):
            metrics, ro = tr.iteration(step)
            if (cfg.eval.every and step % cfg.eval.every == 0) or (step == cfg.steps and cfg.eval.at_end):
                metrics.update(tr.evaluate())
            if writer:
                writer.append_metrics(step, metrics)
                every = cfg.logging.sample_grid_every
                if every and (step % every == 0 or step == 1):
                    save_grid(cfg.run_dir, step, ro.images, cfg.logging.sample_grid_images)
                line = progress_line(step, cfg.steps, metrics, time.perf_counter() - t_begin, start_step + 1)
                print(line, flush=True)
                log.info(line)
        tr.client.finish(cfg.steps)
        if writer:
            writer.event(cfg.steps, "done", f"finished {cfg.steps} steps")
        return EXIT_OK
    except BaseException as e:
        if writer:
            try:
                writer.event(0, "error", fail_line(topo, e))
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        if not isinstance(e, RewardServiceError):
            tr.client.report_error(fail_line(topo, e))
        raise
    finally:
        if writer:
            writer.close()


def run_rank(cfg: Config, info: LaunchInfo, recipe: str) -> int:
    device_type = "cuda" if (cfg.layout.device != "cpu" and torch.cuda.is_available()) else "cpu"
    determinism.enable(cfg.determinism.enabled, cfg.determinism.cpu_threads, device_type)
    if os.environ.get("HPCNFT_LAUNCHER") == "local":  # ranks started by our own spawner
        info = dataclasses.replace(info, launcher="local")
    topo, group, mesh = distributed.setup(cfg, info)
    agree_run_dir(cfg, recipe, topo)
    setup_logging(cfg.run_dir, topo.rank)
    log.info("rank %d of %d (%s) on %s, launcher %s", topo.rank, topo.world_size, topo.role, topo.device,
             topo.launcher)
    try:
        code = reward_main(cfg, topo) if topo.role == "reward" else train_main(cfg, topo, group, mesh)
    except BAD_INPUT as e:
        log_exception(topo, e)
        print_err(fail_line(topo, e))
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - one line out, the traceback in the rank's log
        log_exception(topo, e)
        print_err(fail_line(topo, e) + f" (traceback in {cfg.run_dir}/logs/rank{topo.rank}.log)")
        return EXIT_FAILED
    distributed.teardown()
    return code
