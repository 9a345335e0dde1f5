"""Two "hosts" for the image's multi-host test: network namespaces on a private bridge.

Names and addresses differ from tests/hosts/setup_netns.sh (rt-h*, 10.213.57.0/24) so
both can exist at once: namespaces rtc-h1, rtc-h2 with 10.213.58.11 and .12 on the
bridge rtc-br0 (10.213.58.1). No packet leaves the bridge. Root only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

NET = "10.213.58"
BRIDGE = "rtc-br0"
NAMESPACES = ("rtc-h1", "rtc-h2")
ADDRS = tuple(f"{NET}.{11 + i}" for i in range(len(NAMESPACES)))

__all__ = ["ADDRS", "NAMESPACES", "down", "up"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def up() -> None:
    """Create the bridge and both namespaces; skip where the kernel refuses them."""
    down()
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for ns, addr in zip(NAMESPACES, ADDRS, strict=False):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"{ns}-br", "type", "veth", "peer", "name", f"{ns}-in")
            _ip("link", "set", f"{ns}-in", "netns", ns)
            _ip("-n", ns, "link", "set", f"{ns}-in", "name", "eth0")
            _ip("link", "set", f"{ns}-br", "master", BRIDGE)
            _ip("link", "set", f"{ns}-br", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
    except (RuntimeError, FileNotFoundError) as exc:
        down()
        pytest.skip(f"network namespaces are refused here (the multi-host case needs them): {exc}")
    # Bridged frames must not go through the host firewall (as setup_netns.sh does).
    knob = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if knob.exists():
        try:
            knob.write_text("0")
        except OSError:
            pass


def pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def down() -> None:
    """Stop every process in the namespaces, then remove them and the bridge."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for ns in NAMESPACES:
            for pid in pids(ns):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        while any(pids(ns) for ns in NAMESPACES) and time.monotonic() < deadline:
            time.sleep(0.1)
    for ns in NAMESPACES:
        _ip("link", "del", f"{ns}-br", check=False)
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", BRIDGE, check=False)
