"""Launcher detection from environment dicts: one test per row of hpc_notes.md §5.2.

The environments below are trimmed copies of what each launcher really exported on the local
Slurm 22.05 / Open MPI 4.1 cluster (tools/local_slurm.sh), plus MPICH's from hpc_notes.md.
"""
from __future__ import annotations

import pytest

from hpcnft.distributed.detect import detect
from hpcnft.distributed.launch import (
    DEFAULT_PORT,
    LAUNCHER_ENV,
    LaunchError,
    LaunchInfo,
    NodelistError,
    job_port,
    parse_nodelist,
)


def no_mpi():  # detect() must not touch MPI for this environment
    raise AssertionError("MPI must not be used here")


def batch_env(job="4242", ntasks=3, nodelist="localhost"):
    """What the sbatch script itself (the batch step) sees: no SLURM_STEP_ID."""
    return {
        "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks), "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "1",
        "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_SUBMIT_DIR": "/home/u",
    }


def srun_env(rank, ntasks=3, job="4242", step="0", nodelist="localhost", localid=None, nodeid=0):
    env = batch_env(job, ntasks, nodelist)
    env.update({
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank if localid is None else localid),
        "SLURM_NODEID": str(nodeid), "SLURM_STEP_ID": step, "SLURM_STEPID": step,
        "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NUM_NODES": "1", "SLURM_GTIDS": "0,1,2",
    })
    return env


def mpirun_env(rank, size=3, local_size=None):
    local_size = size if local_size is None else local_size
    return {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "OMPI_COMM_WORLD_NODE_RANK": str(rank % local_size),
        "OMPI_MCA_orte_hnp_uri": "1987772416.0;tcp://10.0.0.2:42489",
        "OMPI_MCA_ess_base_jobid": "1987772417", "PMIX_NAMESPACE": "1987772417",
        "PMIX_RANK": str(rank), "OMPI_UNIVERSE_SIZE": "2",  # = cores, not the world size
    }


# ---------------------------------------------------------------------------------- torchrun

def test_torchrun():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29400",
           "TORCHELASTIC_RUN_ID": "none"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert info == LaunchInfo("torchrun", 2, 4, 0, "node01", 29400, None, 0, 1)
    assert info.init_method == "tcp://node01:29400"


def test_torchrun_standalone_in_batch_step_ignores_slurm_ranks():
    # torchrun --standalone --nproc-per-node 3 inside sbatch: world 3 though SLURM_NTASKS=1
    env = batch_env(ntasks=1) | {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                                 "SLURM_RESTART_COUNT": "2"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 1, 3, 1)
    assert (info.job_id, info.restart_count) == ("4242", 2)


