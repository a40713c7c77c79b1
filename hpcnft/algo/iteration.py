"""The iteration engine of a train rank: rollout (sample, decode, reward), the algorithm's train
step (algo.name's, hpcnft.algo.protocol: how a chunk is sampled and what is kept, the advantages,
the trainer) and the EMA update of pi_old; and the evaluation. It calls the algorithm and is never
called back."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcnft.algo import shared_math
from hpcnft.algo.protocol import Algorithm, RolloutModels
from hpcnft.algo.flops import count_dit_flops
from hpcnft.algo.prompts import read_prompt_file, train_stream
from hpcnft.algo.reward import term_columns, training_reward
from hpcnft.algo.root_config import Config
from hpcnft.algo.sampler import NoiseAhead, PromptEncoder, decode_to_uint8, grid_sample_ids, initial_noise
from hpcnft.algo.virtual_shards import eval_parts, rollout_parts, shard_size
from hpcnft.algo.watch import group_diversity, thumbnails, velocity_drift
from hpcnft.distributed.groups import Topology
from hpcnft.distributed.reward_service import EVAL, ROLLOUT, RewardOutage
from hpcnft.models.families import family_of
from hpcnft.perf.mfu import matmul_ceiling, mfu, span


# -- which samples a rank owns ---------------------------------------------------------
def owned_range(n: int, topo: Topology) -> range:
    """Samples are split across train ranks by global index, in contiguous blocks."""
    per = n // len(topo.train_ranks)
    i = topo.train_index
    return range(i * per, (i + 1) * per)


def chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def eval_chunks(n_prompts: int, topo: Topology, size: int) -> list[list[int]]:
    """This rank's eval prompt indices in chunks; every train rank gets the same number of
    chunks (FSDP2 forwards run in lockstep), padded with -1 for "compute and discard"."""
    t = len(topo.train_ranks)
    per = math.ceil(n_prompts / t)
    mine = list(range(topo.train_index * per, min((topo.train_index + 1) * per, n_prompts)))
    n_chunks = math.ceil(per / size)
    mine += [-1] * (n_chunks * size - len(mine))
    return chunks(mine, size)


@dataclass
class Rollout:
    x0: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    images: torch.Tensor  # uint8 [n, H, W, 3]
    rewards: torch.Tensor  # this rank's samples' training reward [n]
    term_scores: torch.Tensor  # and each training term's score [n, T]
    seconds: float
    wait_s: float
    kept: list  # per chunk, what the algorithm keeps beside the final latents (None for NFT)


class Learner:
    """What a train rank learns with: the pipeline, policy, algorithm (its trainer made), prompt
    stream and reward client."""

    def __init__(self, cfg: Config, topo: Topology, train_group, mesh, reward_client, pipe, policy,
                 algorithm: Algorithm):
        self.cfg, self.topo, self.group, self.mesh = cfg, topo, train_group, mesh
        self.client, self.pipe, self.policy = reward_client, pipe, policy
        self.algorithm, self.trainer = algorithm, algorithm.trainer
        self.stream = train_stream(cfg)
        self.eval_prompts = read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
        self.family = family_of(pipe.transformer)
        self.encoder = PromptEncoder(pipe, cfg.rollout.max_sequence_length, topo.device,
                                     cfg=cfg.rollout.guidance_scale > 1.0 and self.family.cfg_guidance,
                                     offload=cfg.perf.text_encoders == "offload")
        self._server_totals = (0.0, 0.0)
        self.noise_ahead = NoiseAhead()
        self.ceiling = matmul_ceiling(topo.device, policy.compute_dtype)
        self.latent_shape = self.family.latent_shape(pipe, cfg.rollout.height, cfg.rollout.width,
                                                     cfg.rollout.num_frames)
        self.sigmas = self.family.sigma_grid(pipe.scheduler, cfg.rollout.num_steps, self.latent_shape)
        self.eval_sigmas = self.family.sigma_grid(pipe.scheduler, cfg.eval.num_steps, self.latent_shape)
        cond = self.encoder(self.stream.for_step(1, 1))
        self.flops = count_dit_flops(policy, self.latent_shape, cond.prompt_embeds, cond.pooled,
                                     cfg.rollout.guidance_scale)
        self.models = RolloutModels(policy, self.encoder, self.sigmas, self.latent_shape, topo.device,
                                    cfg.rollout.guidance_scale, cfg.rollout.integer_timesteps)
        algorithm.bind(self.models)

    # -- rollout ---------------------------------------------------------------------------

    def rollout(self, step: int) -> Rollout:
        cfg, g = self.cfg, self.cfg.rollout.samples_per_prompt
        t0 = time.perf_counter()
        mine = list(owned_range(cfg.samples_per_step, self.topo))
        if cfg.determinism.layout_invariant:  # no sampling batch across a virtual shard
            parts = rollout_parts(mine, shard_size(cfg.samples_per_step, cfg.determinism.virtual_shards),
                                  cfg.rollout.batch_size)
        else:
            parts = chunks(mine, cfg.rollout.batch_size)
        noises = self.noise_ahead.draw(self.latent_shape, cfg.rollout.seed, step, parts, "rollout_noise",
                                       pin=self.topo.device.type == "cuda")
        self.algorithm.begin_rollout(step, parts)
        # perf.text_encoders=offload: the step's prompts in one encoder pass, not one per chunk
        self.encoder.prepare(self.stream.for_samples(step, mine, cfg.rollout.prompts_per_step, g))
        x0s, pes, pools, imgs, pending, kept = [], [], [], [], [], []
        with self.policy.rollout_weights():  # perf.rollout_fp8 (evaluation keeps its precision)
            for chunk, noise in zip(parts, noises):
                with span("rollout/sample"):
                    x0, cond, keep = self.algorithm.sample(
                        self.stream.for_samples(step, chunk, cfg.rollout.prompts_per_step, g), noise.result(), step)
                with span("rollout/decode"):
                    images = decode_to_uint8(self.pipe.vae, x0, cfg.rollout.uint8_rounding, cfg.perf.vae_decode_batch,
                                             self.family)
                with span("rollout/reward_submit"):
                    pending.append(self.client.submit(ROLLOUT, step, images, chunk))  # scored while we go on
                # What training needs stays on the train device (no copies back per micro-batch).
                x0s.append(x0.float())
                pes.append(cond.prompt_embeds)
                pools.append(cond.pooled)
                imgs.append(images)
                kept.append(keep)
        t1 = time.perf_counter()
        with span("rollout/reward_collect"):
            scores = torch.cat(self.collect_all(pending))
        t2 = time.perf_counter()
        return Rollout(torch.cat(x0s), torch.cat(pes), torch.cat(pools), torch.cat(imgs),
                       training_reward(scores, cfg), scores, t1 - t0, t2 - t1, kept)

    def collect_all(self, pending: list) -> list[torch.Tensor]:
        """The scores of every pending chunk. Where a reward term's service stayed unreachable
        (RewardOutage) on any train rank, every train rank raises it here, at the same point,
        before the collectives that would follow: together they checkpoint what they finished.
        Every chunk is collected first, so the reward traffic stays in step."""
        scores, outage = [], None
        for p in pending:
            try:
                scores.append(self.client.collect(p))
            except RewardOutage as e:
                outage = outage or e
        if self.group is not None:
            flag = torch.tensor([float(outage is not None)], device=self.topo.comm_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if flag.item():  # every rank gives the same reason: the first rank's that had one
                reasons: list = [None] * len(self.topo.train_ranks)
                dist.all_gather_object(reasons, str(outage) if outage else "", group=self.group)
                outage = RewardOutage(next(r for r in reasons if r))
        if outage is not None:
            raise outage
        return scores

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """All train ranks' values, in global sample order."""
        if self.group is None:
            return local
        local = local.to(self.topo.comm_device).contiguous()
        parts = [torch.empty_like(local) for _ in self.topo.train_ranks]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).cpu()

    def grid_images(self, step: int, images: torch.Tensor, n: int) -> tuple[torch.Tensor, list[str]] | None:
        """Up to n rollout images for the sample grid, an equal share from every train rank, on
        train rank 0 (None on the others), with each image's prompt. Every train rank must call
        it. Only the shares travel, and only on grid steps; nothing random is drawn."""
        ranks = len(self.topo.train_ranks)
        share = min(len(images), math.ceil(n / ranks))
        local = images[:share].contiguous()
        dst = self.topo.train_ranks[0]
        if self.group is None:
            parts = [local]
        else:
            local = local.to(self.topo.comm_device)
            parts = [torch.empty_like(local) for _ in range(ranks)] if self.topo.rank == dst else None
            dist.gather(local, parts, dst=dst, group=self.group)
        if self.topo.rank != dst:
            return None
        prompts = self.stream.for_step(step, self.cfg.rollout.prompts_per_step)
        g = self.cfg.rollout.samples_per_prompt
        indices = grid_sample_ids(self.cfg.samples_per_step, ranks, n)
        return torch.cat([p.cpu() for p in parts])[:n], [prompts[i // g] for i in indices]

    def step_prompts(self, step: int) -> list[str]:
        """The prompt text of each of the step's samples, in global sample order."""
        r = self.cfg.rollout
        return self.stream.for_samples(step, range(self.cfg.samples_per_step), r.prompts_per_step,
                                       r.samples_per_prompt)

    # -- one iteration ---------------------------------------------------------------------
    def iteration(self, step: int) -> tuple[dict[str, float], Rollout]:
        cfg, algorithm = self.cfg, self.algorithm
        t_start = time.perf_counter()
        mine = owned_range(cfg.samples_per_step, self.topo)
        ro = self.rollout(step)
        rewards = self.gather(ro.rewards.to(torch.float32))
        diversity = group_diversity(self.gather(thumbnails(ro.images)), cfg.rollout.samples_per_prompt) \
            if cfg.watch.diversity else None
        k = cfg.trained_steps
        batch = algorithm.train_batch(step, ro, rewards, self.step_prompts(step), mine)
        t_train = time.perf_counter()
        with span("train/step"):
            metrics = self.trainer.step(batch, self.sigmas, step)
        decay = algorithm.old_policy_decay(step)
        with span("train/ema"):  # pi_old's (the evaluation EMA follows each optimizer step: train_base)
            self.policy.ema_update(decay)
        t_end = time.perf_counter()
        metrics.update({f"rollout/reward/{k}": v for k, v in shared_math.reward_stats(rewards).items()})
        if cfg.reward.terms:  # configured terms: each one's plain score beside the training reward
            scores = self.gather(ro.term_scores).to(torch.float64)
            for j, term in enumerate(term_columns(cfg)["rollout"]):
                metrics[f"rollout/reward/{term.name}/mean"] = scores[:, j].mean().item()
                metrics[f"rollout/reward/{term.name}/std"] = scores[:, j].std(unbiased=False).item()
        metrics["ema/decay"] = decay
        if diversity is not None:
            metrics["rollout/diversity"] = diversity
        busy, idle = self.client.server_busy_s, self.client.server_idle_s  # the reward rank's totals
        metrics.update({
            "perf/rollout_s": ro.seconds, "perf/reward_s": busy - self._server_totals[0],
            "perf/reward_wait_s": idle - self._server_totals[1], "perf/train_s": t_end - t_train,
            "perf/iteration_s": t_end - t_start,
            "perf/images_per_s": cfg.samples_per_step / max(ro.seconds + ro.wait_s, 1e-9),
            "perf/mfu_rollout": mfu(self.flops.rollout_forward * len(mine) * cfg.rollout.num_steps
                                    * (2 if self.encoder.cfg else 1), ro.seconds, self.ceiling),
            "perf/mfu_train": mfu(algorithm.pair_flops(self.flops) * len(mine) * k, t_end - t_train, self.ceiling),
        })
        self._server_totals = (busy, idle)
        return metrics, ro

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        n = cfg.eval.num_prompts or len(self.eval_prompts)
        n = min(n, len(self.eval_prompts))
        pending = []  # (prompt ids, request)
        if cfg.determinism.layout_invariant:  # chunks cut from the global prompt list
            parts = eval_parts(n, cfg.rollout.batch_size, self.topo.train_index, len(self.topo.train_ranks))
        else:
            parts = eval_chunks(n, self.topo, cfg.rollout.batch_size)
        self.encoder.prepare([self.eval_prompts[max(i, 0)] for chunk in parts for i in chunk])
        drifts, norm = [], None  # watch.drift_sigmas: (prompt id, drift) of this rank's first chunk
        # (every rank computes its own, as FSDP2's forwards run in lockstep; train rank 0's counts)
        with self.policy.eval_weights():
            for c, chunk in enumerate(parts):
                real = [i for i in chunk if i >= 0]
                ids = [i if i >= 0 else 0 for i in chunk]
                noise = initial_noise(self.latent_shape, cfg.eval.seed, 0, ids, "eval_noise")
                x0, cond = self.models.generate([self.eval_prompts[i] for i in ids], self.eval_sigmas, noise, "euler")
                if c == 0 and cfg.watch.drift_sigmas:  # every rank alike: FSDP2's forwards run in lockstep
                    drifts = list(zip(real, self.drift(x0, noise, cond).tolist()))
                    norm = self.adapter_norm() if cfg.train.finetune == "lora" else None
                if real:
                    images = decode_to_uint8(self.pipe.vae, x0[:len(real)], cfg.rollout.uint8_rounding,
                                             cfg.perf.vae_decode_batch, self.family)
                    pending.append((real, self.client.submit(EVAL, 0, images, real)))
        collected = self.collect_all([p for _, p in pending])
        local = [(i, row) for (ids, _), got in zip(pending, collected) for i, row in zip(ids, got.tolist())]
        everyone = [None] * len(self.topo.train_ranks) if self.group is not None else None
        if self.group is not None:
            dist.all_gather_object(everyone, local, group=self.group)
            local = [x for part in everyone for x in part]
        scores = torch.tensor([row for _, row in sorted(local)], dtype=torch.float64)  # [prompts, terms]
        out = {}
        for j, term in enumerate(term_columns(cfg)["eval"]):
            out[f"eval/{term.name}_mean"] = scores[:, j].mean().item()
            out[f"eval/{term.name}_std"] = scores[:, j].std(unbiased=False).item()
        if cfg.watch.drift_sigmas:  # train rank 0's first chunk: the same prompts whatever the layout
            if self.group is not None:
                box = [drifts]
                dist.broadcast_object_list(box, src=self.topo.train_ranks[0], group=self.group)
                drifts = box[0]
            out["eval/drift"] = torch.tensor([d for _, d in sorted(drifts)], dtype=torch.float64).mean().item()
            if norm is not None:
                out["eval/lora_norm"] = norm
        return out

    def drift(self, x0: torch.Tensor, noise: torch.Tensor, cond) -> torch.Tensor:
        """Per sample, the mean over watch.drift_sigmas of the squared difference between the
        evaluated policy's velocity and the base's (adapters off) at x_sigma = sigma noise +
        (1 - sigma) x0: how far the policy has moved, on the evaluation's own images and noise."""
        from hpcnft.algo.sampler import velocity

        policy, cfg, dev = self.policy, self.cfg, self.policy.device
        total = torch.zeros(x0.shape[0], dtype=torch.float64)
        for s in cfg.watch.drift_sigmas:
            sig = torch.full((x0.shape[0],), s, dtype=torch.float32, device=dev)
            x = s * noise.to(dev, x0.dtype) + (1 - s) * x0
            with torch.no_grad(), policy.autocast():
                v = [velocity(policy.transformer, x, sig, cond.prompt_embeds, cond.pooled, policy.compute_dtype,
                              self.models.integer_timesteps, cfg.rollout.guidance_scale)]
                with policy.base_weights():
                    v.append(velocity(policy.transformer, x, sig, cond.prompt_embeds, cond.pooled,
                                      policy.compute_dtype, self.models.integer_timesteps, cfg.rollout.guidance_scale))
            total += velocity_drift(*v).cpu()
        return total / len(cfg.watch.drift_sigmas)

    def adapter_norm(self) -> float:
        """The evaluated adapters' L2 norm over every trained parameter (gathered whole where FSDP2
        shards them: every train rank takes part)."""
        from torch.distributed.tensor import DTensor

        squares = torch.zeros((), dtype=torch.float64)
        for p in self.policy.trainable:
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            squares += whole.detach().to(torch.float64).pow(2).sum().cpu()
        return squares.sqrt().item()
