"""Turning predictions into text and JSON. Pure: no printing, no files."""

from __future__ import annotations

from typing import Any

from ringtrain.plan.simulate import Scenario, StepBreakdown

__all__ = ["format_header", "format_scaling", "scaling_json"]


def format_header(sc: Scenario, model: str, compute_source: str) -> str:
    """One paragraph saying what is being predicted, from which inputs."""
    topo = sc.topology
    fw = sc.framework
    wire = "fp16" if sc.wire_bytes == 2 else "fp32"
    return "\n".join([
        f"model {model}: {sum(layer.params for layer in sc.layers) / 1e6:.1f}M parameters, "
        f"{sc.gradient_bytes / 1e6:.0f} MB of {wire} gradients per step, batch {sc.batch} per GPU",
        f"single-GPU step {sc.compute_s * 1e3:.1f} ms ({compute_source})",
        f"hosts of {topo.gpus_per_host} GPUs: inside {topo.intra.name} "
        f"({topo.intra.bandwidth / 1e9:.1f} GB/s, alpha {topo.intra.alpha_s * 1e6:.0f} us), "
        f"between {topo.inter.name} ({topo.inter.bandwidth / 1e9:.2f} GB/s, "
        f"alpha {topo.inter.alpha_s * 1e6:.0f} us)",
        f"framework {fw.name}: buckets {_mb(fw.bucket_bytes)}, "
        f"{'overlapped with backward' if fw.overlap else 'after backward'} "
        f"(backward {100 * sc.backward_fraction:.0f}% of the step); "
        f"straggler spread {100 * sc.jitter_cv:.1f}%",
    ])


def _mb(nbytes: float) -> str:
    if nbytes == float("inf"):
        return "unlimited"
    if nbytes == 0:
        return "one per tensor"
    return f"{nbytes / 2**20:g} MB"


def format_scaling(strategy: str, rows: list[StepBreakdown], sc: Scenario) -> str:
    """Table of throughput, efficiency and step breakdown per GPU count."""
    lines = [
        f"strategy {strategy}",
        "   GPUs  hosts   step ms  compute ms  exchange ms  exposed ms  buckets    samples/s  efficiency",
    ]
    for r in rows:
        lines.append(
            f"{r.gpus:7d} {sc.topology.hosts(r.gpus):6d} {r.step_s * 1e3:9.1f} {r.compute_s * 1e3:11.1f} "
            f"{r.comm_s * 1e3:12.1f} {r.exposed_s * 1e3:11.1f} {r.buckets:8d} {r.throughput:12.0f} "
            f"{100 * r.efficiency:10.1f}%"
        )
    return "\n".join(lines)


def scaling_json(results: dict[str, list[StepBreakdown]], sc: Scenario) -> dict[str, Any]:
    """The predictions as plain data (for ``--json``)."""
    return {
        "gradient_bytes": sc.gradient_bytes,
        "single_gpu_step_s": sc.compute_s,
        "gpus_per_host": sc.topology.gpus_per_host,
        "intra": sc.topology.intra.name,
        "network": sc.topology.inter.name,
        "framework": sc.framework.name,
        "jitter_cv": sc.jitter_cv,
        "backward_fraction": sc.backward_fraction,
        "strategies": {
            name: [
                {
                    "gpus": r.gpus, "step_s": r.step_s, "compute_s": r.compute_s, "comm_s": r.comm_s,
                    "exposed_s": r.exposed_s, "buckets": r.buckets, "throughput": r.throughput,
                    "efficiency": r.efficiency,
                }
                for r in rows
            ]
            for name, rows in results.items()
        },
    }
