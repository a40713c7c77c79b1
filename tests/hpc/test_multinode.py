"""Jobs that span nodes, on the local multi-node cluster (three network namespaces, each a host
with its own name, address and slurmd: tools/local_slurm.sh with HPCNFT_SLURM_NODES=3).

  1  every node is a host of its own: its own name, resolvable, on an address that is not
     loopback, and the interface that holds it is what a rank binds
  2  sbatch --nodes=3 --ntasks-per-node=1 slurm/tiny.sbatch (2+1, one rank per node)
  3  sbatch --nodes=3 --ntasks=5 slurm/tiny.sbatch (4+1, uneven over the nodes)
  4  a rank on one node that cannot reach the master: one line naming the address and interface

2 and 3 are compared bit for bit (every non-perf metric series) with the local spawner's run of
the same layout (2 steps: the multi-node tests are kept short for CI).
"""
from __future__ import annotations

import importlib.util
import json
import re
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _load(name: str, file: str):
    """A sibling module under its own name (tests/hpc is no package; see test_launchers)."""
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_l = _load("hpcnft_hpc_launchers", "test_launchers.py")
PY, TINY_SBATCH, RUN_TIMEOUT = _l.PY, _l.TINY_SBATCH, _l.RUN_TIMEOUT
base_env, run_cmd, diagnose, set_args = _l.base_env, _l.run_cmd, _l.diagnose, _l.set_args
local_reference, check_attempts, sbatch_job, wait = _l.local_reference, _l.check_attempts, _l.sbatch_job, _l.wait
assert_same_metrics, read_run, job_state, TERMINAL, _run = (_l.assert_same_metrics, _l.read_run, _l.job_state,
                                                            _l.TERMINAL, _l._run)

STEPS = 2
WIDE = ["layout.train_ranks=4"]  # 4 train + 1 reward; 16 samples a step split over 4 train ranks
NODE_IFACE = "eth0"  # each node's end of its veth pair (tools/local_slurm.sh)


@pytest.fixture(scope="module", autouse=True)
def _cluster_and_cache(multinode_cluster, hpcnft_cache):
    """The cluster first (skip/fail before any reference run), then the session's tiny models,
    built here before any job starts."""
    from hpcnft.models.tiny import ensure_tiny_models
    from hpcnft.models.tiny_cache import cache_dir

    ensure_tiny_models(cache_dir())
    return multinode_cluster


@pytest.fixture(scope="module")
def ref_3(tmp_path_factory) -> str:
    return local_reference(tmp_path_factory, "mn-ref3", STEPS)


@pytest.fixture(scope="module")
def ref_5(tmp_path_factory) -> str:
    return local_reference(tmp_path_factory, "mn-ref5", STEPS, WIDE)


@pytest.fixture
def jobs():
    ids: list[str] = []
    yield ids
    for j in ids:
        if job_state(j) not in TERMINAL:
            _run(["scancel", j])


def topology(run_dir) -> dict:
    """run.h5's topology attributes, its lists decoded (they are stored as JSON)."""
    raw = read_run(str(run_dir)).topology
    return {k: json.loads(v) if isinstance(v, str) and v.startswith("[") else v for k, v in raw.items()}


def bound_interfaces(run_dir) -> dict[int, str]:
    """What each rank logged it binds its collectives to."""
    out = {}
    for log in sorted((Path(run_dir) / "logs").glob("rank*.log")):
        m = re.search(r"collectives bind (\S+) \(GLOO_SOCKET_IFNAME; NCCL_SOCKET_IFNAME (\S+)\)", log.read_text())
        out[int(log.stem[4:])] = f"{m.group(1)}/{m.group(2)}" if m else "(not logged)"
    return out


def test_every_node_is_a_host_of_its_own(multinode_cluster, tmp_path):
    probe = ("import socket; from hpcnft.dist import netif; h = socket.gethostname(); a = netif.resolve(h); "
             "print('NODE', h, a[0], netif.own_interface(a, netif.local_interfaces()))")
    code, out = run_cmd(["srun", "--nodes=3", "--ntasks-per-node=1", "--time=00:02:00", PY, "-c", probe],
                        timeout=120, cwd=tmp_path, env=base_env())
    assert code == 0, out
    nodes = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("NODE "))
    assert [n[0] for n in nodes] == ["node1", "node2", "node3"], out
    assert len({n[1] for n in nodes}) == 3 and not any(n[1].startswith("127.") for n in nodes), out
    assert {n[2] for n in nodes} == {NODE_IFACE}, out


def test_two_plus_one_over_three_nodes_identical(multinode_cluster, ref_3, tmp_path, jobs):
    run_dir = tmp_path / "run"
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, STEPS, cwd=tmp_path,
                     args=["--nodes=3", "--ntasks-per-node=1"])
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert_same_metrics(ref_3, str(run_dir))
    check_attempts(run_dir, [0], job, "slurm")
    topo = topology(run_dir)
    assert topo["hosts"] == ["node1", "node2", "node3"], topo
    assert bound_interfaces(run_dir) == {r: f"{NODE_IFACE}/{NODE_IFACE}" for r in range(3)}, diagnose(run_dir, job)


def test_four_plus_one_uneven_over_three_nodes_identical(multinode_cluster, ref_5, tmp_path, jobs):
    run_dir = tmp_path / "run"
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, STEPS, WIDE, cwd=tmp_path,
                     args=["--nodes=3", "--ntasks=5"])
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert_same_metrics(ref_5, str(run_dir))
    topo = topology(run_dir)
    assert topo["world_size"] == 5 and topo["train_ranks"] == [0, 1, 2, 3], topo
    assert set(topo["hosts"]) == {"node1", "node2", "node3"}, topo
    assert topo["hosts"][0] == "node1", topo  # the master: the first host of the node list


def test_a_rank_that_cannot_reach_the_master_names_address_and_interface(multinode_cluster, tmp_path):
    """Rank 1 of 2 on node2, its master an address on the nodes' network where no host is."""
    env = dict(base_env(), RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="10.213.0.99", MASTER_PORT="29999")
    name = f"hpcnft-rdv-{uuid.uuid4().hex[:8]}"
    code, out = run_cmd(["srun", "-w", "node2", "-N1", "-n1", f"--job-name={name}", "--time=00:03:00",
                         PY, "-m", "hpcnft", "run", "tiny", "--steps", "1", "--run-dir", tmp_path / "run",
                         *set_args(["layout.timeout_s=5"])],
                        timeout=180, cwd=tmp_path, env=env, on_timeout=lambda: _run(["scancel", f"--name={name}"]))
    assert code != 0 and "Traceback" not in out, out
    line = next(x for x in out.splitlines() if x.startswith("hpcnft: rank 1 cannot rendezvous"))
    assert line.startswith("hpcnft: rank 1 cannot rendezvous at 10.213.0.99:29999 (10.213.0.99 from interface "
                           f"{NODE_IFACE} (10.213.0.12) of node2): "), out
