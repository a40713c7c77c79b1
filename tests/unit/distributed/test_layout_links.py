"""The layout's plumbing that the GPU tests run for real: the reward traffic on a host group,
answered per train rank in the order the requests come, the terms' warnings with the scores,
emulated hosts for several NCCL ranks on one GPU, IPv6 rendezvous addresses, and native stderr
kept out of the terminal."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.distributed.groups import (Topology, emulate_host, group_backends, pair_groups, resolve_backend,
                                       resolve_transport)
from hpcnft.distributed.launch import LaunchInfo
from hpcnft.distributed.reward_images import DeviceImages
from hpcnft.distributed.reward_service import EVAL, ROLLOUT, RemoteRewardClient, serve


COLUMNS = {ROLLOUT: 2, EVAL: 1}  # two training terms; evaluation scores one


def _score(kind, step, images, ids):
    """Scores that name their sample, step, term and what the images hold: [n, COLUMNS[kind]].
    An evaluation chunk gives a warning naming its samples, as a term does of an image it could
    not read."""
    from hpcnft.common.term_warnings import warn

    if kind == EVAL:
        warn(f"could not read sample {ids[0]}")
    base = torch.tensor(ids, dtype=torch.float32) * 1000 + step * 10 + images.float().mean(dim=(1, 2, 3)) + kind
    return torch.stack([base + 0.5 * term for term in range(COLUMNS[kind])], dim=1)


def _service_rank(rank: int, port: int, results, channel: str) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timeout)
    host = dist.new_group(backend="gloo")  # the host group a NCCL job makes
    train = dist.new_group([0, 1])
    images_on = None  # layout.reward_transport=gloo: the images with the requests
    if channel == "pairs":  # =nccl's logic: the images on a communicator per pair (gloo on a CPU)
        topo = Topology(rank, 3, rank, [0, 1], [2], "local", "gloo", torch.device("cpu"))
        images_on = DeviceImages(pair_groups(topo, timeout, backend="gloo"), torch.device("cpu"))
        images_on.connect([0, 1], rank)
    if rank == 2:
        results.put((2, serve([0, 1], host, _score, columns=COLUMNS, images=images_on)))
    else:
        client = RemoteRewardClient(2, host, 60.0, COLUMNS, images_on)
        if rank == 1:  # sends nothing until rank 0 has all its scores
            dist.barrier(group=train)
        images = torch.full((3, 4, 4, 3), 7 * (rank + 1), dtype=torch.uint8)
        pending = [client.submit(ROLLOUT, step, images, [rank * 3 + i for i in range(3)]) for step in (1, 2)]
        pending.append(client.submit(EVAL, 0, images[:1], [rank]))
        scores = [client.collect(p).tolist() for p in pending]
        if rank == 0:
            dist.barrier(group=train)
        client.finish(2)
        results.put((rank, (scores, client.take_warnings(), client.take_warnings())))
    dist.destroy_process_group()


@pytest.mark.parametrize("channel", ["host", "pairs"])
def test_each_train_rank_gets_its_own_scores_whatever_the_other_does(channel):
    """Rank 1 sends nothing until rank 0 has every score: a reward rank that waited on rank 1's
    channel in a fixed turn (a receive posted before its request) would never answer rank 0."""
    import torch.multiprocessing as mp

    from hpcnft.distributed.spawner import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_service_rank, args=(r, port, results, channel)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    for rank in (0, 1):
        images = torch.full((3, 4, 4, 3), 7 * (rank + 1), dtype=torch.uint8)
        want = [_score(ROLLOUT, step, images, [rank * 3 + i for i in range(3)]).tolist() for step in (1, 2)]
        want.append(_score(EVAL, 0, images[:1], [rank]).tolist())
        scores, warnings, then = got[rank]
        assert scores == want
        assert warnings == [f"could not read sample {rank}"] and then == []  # its own chunk's, taken once
    assert got[2]["preempted"] is False


@pytest.mark.parametrize("train,reward", [(2, 1), (4, 1), (2, 2), (7, 1), (6, 2)])
def test_every_train_rank_has_exactly_one_reward_rank(train, reward):
    topo = Topology(0, train + reward, 0, list(range(train)), list(range(train, train + reward)), "local", "gloo",
                    torch.device("cpu"))
    clients = [c for r in topo.reward_ranks for c in topo.clients_of(r)]
    assert sorted(clients) == topo.train_ranks
    loads = [len(topo.clients_of(r)) for r in topo.reward_ranks]
    assert max(loads) - min(loads) <= 1  # spread evenly


def test_emulated_hosts_are_distinct_per_rank():
    envs = [{}, {}, {}]
    for rank, env in enumerate(envs):
        emulate_host(rank, env)
    assert len({env["NCCL_HOSTID"] for env in envs}) == 3


@pytest.mark.parametrize("key", ["layout.emulate_hosts", "layout.reward_transport"])
@pytest.mark.parametrize("without", ["layout.backend=gloo", "layout.device=cpu"])
def test_what_needs_nccl_is_refused_by_the_config_without_it(key, without):
    on = "true" if key == "layout.emulate_hosts" else "nccl"
    with pytest.raises(ConfigError, match=key):
        load_config("tiny", [f"{key}={on}", without])


def test_emulated_hosts_on_a_cpu_device_are_refused_when_the_backend_is_chosen():
    cfg = load_config("tiny", ["layout.emulate_hosts=true"])  # auto: gloo on a CPU
    with pytest.raises(ConfigError, match="layout.emulate_hosts.*gloo on cpu"):
        resolve_backend(cfg, torch.device("cpu"))
    assert resolve_backend(cfg, torch.device("cuda", 0)) == "nccl"


def test_cpu_offloaded_shards_give_an_nccl_job_gloo_for_its_cpu_tensors():
    offload = load_config("tiny", ["perf.fsdp_cpu_offload=true"])
    assert group_backends("nccl", offload) == "cuda:nccl,cpu:gloo"
    assert group_backends("gloo", offload) == "gloo"
    assert group_backends("nccl", load_config("tiny")) == "nccl"


def without_launcher() -> dict:
    """This environment less any launcher's variables (CI runs inside a Slurm allocation), so
    that `run` spawns the ranks itself and checks its input first."""
    prefixes = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_", "TORCHELASTIC_", "SUBMITIT_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HPCNFT_LAUNCHER")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_run_refuses_emulated_hosts_without_a_gpu_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", "1", "--run-dir",
                        str(tmp_path / "run"), "--set", "layout.emulate_hosts=true"],
                       capture_output=True, text=True, timeout=120, env=without_launcher())
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [  # said once, by the ranks, which alone import torch to know
        "hpcnft: layout.emulate_hosts: lets NCCL ranks share a GPU; this job's backend is gloo on cpu"]
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("addr,endpoint", [("::1", "[::1]:29500"), ("fe80::1%eth0", "[fe80::1%eth0]:29500"),
                                           ("10.0.0.7", "10.0.0.7:29500"), ("node01", "node01:29500")])
def test_the_rendezvous_endpoint_brackets_ipv6(addr, endpoint):
    info = LaunchInfo("torchrun", 0, 1, 0, addr, 29500, None, 0, 0)
    assert info.endpoint == endpoint
    assert info.init_method == f"tcp://{endpoint}"


def test_native_stderr_goes_to_the_rank_log_and_hpcnft_lines_to_the_terminal(tmp_path):
    program = textwrap.dedent(f"""
        import os
        from hpcnft.run.output import print_err, restore_stderr, setup_logging
        setup_logging({str(tmp_path)!r}, 3)
        os.write(2, b"[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout\\n")
        print_err("rank 3 (reward): RewardServiceError: lost the connection")
        restore_stderr()  # the rank's run is over: the process's stderr is the terminal again
        os.write(2, b"after the run\\n")
    """)
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "hpcnft: rank 3 (reward): RewardServiceError: lost the connection\nafter the run\n"
    log = (tmp_path / "logs" / "rank3.log").read_text()
    assert "Watchdog caught collective operation timeout" in log


def test_a_rank_failing_on_nccl_names_the_reason_not_the_source_line():
    from types import SimpleNamespace

    from hpcnft.run.output import fail_line

    e = RuntimeError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3780, remote process "
                     "exited or there was a network error, NCCL version 2.28.9\nncclRemoteError: ...")
    assert fail_line(SimpleNamespace(rank=1, role="train"), e) == (
        "rank 1 (train): RuntimeError: NCCL error: remote process exited or there was a network error, "
        "NCCL version 2.28.9")


def test_a_chunks_warnings_fit_one_reply_and_say_how_many_did_not():
    from hpcnft.distributed.reward_service import MSG_BYTES, warnings_msg

    assert warnings_msg([]) == "" and warnings_msg(["a", "b"]) == "a\nb"
    many = [f"warning {i}: " + "x" * 280 for i in range(6)]
    text = warnings_msg(many)
    assert len(text.encode()) <= MSG_BYTES
    assert text.split("\n")[:3] == many[:3] and text.endswith("... and 3 more (the reward rank's log has every one)")


def test_images_over_nccl_are_refused_where_the_backend_is_gloo_and_auto_is_gloo():
    cfg = load_config("tiny", ["layout.reward_transport=nccl"])  # the device auto: a CPU here
    with pytest.raises(ConfigError, match="layout.reward_transport.*gloo on the CPU"):
        resolve_transport(cfg, resolve_backend(cfg, torch.device("cpu")))
    assert resolve_transport(cfg, "nccl") == "nccl"
    assert resolve_transport(load_config("tiny", []), "nccl") == "gloo"
