"""Jobs that span nodes, on the local multi-node cluster (three network namespaces, each a host
with its own name, address and slurmd: tools/local_slurm.sh with HPCNFT_SLURM_NODES=3).

  1  every node is a host of its own: its own name, resolvable, on an address that is not
     loopback, and the interface that holds it is what a rank binds
  2  sbatch --nodes=3 --ntasks-per-node=1 slurm/tiny.sbatch (2+1, one rank per node)
  3  sbatch --nodes=3 --ntasks=5 slurm/tiny.sbatch (4+1, uneven over the nodes)
  4  a rank on one node that cannot reach the master: one line naming the address and interface
  5  SIGUSR2 to the ranks of a 2+1 job over three nodes: checkpoint, requeue, resume, identical
  6  a node lost mid-run (its slurmd and every process in its namespace killed): the job ends
     non-zero naming the rank and host; submitted again (the
     node back), it resumes from the last checkpoint, identical
  10 a 2+1 job (determinism.layout_invariant) requeued onto two nodes (1+1) with node3 drained,
     then onto all three again (2+1): it goes on on each and finishes

2, 3 and 5-9 are compared bit for bit (every non-perf metric series) with the local spawner's run of
the same layout (3 steps for 2 and 3; 5 and 6 run the cheaper steps of test_launchers' SHORT_SET:
the multi-node tests are kept short for CI).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
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
SHORT_SET, wait_for_job_step, ranks_up, wait_until = _l.SHORT_SET, _l.wait_for_job_step, _l.ranks_up, _l.wait_until
sacct_states, job_output, LONG_TIMEOUT = _l.sacct_states, _l.job_output, _l.LONG_TIMEOUT
assert_same_metrics, read_run, job_state, TERMINAL, _run = (_l.assert_same_metrics, _l.read_run, _l.job_state,
                                                            _l.TERMINAL, _l._run)

STEPS = _l.TINY_STEPS  # the session's shared tiny run is the 2+1 reference
WIDE = ["layout.train_ranks=4"]  # 4 train + 1 reward; 16 samples a step split over 4 train ranks
NODE_IFACE = "eth0"  # each node's end of its veth pair (tools/local_slurm.sh)
SHORT_STEPS = _l.SHORT_STEPS  # tests 5 and 6: long enough to be interrupted mid-run
LOST_TIMEOUT_S = 30  # test 6's layout.timeout_s
ONE_PER_NODE = ["--nodes=3", "--ntasks-per-node=1"]


@pytest.fixture(scope="module", autouse=True)
def _cluster_and_cache(multinode_cluster, hpcnft_cache):
    """The cluster first (skip/fail before any reference run), then the session's tiny models,
    built here before any job starts."""
    from hpcnft.models.tiny import ensure_tiny_models
    from hpcnft.models.tiny_cache import cache_dir

    ensure_tiny_models(cache_dir())
    return multinode_cluster


@pytest.fixture(scope="module")
def ref_3(tiny_run) -> str:
    """`hpcnft run tiny --steps 3` through the local spawner: the session's shared run."""
    return tiny_run.run_dir


@pytest.fixture(scope="module")
def ref_5(tmp_path_factory) -> str:
    return local_reference(tmp_path_factory, "mn-ref5", STEPS, WIDE)


