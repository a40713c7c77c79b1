"""A train rank's parts wired together: the base model loaded (the host's train ranks taking
turns where their copies of the base would not fit at once), the policy, the reward client (the reward
rank's, or scoring in this process), the algorithm's trainer, and the Learner over them."""
from __future__ import annotations

import time

import torch

from hpcnft.algo.registry import algorithm_for
from hpcnft.algo.iteration import Learner
from hpcnft.algo.policy import Policy, read_dtype
from hpcnft.algo.reward import load_terms, make_score_fn, reply_columns
from hpcnft.algo.root_config import Config
from hpcnft.common import determinism
from hpcnft.distributed.reward_images import image_channel
from hpcnft.distributed.reward_service import LocalRewardClient, RemoteRewardClient
from hpcnft.models.load_turns import load_turn
from hpcnft.models.loading import base_family, resolve_model_paths
from hpcnft.perf import levers


def build_train_rank(cfg: Config, topo, group, mesh, say=lambda text: None) -> Learner:
    determinism.seed_globals(cfg.train.seed)
    paths = resolve_model_paths(cfg)
    family = base_family(cfg)
    offload = cfg.perf.text_encoders == "offload"
    # On a GPU the text encoders are read straight into the compute dtype (the same values as a
    # cast of their fp32 copy); so is a LoRA run's DiT, on any device (policy.read_dtype; its
    # adapters are made in fp32 whatever the base's dtype).
    half = topo.device.type == "cuda" and cfg.train.precision != "fp32"
    encoders_dtype = (torch.float16 if cfg.train.precision == "fp16" else torch.bfloat16) if half else None
    with load_turn(cfg.run_dir, take_turns(cfg, topo, paths.base, say)):
        t0 = time.perf_counter()
        pipe = family.load(paths.base, torch.float32, topo.device, torch.device("cpu") if offload else None,
                           encoders_dtype, read_dtype(cfg))
        say(f"pipeline read in {time.perf_counter() - t0:.1f} s (its DiT {dit_size(pipe.transformer)}, in host memory)")
        t0 = time.perf_counter()
        policy = Policy(cfg, pipe.transformer, topo.device, mesh)
        say(f"DiT made trainable and moved to {topo.device.type} in {time.perf_counter() - t0:.1f} s")
    levers.prepare_vae(pipe.vae, cfg)  # perf.vae_dtype, vae_channels_last, compile_vae, cudnn_benchmark
    if topo.role == "colocated":
        client = LocalRewardClient(make_score_fn(cfg, load_terms(cfg, topo.device)),
                                   overlap=cfg.perf.overlap_reward)  # perf.overlap_reward
    else:
        client = RemoteRewardClient(topo.reward_rank_for(topo.rank), topo.host_group, cfg.layout.timeout_s,
                                    reply_columns(cfg), image_channel(topo))
    algorithm = algorithm_for(cfg)  # algo.name's sampler, train batch and trainer
    algorithm.make_trainer(policy, group, len(topo.train_ranks))
    return Learner(cfg, topo, group, mesh, client, pipe, policy, algorithm)


def dit_size(transformer) -> str:
    """Its parameters' bytes, and their dtype where they share one (the user's check of what was read)."""
    params = list(transformer.parameters())
    n = sum(p.numel() * p.element_size() for p in params)
    dtypes = {str(p.dtype).removeprefix("torch.") for p in params}
    size = f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    return size + (f" in {dtypes.pop()}" if len(dtypes) == 1 else "")


def take_turns(cfg: Config, topo, base: str, say) -> bool:
    """Whether this host's train ranks load their base transformer one at a time
    (layout.stagger_loads); rank 0 says so when they do."""
    import psutil

    from hpcnft.models.load_turns import read_bytes, turns_needed

    host = topo.hosts[topo.rank] if topo.hosts else ""
    peers = sum(1 for r in topo.train_ranks if not topo.hosts or topo.hosts[r] == host)
    if peers < 2 or cfg.layout.stagger_loads == "never":
        return False
    dtype = read_dtype(cfg)
    per_rank, available = read_bytes(base, dtype.itemsize), psutil.virtual_memory().available
    take = turns_needed(cfg.layout.stagger_loads, per_rank, peers, available)
    if take:
        say(f"the train ranks of a host load the base transformer one at a time ({peers} x "
            f"{per_rank / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} beside {available / 2**30:.0f} GiB "
            f"available; layout.stagger_loads)")
    return take
