"""The layout's plumbing that the GPU tests run for real: one process group per train/reward
pair, how request headers travel per backend, emulated hosts for several NCCL ranks on one GPU,
IPv6 rendezvous addresses, and native stderr kept out of the terminal."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hpcnft.config import ConfigError, load_config
from hpcnft.distributed import Topology, emulate_host, resolve_backend
from hpcnft.launch import LaunchInfo
from hpcnft.reward_service import Link


def test_nccl_links_carry_headers_on_the_pair_group_and_gloo_on_the_world():
    pair = object()
    nccl, gloo = Link.between(2, pair, "nccl"), Link.between(2, pair, "gloo")
    assert nccl.group is pair and nccl.header_group is pair  # polled per pair: no head-of-line blocking
    assert gloo.group is pair and gloo.header_group is None  # any-source receive on the world group


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


@pytest.mark.parametrize("over", [["layout.emulate_hosts=true", "layout.backend=gloo"],
                                  ["layout.emulate_hosts=true", "layout.device=cpu"]])
def test_emulated_hosts_without_nccl_are_refused_by_the_config(over):
    with pytest.raises(ConfigError, match="layout.emulate_hosts"):
        load_config("tiny", over)


def test_emulated_hosts_on_a_cpu_device_are_refused_when_the_backend_is_chosen():
    cfg = load_config("tiny", ["layout.emulate_hosts=true"])  # auto: gloo on a CPU
    with pytest.raises(ConfigError, match="layout.emulate_hosts.*gloo on cpu"):
        resolve_backend(cfg, torch.device("cpu"))
    assert resolve_backend(cfg, torch.device("cuda", 0)) == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_run_refuses_emulated_hosts_without_a_gpu_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", "1", "--run-dir",
                        str(tmp_path / "run"), "--set", "layout.emulate_hosts=true"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "hpcnft run: error: layout.emulate_hosts: lets NCCL ranks share a GPU; this job's backend is gloo on cpu"]
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
        from hpcnft.loop import print_err, setup_logging
        setup_logging({str(tmp_path)!r}, 3)
        os.write(2, b"[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout\\n")
        print_err("rank 3 (reward): RewardServiceError: lost the connection")
    """)
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "hpcnft: rank 3 (reward): RewardServiceError: lost the connection\n"
    log = (tmp_path / "logs" / "rank3.log").read_text()
    assert "Watchdog caught collective operation timeout" in log