@pytest.fixture(scope="module")
def ref_short(short_run) -> str:
    """The session's uninterrupted SHORT_STEPS run (tests/hpc/conftest.py)."""
    return short_run


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
    probe = ("import socket; from hpcnft.distributed import netif; h = socket.gethostname(); a = netif.resolve(h); "
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


def test_sigusr2_over_three_nodes_checkpoints_requeues_resumes_identical(multinode_cluster, ref_short, tmp_path,
                                                                           jobs):
    run_dir = tmp_path / "run"
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, SHORT_STEPS, SHORT_SET, cwd=tmp_path, args=ONE_PER_NODE)
    jobs.append(job)
    wait_until("every rank up", lambda: ranks_up(run_dir), RUN_TIMEOUT, lambda: diagnose(run_dir, job))
    at = wait_for_job_step(job, 1, run_dir)
    assert at < SHORT_STEPS - 2, f"the run was already at step {at}: too late to interrupt"
    p = _run(["scancel", "--signal=USR2", job])  # every rank, on every node (not the batch shell)
    assert p.returncode == 0, p.stderr
    state = wait(job, timeout=LONG_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert "REQUEUED" in sacct_states(job), sacct_states(job)
    check_attempts(run_dir, [0, 1], job, "slurm")
    kinds = [e["kind"] for e in read_run(str(run_dir)).events]
    assert "signal" in kinds and "resume" in kinds, kinds
    assert_same_metrics(ref_short, str(run_dir))


def test_scontrol_requeue_over_three_nodes_resumes_identical(multinode_cluster, ref_short, tmp_path, jobs):
    """`scontrol requeue` of a running 2+1 job over three nodes: Slurm ends every node's rank
    (SIGTERM: they checkpoint), starts the job again on the nodes, and it resumes bit for bit."""
    run_dir = tmp_path / "run"
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, SHORT_STEPS, SHORT_SET, cwd=tmp_path, args=ONE_PER_NODE)
    jobs.append(job)
    at = wait_for_job_step(job, 2, run_dir)
    assert at < SHORT_STEPS - 2, f"the run was already at step {at}: too late to requeue"
    p = _run(["scontrol", "requeue", job])
    assert p.returncode == 0, p.stderr
    state = wait(job, timeout=LONG_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert "REQUEUED" in sacct_states(job), sacct_states(job)
    check_attempts(run_dir, [0, 1], job, "slurm")
    assert topology(run_dir)["hosts"] == ["node1", "node2", "node3"]
    assert "resume" in [e["kind"] for e in read_run(str(run_dir)).events]
    assert_same_metrics(ref_short, str(run_dir))


def node_namespace(node: str) -> str:
    """The network namespace tools/local_slurm.sh runs NODE in."""
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("hpcnft-") and name.endswith(f"-{node}"):
            return name
    pytest.fail(f"no network namespace of {node} (ip netns list)")


def kill_node(node: str) -> list[int]:
    """SIGKILL everything running on NODE: its slurmd, slurmstepd and the job's processes (all
    of them started in the node's namespace by this cluster)."""
    pids = [int(x) for x in _run(["ip", "netns", "pids", node_namespace(node)]).stdout.split()]
    for pid in pids:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    return pids


def revive_node(slurm_dir: Path) -> None:
    """start is idempotent: it starts the slurmd that is missing and waits for every node idle."""
    hpc = _l._hpc
    p = _run(["bash", str(hpc.LOCAL_SLURM), str(slurm_dir), "start"], timeout=300,
             env=dict(base_env(), **hpc.MULTINODE_KNOBS))
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_node_lost_mid_run_ends_the_job_naming_rank_and_host_and_it_resumes(multinode_cluster, ref_short,
                                                                             tmp_path, jobs):
    """node3 (the reward rank's) is killed at step 2. The train ranks fail at once, naming their
    host and the lost peer's rank and host; srun ends the attempt when Slurm declares the node
    failed. With node3 back, the run started again resumes from the last checkpoint."""
    run_dir = tmp_path / "run"
    overrides = SHORT_SET + [f"layout.timeout_s={LOST_TIMEOUT_S}"]
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, SHORT_STEPS, overrides, cwd=tmp_path, args=ONE_PER_NODE)
    jobs.append(job)
    wait_for_job_step(job, 2, run_dir)
    slurm_dir = Path(os.environ["SLURM_CONF"]).parents[1]  # DIR/etc/slurm.conf
    try:
        killed = kill_node("node3")
        ended = wait_until("the attempt's end", lambda: re.search(r"\] exit (\d+)", job_output(job)),
                           LOST_TIMEOUT_S + 60 + 60, lambda: diagnose(run_dir, job))
        out = job_output(job)
        assert int(ended.group(1)) != 0, out[-4000:]
        assert re.search(r"^hpcnft: rank [01] \(train\) on node[12]: .*\[peer: node3 \(rank 2\)\]", out, re.M), \
            f"killed {killed}\n{out[-4000:]}"
    finally:
        # Slurm requeues the job (--requeue); it is cancelled here, so that the node's return
        # cannot meet a requeued attempt half started, and the run is started again as a new job
        _run(["scancel", job])
        wait(job, timeout=120)
        revive_node(slurm_dir)
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, SHORT_STEPS, overrides, cwd=tmp_path, args=ONE_PER_NODE)
    jobs.append(job)
    state = wait(job, timeout=LONG_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert "resume" in [e["kind"] for e in read_run(str(run_dir)).events]
    assert_same_metrics(ref_short, str(run_dir))


def test_submit_through_submitit_over_three_nodes_identical(multinode_cluster, ref_3, tmp_path):
    from hpcnft.run.submit import submit

    run_dir = tmp_path / "run"
    job = submit("tiny", cluster="slurm", steps=STEPS, nodes=3, tasks_per_node=1, run_dir=str(run_dir),
                 timeout_min=15)
    try:
        wait_until(f"submitit job {job.job_id}", job.done, RUN_TIMEOUT, lambda: diagnose(run_dir), poll=2)
        job.results()  # every task's; raises with the failing task's error
    except Exception as e:  # noqa: BLE001 - the assertion shows what went wrong
        pytest.fail(f"submitit job {job.job_id} failed: {e}\n{diagnose(run_dir)}")
    finally:
        if job_state(job.job_id) not in TERMINAL:
            _run(["scancel", job.job_id])
    assert_same_metrics(ref_3, str(run_dir))
    check_attempts(run_dir, [0], job.job_id, "submitit")
    assert topology(run_dir)["hosts"] == ["node1", "node2", "node3"]


def test_srun_pmix_over_three_nodes_identical(multinode_cluster, ref_3, tmp_path):
    pytest.importorskip("mpi4py", reason="srun --mpi=pmix ranks take the world size from MPI (mpi4py)")
    run_dir = tmp_path / "run"
    name = f"hpcnft-pmix-{uuid.uuid4().hex[:8]}"
    code, out = run_cmd(["srun", "--mpi=pmix", "--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=1",
                         "--kill-on-bad-exit=1", f"--job-name={name}", "--time=00:10:00",
                         PY, "-m", "hpcnft", "run", "tiny", "--steps", STEPS, "--run-dir", run_dir],
                        timeout=RUN_TIMEOUT, cwd=tmp_path, env=base_env(),
                        on_timeout=lambda: _run(["scancel", f"--name={name}"]))
    assert code == 0, f"srun exited {code}:\n{out[-6000:]}\n{diagnose(run_dir)}"
    assert_same_metrics(ref_3, str(run_dir))
    topo = topology(run_dir)
    assert topo["launcher"] == "pmix" and topo["hosts"] == ["node1", "node2", "node3"], topo


MPIRUN_OVER_NODES = """#!/bin/bash
#SBATCH --time=00:10:00
#SBATCH --output=mpirun-%j.out
mpirun --allow-run-as-root -np 3 --map-by ppr:1:node {py} -m hpcnft run tiny --steps {steps} --run-dir {run_dir}
"""


def test_mpirun_inside_a_three_node_allocation_identical(multinode_cluster, ref_3, tmp_path, jobs):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (tools/local_slurm.sh installs Open MPI)")
    pytest.importorskip("mpi4py", reason="mpirun ranks across nodes learn rank 0's address over MPI (mpi4py)")
    run_dir = tmp_path / "run"
    script = MPIRUN_OVER_NODES.format(py=shlex.quote(PY), steps=STEPS, run_dir=shlex.quote(str(run_dir)))
    job = multinode_cluster.submit(script, cwd=tmp_path, args=ONE_PER_NODE)
    jobs.append(job)
    state = wait(job, timeout=RUN_TIMEOUT)
    assert state == "COMPLETED", diagnose(run_dir, job)
    assert_same_metrics(ref_3, str(run_dir))
    topo = topology(run_dir)
    assert topo["launcher"] == "openmpi" and topo["hosts"] == ["node1", "node2", "node3"], topo


# -- 10: a requeue onto fewer nodes and back ---------------------------------------------------
# determinism.layout_invariant: the run's bits do not depend on the nodes it got; 4 samples a
# step in 4 shards, which 1 and 2 train ranks divide.
INVARIANT_SET = SHORT_SET + ["determinism.layout_invariant=true", "determinism.virtual_shards=4"]
REQUEUE_STEPS = 12  # room for two moves after step 2, few enough for CI


def requeue_onto(job: str, nodes: int, run_dir) -> None:
    """Requeue JOB held, resize its pending record to NODES nodes (one task each), release it:
    what a user or a site's automation does when a node is lost and the job should go on with
    the others rather than wait for it."""
    p = _run(["scontrol", "requeuehold", job])
    assert p.returncode == 0, p.stderr
    wait_until("the requeued job held", lambda: job_state(job) == "PENDING", 120, lambda: diagnose(run_dir, job))
    p = _run(["scontrol", "update", f"JobId={job}", f"NumNodes={nodes}", f"NumTasks={nodes}"])
    assert p.returncode == 0, p.stderr
    assert _run(["scontrol", "release", job]).returncode == 0


def layout_events(run_dir) -> list[tuple[int, str]]:
    try:
        return [(e["step"], e["text"]) for e in read_run(str(run_dir)).events if e["kind"] == "layout"]
    except Exception:  # noqa: BLE001 - run.h5 not written yet
        return []


def steps_after(run_dir, moves: int) -> bool:
    """Whether the run has trained a step since its `moves`-th layout change."""
    events = layout_events(run_dir)
    if len(events) < moves:
        return False
    metrics = read_run(str(run_dir)).metrics.get("train/nft_loss")
    return metrics is not None and len(metrics) and metrics[-1, 0] > events[moves - 1][0]


def test_a_job_requeued_onto_fewer_nodes_and_back_goes_on_on_each_and_finishes(multinode_cluster, tmp_path, jobs):
    """2+1 over three nodes; node3 drained and the job requeued onto node1-2 (1+1), then node3
    back and the job requeued onto all three (2+1): each start says the layout it moved to, and
    the run finishes with every step once. (That its bits are the straight run's under
    determinism.layout_invariant, the layouts' tests hold: tests/integration/test_layout_invariance.py.)"""
    run_dir = tmp_path / "run"
    job = sbatch_job(multinode_cluster, TINY_SBATCH, run_dir, REQUEUE_STEPS, INVARIANT_SET, cwd=tmp_path,
                     args=ONE_PER_NODE)
    jobs.append(job)
    try:
        at = wait_for_job_step(job, 2, run_dir)
        assert at < REQUEUE_STEPS - 6, f"the run was already at step {at}: too late to move it twice"
        assert _run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=hpcnft-test"]).returncode == 0
        requeue_onto(job, 2, run_dir)
        wait_until("a step on two nodes", lambda: steps_after(run_dir, 1), LONG_TIMEOUT, lambda: diagnose(run_dir, job))
        assert _run(["scontrol", "update", "NodeName=node3", "State=RESUME"]).returncode == 0
        requeue_onto(job, 3, run_dir)
        state = wait(job, timeout=LONG_TIMEOUT)
    finally:
        _run(["scontrol", "update", "NodeName=node3", "State=RESUME"])
    assert state == "COMPLETED", diagnose(run_dir, job)
    moves = [text for _, text in layout_events(run_dir)]
    assert len(moves) == 2, moves
    assert moves[0].endswith("2 train + 1 reward ranks on 3 host(s) (node1, node2, node3) -> "
                             "1 train + 1 reward ranks on 2 host(s) (node1, node2)"), moves
    assert moves[1].endswith("-> 2 train + 1 reward ranks on 3 host(s) (node1, node2, node3)"), moves
    assert "--ntasks=2" in job_output(job)  # the batch step started the tasks the nodes it got hold
    steps = read_run(str(run_dir)).metrics["train/nft_loss"][:, 0].tolist()
    assert steps == [float(s) for s in range(1, REQUEUE_STEPS + 1)]
