"""tools/local_slurm.sh with HPCNFT_SLURM_NODES: a cluster of two nodes of its own (own dir,
ports, address range and node names, no accounting), each node a host with its own name and
address; `stop` leaves no namespace, link, hosts line or daemon behind. Bad knobs: one line, exit 2."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "tools" / "local_slurm.sh"
KNOBS = {"HPCNFT_SLURM_NODES": "2", "SLURM_NET": "10.214.7", "SLURM_NODE_PREFIX": "tnode", "SLURM_CTLD_PORT": "8817",
         "SLURM_SLURMD_PORT": "8818", "SLURM_DBD_PORT": "8819", "SLURM_MYSQL_PORT": "8830", "LINK_ETC": "0",
         "WITH_ACCOUNTING": "0"}


def script(slurm_dir, action: str, timeout: float = 300, **extra) -> subprocess.CompletedProcess:
    env = {**os.environ, **KNOBS, **extra}
    env.pop("SLURM_CONF", None)
    return subprocess.run(["bash", str(LOCAL_SLURM), str(slurm_dir), action], capture_output=True, text=True,
                          timeout=timeout, env=env)


def made_by(tag: str) -> dict[str, list[str]]:
    """The namespaces and links on this machine whose names carry the cluster's tag."""
    ns = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                     text=True).stdout.splitlines() if tag in line]
    links = re.findall(rf"^\d+: ({tag}\w*)[@:]", subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                                                 text=True).stdout, re.M)
    return {"netns": ns, "links": links}


@pytest.mark.parametrize("knob, value, says", [
    ("HPCNFT_SLURM_NODES", "two", "HPCNFT_SLURM_NODES=two is not a node count"),
    ("HPCNFT_SLURM_NODES", "0", "HPCNFT_SLURM_NODES=0 is not a node count"),
    ("SLURM_NET", "8.8.8", "SLURM_NET=8.8.8 is not the first three numbers of a private /24"),
    ("SLURM_NODE_PREFIX", "Bad_Name", "SLURM_NODE_PREFIX=Bad_Name is not a host name prefix"),
])
def test_a_bad_knob_is_one_line_and_exit_2(tmp_path, knob, value, says):
    r = script(tmp_path / "c", "start", timeout=30, **{knob: value})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr


def running_slurmd(pid: int) -> bool:
    try:
        comm, stat = Path(f"/proc/{pid}/comm").read_text(), Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return "slurmd" in comm and stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_two_nodes_each_a_host_and_stop_removes_everything(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None or not Path("/usr/sbin/slurmctld").exists():
        pytest.skip("needs root, iproute2 and Slurm's daemons (tools/local_slurm.sh start installs them)")
    slurm_dir = tmp_path / "c"
    conf = {"SLURM_CONF": str(slurm_dir / "etc" / "slurm.conf")}
    try:
        r = script(slurm_dir, "start")
        assert r.returncode == 0, r.stderr[-3000:]
        env = dict(os.environ, **conf)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env).stdout
        assert sorted(nodes.split("\n")[:-1]) == ["tnode1 idle", "tnode2 idle"], nodes
        hosts = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", "--time=00:01:00", "sh", "-c",
                                "echo $(hostname) $(getent hosts $(hostname))"], capture_output=True, text=True,
                               env=env, timeout=120, cwd=tmp_path)
        assert hosts.returncode == 0, hosts.stderr
        assert sorted(hosts.stdout.split("\n")[:-1]) == ["tnode1 10.214.7.11 tnode1", "tnode2 10.214.7.12 tnode2"]
        made = made_by("h214x7")
        assert len(made["netns"]) == 2 and len(made["links"]) == 3, made  # a bridge and a veth end per node
        assert f"# BEGIN hpcnft local_slurm {slurm_dir}" in Path("/etc/hosts").read_text()
        pids = [int((slurm_dir / "run" / f"slurmd-tnode{k}.pid").read_text()) for k in (1, 2)]
    finally:
        stop = script(slurm_dir, "stop", timeout=120)
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert made_by("h214x7") == {"netns": [], "links": []}
    assert str(slurm_dir) not in Path("/etc/hosts").read_text()
    for pid in pids:  # exited: gone, its number reused, or a zombie its adopter has not reaped yet
        assert not running_slurmd(pid)
    assert not (slurm_dir / "run" / "net.list").exists()