def test_submitit_export():
    # submitit's TorchDistributedEnvironment().export() inside its srun step
    env = srun_env(1) | {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1",
                         "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "localhost", "MASTER_PORT": "23817",
                         "SUBMITIT_EXECUTOR": "slurm"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert info == LaunchInfo("torchrun", 1, 3, 1, "localhost", 23817, "4242", 0, 0)


def test_rank_without_world_size_refused():
    with pytest.raises(LaunchError, match="RANK is set but WORLD_SIZE is not"):
        detect({"RANK": "0"})


@pytest.mark.parametrize("env,match", [
    ({"RANK": "3", "WORLD_SIZE": "3"}, "rank 3 outside world size 3"),
    ({"RANK": "x", "WORLD_SIZE": "3"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
])
def test_torchrun_bad_values(env, match):
    with pytest.raises(LaunchError, match=match):
        detect(env)


# ---------------------------------------------------------------------------------- Open MPI

def test_mpirun_without_slurm_single_node():
    infos = [detect(mpirun_env(r), mpi_size=no_mpi, mpi_bcast_master=no_mpi) for r in range(3)]
    assert [i.launcher for i in infos] == ["openmpi"] * 3
    assert [(i.rank, i.world_size, i.local_rank) for i in infos] == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]
    assert {i.master_addr for i in infos} == {"127.0.0.1"}
    ports = {i.master_port for i in infos}
    assert len(ports) == 1  # same on every rank, derived from the mpirun's HNP URI
    assert ports == {job_port("1987772416.0;tcp://10.0.0.2:42489")}
    assert all(i.job_id is None and i.restart_count == 0 for i in infos)


def test_mpirun_without_slurm_port_fallbacks():
    env = mpirun_env(0)
    del env["OMPI_MCA_orte_hnp_uri"]
    assert detect(env).master_port == job_port("1987772417")  # PMIX_NAMESPACE
    del env["PMIX_NAMESPACE"]
    assert detect(env).master_port == DEFAULT_PORT
    assert detect(env | {"MASTER_PORT": "31000"}).master_port == 31000


def test_mpirun_multi_node_broadcasts_master():
    calls = []

    def bcast():
        calls.append(1)
        return ("node07", 40123)

    info = detect(mpirun_env(5, size=8, local_size=4), mpi_size=no_mpi, mpi_bcast_master=bcast)
    assert (info.rank, info.world_size, info.local_rank) == (5, 8, 1)
    assert (info.master_addr, info.master_port) == ("node07", 40123)
    assert calls == [1]
    # MASTER_ADDR wins and no collective is needed
    info = detect(mpirun_env(5, size=8, local_size=4) | {"MASTER_ADDR": "10.1.1.1"},
                  mpi_bcast_master=no_mpi)
    assert info.master_addr == "10.1.1.1"


def test_mpirun_inside_sbatch_every_rank_sees_procid_0():
    # mpirun -np 3 in an --ntasks=3 sbatch script: all ranks inherit the batch step's
    # SLURM_PROCID=0 / SLURM_LOCALID=0 and there is no SLURM_STEP_ID
    infos = [detect(batch_env() | mpirun_env(r), mpi_size=no_mpi, mpi_bcast_master=no_mpi)
             for r in range(3)]
    assert [i.launcher for i in infos] == ["openmpi"] * 3
    assert [i.rank for i in infos] == [0, 1, 2]
    assert [i.local_rank for i in infos] == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    assert {i.master_addr for i in infos} == {"127.0.0.1"}
    assert {i.master_port for i in infos} == {job_port("4242")}
    assert {i.job_id for i in infos} == {"4242"}


def test_mpirun_fewer_ranks_than_allocation_is_fine():
    info = detect(batch_env(ntasks=8) | mpirun_env(1, size=2), mpi_size=no_mpi)
    assert (info.rank, info.world_size) == (1, 2)


def test_mpirun_rank_on_orted_node_of_multi_node_allocation():
    # ranks 4..7 on the 2nd node are children of an orted that mpirun started with
    # `srun --ntasks-per-node=1`: they see that step (SLURM_STEP_ID, SLURM_NTASKS=1,
    # SLURM_PROCID=0, step node list = the 2nd node only). Not a mismatch, and the master is
    # not the step's first host.
    env = srun_env(0, ntasks=1, step="0", nodelist="gpu002") | mpirun_env(6, size=8, local_size=4)
    env["SLURM_JOB_NODELIST"] = "gpu[001-002]"
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=lambda: ("gpu001", 35555))
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("openmpi", 6, 8, 2)
    assert info.master_addr == "gpu001"


def test_mpirun_multi_node_without_mpi4py_falls_back_to_job_nodelist():
    def missing():
        raise ImportError("No module named 'mpi4py'")

    env = batch_env(nodelist="gpu[001-002]") | mpirun_env(1, size=8, local_size=4)
    info = detect(env, mpi_bcast_master=missing)
    assert (info.master_addr, info.master_port) == ("gpu001", job_port("4242"))
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        detect(mpirun_env(1, size=8, local_size=4), mpi_bcast_master=missing)


def test_ompi_world_from_srun_itself_is_cross_checked():
    # an Open MPI that exports OMPI_COMM_WORLD_* under direct srun launch (no mpirun HNP):
    # both numbers describe the same launch, so they must agree
    env = srun_env(1, ntasks=2) | {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
                                   "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    with pytest.raises(LaunchError, match=r"OMPI_COMM_WORLD_SIZE world size 3 != SLURM_NTASKS=2"):
        detect(env, mpi_size=no_mpi)
    env["SLURM_STEP_NUM_TASKS"] = env["SLURM_NTASKS"] = "3"
    assert detect(env, mpi_size=no_mpi).world_size == 3


# ---------------------------------------------------------------------------------- PMIx

def test_srun_mpi_pmix():
    infos = [detect(srun_env(r) | {"PMIX_RANK": str(r), "PMIX_NAMESPACE": "slurm.pmix.4242.0"},
                    mpi_size=lambda: 3, mpi_bcast_master=no_mpi) for r in range(3)]
    assert [i.launcher for i in infos] == ["pmix"] * 3
    assert [(i.rank, i.world_size, i.local_rank) for i in infos] == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]
    assert {(i.master_addr, i.master_port) for i in infos} == {("localhost", job_port("4242"))}
    assert {i.job_id for i in infos} == {"4242"}


def test_srun_mpi_pmix_with_mpich_singletons_refused():
    # MPICH under srun --mpi=pmix: each process is its own MPI world of size 1
    env = srun_env(2) | {"PMIX_RANK": "2"}
    with pytest.raises(LaunchError) as e:
        detect(env, mpi_size=lambda: 1)
    msg = str(e.value)
    assert "1" in msg and "SLURM_NTASKS=3" in msg and "\n" not in msg


def test_pmix_without_mpi4py_uses_slurm_ntasks():
    def missing():
        raise ImportError("No module named 'mpi4py'")

    info = detect(srun_env(1) | {"PMIX_RANK": "1"}, mpi_size=missing)
    assert (info.launcher, info.rank, info.world_size) == ("pmix", 1, 3)
    with pytest.raises(LaunchError, match="world size is unknown"):
        detect({"PMIX_RANK": "0"}, mpi_size=missing)


# ---------------------------------------------------------------------------------- Slurm

def test_srun_plain():
    infos = [detect(srun_env(r, nodelist="gpu[001-002]", localid=r % 2, nodeid=r // 2),
                    mpi_size=no_mpi, mpi_bcast_master=no_mpi) for r in range(3)]
    assert [i.launcher for i in infos] == ["slurm"] * 3
    assert [(i.rank, i.local_rank, i.node_rank) for i in infos] == [(0, 0, 0), (1, 1, 0), (2, 0, 1)]
    assert {i.world_size for i in infos} == {3}
    assert {i.master_addr for i in infos} == {"gpu001"}
    assert {i.master_port for i in infos} == {job_port("4242")}
    assert 20000 <= infos[0].master_port < 40000


def test_srun_requeued_keeps_port_and_counts_restarts():
    a = detect(srun_env(0))
    b = detect(srun_env(0) | {"SLURM_RESTART_COUNT": "3"})
    assert a.master_port == b.master_port
    assert (a.restart_count, b.restart_count) == (0, 3)


def test_master_env_overrides_slurm():
    info = detect(srun_env(0) | {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "12345"})
    assert (info.master_addr, info.master_port) == ("10.9.9.9", 12345)


def test_batch_script_itself_is_not_a_rank():
    info = detect(batch_env(), mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)
    # the local spawner's ranks are children of this process: loopback, but a per-job port
    assert (info.master_addr, info.master_port, info.job_id) == ("127.0.0.1", job_port("4242"), "4242")


def test_procid_out_of_range_refused():
    with pytest.raises(LaunchError, match="rank 3 outside world size 3"):
        detect(srun_env(3))


# ---------------------------------------------------------------------------------- MPICH PMI

def test_mpich_mpiexec_hydra():
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "PMI_FD": "7", "MPI_LOCALRANKID": "2",
           "MPI_LOCALNRANKS": "3"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert info == LaunchInfo("pmi", 2, 3, 2, "127.0.0.1", DEFAULT_PORT, None, 0, 0)


def test_mpich_hydra_through_srun_proxies_is_not_a_mismatch():
    # hydra under Slurm starts one proxy per node with srun: the step has 1 task, PMI_SIZE 3
    env = srun_env(0, ntasks=1) | {"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0",
                                   "MPI_LOCALNRANKS": "3"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("pmi", 0, 3, "127.0.0.1")


def test_mpich_srun_pmi2():
    env = srun_env(1, nodelist="cn[10-11]") | {"PMI_RANK": "1", "PMI_SIZE": "3", "PMI_FD": "5",
                                                "PMI_JOBID": "4242.0"}
    info = detect(env, mpi_size=no_mpi, mpi_bcast_master=no_mpi)
    assert info == LaunchInfo("pmi", 1, 3, 1, "cn10", job_port("4242"), "4242", 0, 0)


def test_pmi_size_vs_slurm_ntasks_mismatch_refused():
    env = srun_env(1, ntasks=4) | {"PMI_RANK": "1", "PMI_SIZE": "3"}
    with pytest.raises(LaunchError, match=r"PMI_SIZE world size 3 != SLURM_NTASKS=4"):
        detect(env)


# ---------------------------------------------------------------------------------- none

def test_none():
    assert detect({}) == LaunchInfo("none", 0, 1, 0, "127.0.0.1", 29500, None, 0, 0)
    info = detect({"MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "30001", "HOME": "/root"})
    assert (info.launcher, info.master_addr, info.master_port) == ("none", "127.0.0.2", 30001)


def test_detect_takes_real_environ_shape(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "PMI", "RANK", "WORLD_SIZE", "MASTER_")):
            monkeypatch.delenv(k)
    assert detect(os.environ).launcher == "none"


def test_describe_is_one_line():
    text = detect(srun_env(1) | {"SLURM_RESTART_COUNT": "1"}).describe()
    assert "\n" not in text and "rank 1/3" in text and "job 4242 restart 1" in text


# ---------------------------------------------------------------------------------- nodelist

@pytest.mark.parametrize("text,hosts", [
    ("gpu[001-004,010],cpu7", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cpu7"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[9-10]", ["node9", "node10"]),
    ("localhost", ["localhost"]),
    ("node[1,3-4]", ["node1", "node3", "node4"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("a[1-2]-ib,c[5],d[01-02]x", ["a1-ib", "a2-ib", "c5", "d01x", "d02x"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n1,n2 , n3", ["n1", "n2", "n3"]),
    ("", []),
])
def test_parse_nodelist(text, hosts):
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["gpu[001-004", "gpu001]", "gpu[a-b]", "gpu[4-1]", "a,,b", "x[]"])
def test_parse_nodelist_malformed(bad):
    with pytest.raises(NodelistError):
        parse_nodelist(bad)
    with pytest.raises(ValueError):
        parse_nodelist(bad)


def test_malformed_nodelist_in_env_is_a_launch_error():
    with pytest.raises(LaunchError, match="host list"):
        detect(srun_env(0, nodelist="gpu[001-"))


# ---------------------------------------------------------------------------------- job_port

def test_job_port_stable_and_in_range():
    assert job_port(None) == 29500 and job_port("") == 29500
    assert job_port("123456") == job_port("123456")
    for jid in ["1", "4242", "19999", "20000", "999999999", "123_4", "77+1", "slurm.pmix.5.0"]:
        p = job_port(jid)
        assert 20000 <= p < 40000, (jid, p)
        assert p == job_port(jid)
    # nearby job ids (jobs that run at the same time) never share a port
    assert len({job_port(str(j)) for j in range(5000, 5100)}) == 100
    assert 1000 <= job_port("98765", base=1000, span=500) < 1500
    with pytest.raises(ValueError):
        job_port("1", base=60000, span=10000)


def test_a_failed_rendezvous_is_one_line_with_the_fix_when_the_port_is_taken():
    from hpcnft.distributed.groups import rendezvous_error

    info = detect({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "node7", "MASTER_PORT": "20042"})
    taken = RuntimeError("The server socket has failed to listen on any local network address. port: 20042, "
                         "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
                         "Exception raised from makeWithPort at socket.cpp:1015")
    assert str(rendezvous_error(taken, info)) == ("rank 1 cannot listen on node7:20042: the port is taken on this "
                                                  "node; set MASTER_PORT to a free port for this job")
    late = RuntimeError("Timed out after 1801 seconds waiting for clients. 2/3 clients joined.\nmore detail")
    assert str(rendezvous_error(late, info)) == ("rank 1 cannot rendezvous at node7:20042: Timed out after 1801 "
                                                 "seconds waiting for clients. 2/3 clients joined.")


# ------------------------------------------------------------------ the table of names
def test_the_table_names_each_launchers_variables_in_detection_order():
    from hpcnft.distributed.launch import LAUNCHERS, SLURM_ENV

    assert [n.launcher for n in LAUNCHER_ENV] + ["none"] == list(LAUNCHERS)
    rows = {n.launcher: (n.rank, n.world, n.local_rank, n.local_size, n.node_rank) for n in LAUNCHER_ENV}
    assert rows == {
        "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", None, "GROUP_RANK"),
        "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", None),
        "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
        "pmix": ("PMIX_RANK", None, None, None, None),
        "slurm": ("SLURM_PROCID", None, "SLURM_LOCALID", None, "SLURM_NODEID"),
    }
    assert SLURM_ENV["job_id"] == ("SLURM_JOB_ID", "SLURM_JOBID")
    assert SLURM_ENV["ntasks"][0] == "SLURM_STEP_NUM_TASKS"  # a step's own size before the allocation's


@pytest.mark.parametrize("names", LAUNCHER_ENV, ids=lambda n: n.launcher)
def test_each_row_is_read_by_its_names(names):
    """Rank 1 of 4 (local rank 1 where the launcher says) through exactly the row's variables."""
    env = {names.rank: "1"}
    if names.world:
        env[names.world] = "4"
    if names.launcher == "slurm":  # plain srun: inside a step, the size from SLURM_NTASKS
        env |= {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}
    if names.local_rank:
        env[names.local_rank] = "1"
    info = detect(env, mpi_size=lambda: 4, mpi_bcast_master=lambda: ("host0", 1234))
    assert (info.launcher, info.rank, info.world_size) == (names.launcher, 1, 4)
    assert info.local_rank == (1 if names.local_rank else 0)
