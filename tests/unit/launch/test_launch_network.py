"""Address helpers and the host agent's per-host variables (no packets sent)."""

from __future__ import annotations

from ringtrain import addresses
from ringtrain.launch.agent import info, worker_extras


def test_loopback_is_recognised() -> None:
    assert addresses.is_loopback("127.0.0.1") and addresses.is_loopback("::1")
    assert addresses.is_loopback("localhost") and not addresses.is_loopback("10.0.0.1")


def test_lo_has_the_loopback_address() -> None:
    assert addresses.address_of_interface("lo") == "127.0.0.1"
    assert addresses.interface_of_address("127.0.0.1") == "lo"
    assert addresses.address_of_interface("no-such-if0") is None


def test_route_to_loopback_comes_from_loopback() -> None:
    assert addresses.source_address_for("127.0.0.1") == "127.0.0.1"


def test_resolve_passes_addresses_through() -> None:
    assert addresses.resolve("10.1.2.3") == "10.1.2.3"
    assert addresses.resolve("localhost") in ("127.0.0.1", "127.0.1.1")


def test_agent_sets_threads_from_its_own_cores() -> None:
    assert worker_extras({}, local_size=4, cpus=16)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in worker_extras({"OMP_NUM_THREADS": "3"}, 4, 16)


def test_agent_picks_the_interface_that_routes_to_rank0() -> None:
    extra = worker_extras({"MASTER_ADDR": "127.0.0.1"}, 1, 1)
    assert "GLOO_SOCKET_IFNAME" not in extra  # loopback: the runtime confines it to lo itself
    lo_addr = addresses.address_of_interface("lo")
    assert lo_addr is not None
    # A non-loopback rank 0 address owned by this host routes through its own interface.
    for name, addr in addresses.interface_addresses().items():
        if name != "lo":
            assert worker_extras({"MASTER_ADDR": addr}, 1, 1)["GLOO_SOCKET_IFNAME"] == name
            break
    assert worker_extras({"MASTER_ADDR": "10.9.9.9", "GLOO_SOCKET_IFNAME": "x"}, 1, 1).get(
        "GLOO_SOCKET_IFNAME") is None  # the user's choice stands


def test_agent_info_lists_interfaces_and_cores() -> None:
    found = info()
    assert found["ifaces"]["lo"] == "127.0.0.1" and found["cpus"] >= 1
