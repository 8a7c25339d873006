"""choose_gloo_interface: when vldist sets GLOO_SOCKET_IFNAME, and when it leaves gloo alone (the
interface it picks between real hosts: tests/integration/test_multinode.py)."""

from vldist.launch.network import choose_gloo_interface, interface_towards


def test_a_users_choice_one_host_and_a_loopback_master_are_left_alone():
    assert choose_gloo_interface({"GLOO_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "198.18.0.1", "WORLD_SIZE": "4"}) is None
    one_host = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert choose_gloo_interface(one_host) is None and "GLOO_SOCKET_IFNAME" not in one_host
    loopback = {"MASTER_ADDR": "localhost", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert choose_gloo_interface(loopback) is None and "GLOO_SOCKET_IFNAME" not in loopback
    assert choose_gloo_interface({"WORLD_SIZE": "4"}) is None  # no rendezvous host named


def test_the_route_to_a_loopback_address_is_no_interface_to_choose():
    assert interface_towards("127.0.0.1") is None and interface_towards("127.0.1.1") is None
