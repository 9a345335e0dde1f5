"""Links and host topology: the alpha and beta of every hop a gradient takes.

A link is described by the alpha-beta (Hockney) model: sending ``m`` bytes costs
``alpha + m / B``. ``B`` is the line rate times the fraction a collective actually
achieves on it (protocol headers, TCP stack, NCCL's pipelining); that fraction is an
assumption per link family, stated here once and used by every prediction:

- RDMA (InfiniBand, RoCE): 0.90. NCCL-tests report allreduce bus bandwidth of about
  11-12 GB/s on 100 Gbit/s InfiniBand (12.5 GB/s line), i.e. 0.88-0.96.
- TCP over Ethernet: 0.80. Kernel TCP with a few streams typically reaches 75-90% of
  the line rate on 10-100 GbE; NCCL's socket transport sits at the low end.
- PCIe 3.0 x16 (15.75 GB/s line): 0.75, i.e. ~12 GB/s, what device-to-device copies
  through a PCIe switch measure (NVIDIA p2pBandwidthLatencyTest).
- NVLink: the NCCL allreduce bus bandwidth of the whole box is given directly.

Alpha is the per-message start-up: ~30 us for kernel TCP, ~5 us for RDMA and NVLink
(NCCL's per-step latency, which exceeds the raw wire latency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringtrain.errors import ConfigError

__all__ = ["Link", "Topology", "LINKS", "INTRA_LINKS", "link", "intra_link", "with_rtt"]

_GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Link:
    """One kind of hop: ``time(m) = alpha_s + m / bandwidth``."""

    name: str
    #: Line rate in bytes/s (what the vendor sells).
    line_rate: float
    #: Fraction of the line rate a collective achieves (see the module docstring).
    efficiency: float
    #: Start-up cost of one message in seconds.
    alpha_s: float
    note: str = ""

    def __post_init__(self) -> None:
        if self.line_rate <= 0:
            raise ConfigError(f"link {self.name!r}: line rate must be > 0, got {self.line_rate}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"link {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.alpha_s < 0:
            raise ConfigError(f"link {self.name!r}: alpha must be >= 0 s, got {self.alpha_s}")

    @property
    def bandwidth(self) -> float:
        """Achieved bytes per second."""
        return self.line_rate * self.efficiency


def _eth(gbit: float, *, rdma: bool = False) -> Link:
    kind = "RoCE" if rdma else "TCP"
    name = f"{gbit:g}gbit" if gbit >= 1 else f"{gbit * 1e3:g}mbit"
    return Link(
        name + ("-roce" if rdma else ""), gbit * _GBIT,
        0.90 if rdma else 0.80, 5e-6 if rdma else 30e-6, f"{gbit:g} Gbit/s Ethernet, {kind}",
    )


#: Inter-host networks by the name the CLI takes (``--network``).
LINKS: dict[str, Link] = {
    **{lk.name: lk for lk in (_eth(g) for g in (1, 10, 25, 40, 50, 100, 200, 400))},
    **{lk.name: lk for lk in (_eth(g, rdma=True) for g in (25, 50, 100, 200, 400))},
    # InfiniBand data rates after encoding: FDR 4x 54.5 Gbit/s (64b/66b), EDR 100, HDR 200.
    "ib-fdr": Link("ib-fdr", 54.5 * _GBIT, 0.90, 5e-6, "FDR InfiniBand 4x, 56 Gbit/s signalling"),
    "ib-edr": Link("ib-edr", 100 * _GBIT, 0.90, 5e-6, "EDR InfiniBand, 100 Gbit/s"),
    "ib-hdr": Link("ib-hdr", 200 * _GBIT, 0.90, 5e-6, "HDR InfiniBand, 200 Gbit/s"),
    # DGX-1 hosts have four EDR ports; NCCL drives them as four parallel rings.
    "4x-ib-edr": Link("4x-ib-edr", 400 * _GBIT, 0.90, 5e-6, "4 x EDR InfiniBand per host (DGX-1)"),
    # Gloo between processes of one host over 127.0.0.1, as `ringtrain plan --calibrate`
    # fitted it on the 2-core CI machine (docs/plan.md: alpha 149-199 us, B 1.0-1.75 GB/s).
    "loopback": Link("loopback", 1.1e9, 1.0, 190e-6, "Gloo over 127.0.0.1 on one host (fitted)"),
}

#: Links inside one host by the name the CLI takes (``--intra``).
INTRA_LINKS: dict[str, Link] = {
    "pcie3": Link("pcie3", 15.75e9, 0.75, 5e-6, "PCIe 3.0 x16 through a switch"),
    "pcie4": Link("pcie4", 31.5e9, 0.75, 5e-6, "PCIe 4.0 x16 through a switch"),
    # NCCL allreduce bus bandwidth inside a DGX-1 (hybrid cube mesh), as NVIDIA reported
    # for NCCL 2: ~40 GB/s with P100 (NVLink 1), ~130 GB/s with V100 (NVLink 2).
    "nvlink-p100": Link("nvlink-p100", 40e9, 1.0, 5e-6, "DGX-1 P100 NVLink, NCCL busbw"),
    "nvlink-v100": Link("nvlink-v100", 130e9, 1.0, 5e-6, "DGX-1V V100 NVLink, NCCL busbw"),
    "nvlink-a100": Link("nvlink-a100", 230e9, 1.0, 5e-6, "DGX A100 NVSwitch, NCCL busbw"),
    "nvlink-h100": Link("nvlink-h100", 360e9, 1.0, 5e-6, "DGX H100 NVSwitch, NCCL busbw"),
}


def _lookup(table: dict[str, Link], name: str, flag: str) -> Link:
    key = name.strip().lower()
    if key not in table:
        raise ConfigError(
            f"unknown {flag} {name!r}; choose one of: {', '.join(table)}"
            f" (or give a number of Gbit/s, e.g. {flag} 40)"
        )
    return table[key]


def _custom(value: str, flag: str) -> Link | None:
    text = value.strip().lower()
    scale = 1e-3 if text.endswith("mbit") else 1.0  # "100mbit": a slow link between sites
    text = text.removesuffix("mbit").removesuffix("gbit")
    try:
        gbit = float(text) * scale
    except ValueError:
        return None
    if not 0 < gbit < math.inf:  # also NaN, which float() accepts
        raise ConfigError(f"{flag} must be a positive number of Gbit/s (or Mbit/s: 100mbit), got {value!r}")
    return _eth(gbit)


def link(name: str) -> Link:
    """The inter-host link called ``name`` (a preset, or a number of Gbit/s or Mbit/s over TCP: ``25gbit``, ``100mbit``)."""
    return _custom(name, "--network") or _lookup(LINKS, name, "--network")


def with_rtt(lk: Link, rtt_ms: float) -> Link:
    """``lk`` with a per-message start-up of one round trip of ``rtt_ms``: a link with a
    fixed delay (another rack or site) pays it on every message, and Gloo's sender waits
    for the receiver's ready note first (a round trip; on tc-shaped links with 1 ms each
    way `ringtrain plan --calibrate` fitted alpha 2.0-2.4 ms, docs/plan.md)."""
    if not rtt_ms >= 0:
        raise ConfigError(f"--rtt-ms must be >= 0, got {rtt_ms}")
    return Link(f"{lk.name}+{rtt_ms:g}ms", lk.line_rate, lk.efficiency, max(lk.alpha_s, rtt_ms / 1e3),
                f"{lk.note}, {rtt_ms:g} ms round trip")


def intra_link(name: str) -> Link:
    """The intra-host link called ``name`` (a preset, or a number of Gbit/s)."""
    return _custom(name, "--intra") or _lookup(INTRA_LINKS, name, "--intra")


@dataclass(frozen=True)
class Topology:
    """How GPUs are grouped into hosts and what connects them."""

    gpus_per_host: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ConfigError(f"--gpus-per-host must be >= 1, got {self.gpus_per_host}")

    def hosts(self, gpus: int) -> int:
        """Number of hosts ``gpus`` GPUs occupy (hosts are filled one by one)."""
        return -(-gpus // self.gpus_per_host)

    def local(self, gpus: int) -> int:
        """GPUs per host actually used by a job of ``gpus`` GPUs."""
        return min(gpus, self.gpus_per_host)
