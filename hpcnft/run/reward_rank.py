"""The reward rank's run: load the reward terms, restore its RNG state from the checkpoint, and serve
the train ranks' score requests until they finish or the job is preempted."""
from __future__ import annotations


from hpcnft.algo.reward import load_terms, make_score_fn, reply_columns
from hpcnft.algo.root_config import Config
from hpcnft.common import collector, determinism
from hpcnft.common.errors import EXIT_OK, EXIT_PREEMPTED, EXIT_UNAVAILABLE
from hpcnft.distributed.preempt import PreemptFlag
from hpcnft.distributed.reward_images import image_channel
from hpcnft.distributed.reward_service import serve
from hpcnft.io.checkpointer import restore_rank_rng, snapshot_rank_rng
from hpcnft.run.failures import FailureClaim
from hpcnft.run.output import log
from hpcnft.run.resume import ResumePlan


def reward_main(cfg: Config, topo, flag: PreemptFlag, plan: ResumePlan) -> int:
    # Seeded as the train ranks are: the RNG states this rank snapshots into checkpoints and
    # run.h5 are then the same in every run of a config, as theirs are.
    determinism.seed_globals(cfg.train.seed)
    score_fn = make_score_fn(cfg, load_terms(cfg, topo.device))
    collector.settle()
    for text in plan.warnings:
        log.warning(text)
    if plan.checkpoint is not None:  # the train ranks' checkpoint
        restore_rank_rng(plan.checkpoint[1], topo.rank)

    def snapshot(step: int) -> None:  # into the checkpoint the train ranks are writing
        snapshot_rank_rng(cfg.run_dir, step, topo.rank)

    log.info("reward rank %d serving train ranks %s", topo.rank, topo.clients_of(topo.rank))
    stats = serve(topo.clients_of(topo.rank), topo.host_group, score_fn, snapshot, flag,
                  reply_columns(cfg), on_failure=lambda: FailureClaim(cfg.run_dir).claim(topo.rank),
                  images=image_channel(topo))
    log.info("reward rank done: busy %.1f s, idle %.1f s", stats["busy_s"], stats["idle_s"])
    if stats["outage"]:  # the train ranks checkpointed what they finished and stopped
        return EXIT_UNAVAILABLE
    return EXIT_PREEMPTED if stats["preempted"] else EXIT_OK
