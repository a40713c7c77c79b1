"""The interface a rank's collectives bind (hpcnft.distributed.netif): the one holding the address of
the node's own name, never loopback across nodes, never over the user's choice; and the route a
failed rendezvous names."""
from __future__ import annotations

import socket

from hpcnft.distributed import netif
from hpcnft.distributed.groups import rendezvous_error
from hpcnft.distributed.launch import LaunchInfo

NODE = {"lo": ["127.0.0.1", "::1"], "docker0": ["172.17.0.1"], "eth0": ["10.213.0.12", "fe80::b814:1%eth0"],
        "ib0": ["192.168.7.12", "fd00::12"]}


def test_the_interface_holding_the_nodes_own_address_is_bound_for_gloo_and_nccl():
    assert netif.bind_env({}, ["10.213.0.12"], NODE) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    # the first resolved address an interface here holds wins, IPv6 included
    assert netif.bind_env({}, ["10.9.9.9", "fd00::12"], NODE) == {"GLOO_SOCKET_IFNAME": "ib0",
                                                                  "NCCL_SOCKET_IFNAME": "ib0"}


def test_a_name_on_loopback_binds_nothing_so_one_node_keeps_its_default():
    assert netif.bind_env({}, ["127.0.0.1"], NODE) == {}
    assert netif.bind_env({}, ["127.0.1.1", "::1"], NODE) == {}
    # loopback first, a real address after it: the real one
    assert netif.bind_env({}, ["127.0.0.1", "10.213.0.12"], NODE)["GLOO_SOCKET_IFNAME"] == "eth0"


def test_an_address_no_interface_holds_or_no_address_binds_nothing():
    assert netif.bind_env({}, ["10.1.2.3"], NODE) == {}
    assert netif.bind_env({}, [], NODE) == {}


def test_the_users_choice_is_kept_and_only_the_unset_variable_is_filled():
    assert netif.bind_env({"GLOO_SOCKET_IFNAME": "ib0"}, ["10.213.0.12"], NODE) == {"NCCL_SOCKET_IFNAME": "eth0"}
    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert netif.bind_env(both, ["10.213.0.12"], NODE) == {}
    # empty counts as unset
    assert netif.bind_env({"NCCL_SOCKET_IFNAME": " "}, ["10.213.0.12"], NODE)["NCCL_SOCKET_IFNAME"] == "eth0"


def test_bind_collectives_on_this_machine_exports_only_what_its_own_name_gives():
    env: dict[str, str] = {"NCCL_SOCKET_IFNAME": "mine"}
    expected = netif.own_interface(netif.resolve(socket.gethostname()), netif.local_interfaces())
    used = netif.bind_collectives(env)
    assert env["NCCL_SOCKET_IFNAME"] == "mine"
    assert env.get("GLOO_SOCKET_IFNAME") == expected and used == expected


def test_the_interface_table_of_this_machine_holds_loopback():
    table = netif.local_interfaces()
    assert netif.interface_holding("127.0.0.1", table) is not None


def test_the_route_to_a_master_names_its_address_and_the_interface_and_source_address():
    route = netif.route_to("127.0.0.1")
    lo = netif.interface_holding("127.0.0.1", netif.local_interfaces())
    assert route == f"127.0.0.1 from interface {lo} (127.0.0.1) of {socket.gethostname()}"
    assert netif.route_to("localhost").startswith("localhost = ")
    assert netif.route_to("no-such-host.invalid") == f"no-such-host.invalid does not resolve on {socket.gethostname()}"


def test_a_failed_rendezvous_names_the_route_it_took():
    info = LaunchInfo("slurm", 2, 3, 0, "node1", 20042, "42", 0, 2)
    late = RuntimeError("Timed out after 30 seconds waiting for clients.\nmore")
    route = "node1 = 10.213.0.11 from interface eth0 (10.213.0.13) of node3"
    assert str(rendezvous_error(late, info, route)) == (
        "rank 2 cannot rendezvous at node1:20042 (node1 = 10.213.0.11 from interface eth0 (10.213.0.13) of node3): "
        "Timed out after 30 seconds waiting for clients.")


def test_a_peer_address_in_an_error_is_named_by_its_rank_and_host():
    hosts = ["node1", "node2", "node3", "node3"]
    table = {"node1": ["10.213.0.11"], "node2": ["10.213.0.12"], "node3": ["10.213.0.13", "fd00::13"]}
    text = ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.0.13]:41092. This is typically "
            "caused by a remote worker crashing.")
    assert netif.peers_named(text, hosts, table.get) == "node3 (ranks 2, 3)"
    assert netif.peers_named("closed by peer [10.213.0.12]:1", hosts, table.get) == "node2 (rank 1)"
    assert netif.peers_named("closed by peer [fd00::13]:1", hosts, table.get) == "node3 (ranks 2, 3)"
    assert netif.peers_named("closed by peer [10.9.9.9]:1", hosts, table.get) == ""
    assert netif.peers_named("Timed out waiting", hosts, table.get) == ""
    # a peer that vanished mid-read (its node lost): gloo names it after "Read error"
    reset = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[10.213.0.13]:56513: Connection reset by peer. This is typically caused by a remote worker hanging")
    assert netif.peers_named(reset, hosts, table.get) == "node3 (ranks 2, 3)"
    assert netif.peers_named("Write error [10.213.0.12]:7: Broken pipe", hosts, table.get) == "node2 (rank 1)"


def test_a_failure_across_nodes_names_this_ranks_host_and_the_lost_peer(monkeypatch):
    from types import SimpleNamespace

    from hpcnft.run.output import fail_line

    table = {"node1": ["10.213.0.11"], "node2": ["10.213.0.12"], "node3": ["10.213.0.13"]}
    monkeypatch.setattr(netif, "resolve", lambda host: table.get(host, []))
    topo = SimpleNamespace(rank=1, role="train", hosts=["node1", "node2", "node3"])
    e = RuntimeError("[pair.cc:553] Connection closed by peer [10.213.0.13]:41092. This is typically caused")
    assert fail_line(topo, e) == ("rank 1 (train) on node2: RuntimeError: [pair.cc:553] Connection closed by peer "
                                  "[10.213.0.13]:41092. This is typically caused [peer: node3 (rank 2)]")
    # one host: the line stays as it was
    assert fail_line(SimpleNamespace(rank=1, role="train", hosts=["vm"] * 3), e).startswith(
        "rank 1 (train): RuntimeError: ")
