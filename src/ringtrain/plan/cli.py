"""``ringtrain plan``: predict throughput and scaling efficiency for N GPUs.

Examples::

    ringtrain plan --model resnet50 --gpus 8,16,...,512 --gpus-per-host 4 --network 25gbit
    ringtrain plan --model vgg16 --strategy ring,hierarchical,ps --network 100gbit --plot vgg.png
    ringtrain plan --model custom --params 300M --step-ms 370 --gpus 8,40 --gpus-per-host 8
    ringtrain plan --model custom --params 300M --layers 1 --step-ms 370   # no overlap at all
    ringtrain plan --model custom --module torchvision.models:resnet18 --input-shape 3,224,224 --step-ms 60
    ringtrain plan --lowcomm --model custom --params 1.2M --step-ms 60 --gpus 4 --gpus-per-host 1 \
        --network 100mbit --rtt-ms 2.5   # per-step exchange vs rt.LocalSGD / rt.DiLoCo every H steps
    ringtrain plan --validate        # the published results and the planner's predictions
    ringtrain plan --calibrate       # fit alpha and B of loopback Gloo, check a real step
    ringrun -np 4 -H a,b,c,d ringtrain plan --calibrate   # the same on the job's own network
    ringtrain plan --parallel --params 1.3B --layers 24 --hidden 2048 --heads 16 --seq 2048 \
        --vocab 50257 --global-batch 512 --gpus 64 --gpus-per-host 8 --device-memory 80 \
        --tflops 150 --intra nvlink-a100 --network 200gbit-roce
                                     # model parallelism: recommend a layout (or --layout 2x4x8)

Only :func:`main` prints and turns errors into exit codes; everything it calls is
pure or raises :class:`ringtrain.errors.ConfigError`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ringtrain.argparsing import OneLineParser
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.plan.cost import STRATEGIES, check_strategy
from ringtrain.plan.layers import DEFAULT_CUSTOM_LAYERS, Layer, from_module, from_param_count
from ringtrain.plan.models import MODELS, canonical_model, model_layers, step_time
from ringtrain.plan.network import INTRA_LINKS, LINKS, Topology, intra_link, link, with_rtt
from ringtrain.plan.parallelism import (
    LayoutChoice,
    ModelSpec,
    format_predictions,
    predict,
    recommend,
)
from ringtrain.plan.report import format_header, format_scaling, scaling_json
from ringtrain.plan.simulate import (
    DEFAULT_BACKWARD_FRACTION,
    DEFAULT_JITTER_CV,
    FRAMEWORKS,
    Scenario,
    StepBreakdown,
    scaling,
)

__all__ = ["main", "parse_gpus", "parse_count", "parse_layout", "build_parser", "build_scenario"]

_DEFAULT_GPUS = "1,2,4,8,16,...,512"


def parse_gpus(text: str) -> list[int]:
    """``"8,16,32"`` or ``"8,16,...,512"`` (doubling, or a constant step) to a list of counts."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    hint = "give GPU counts like --gpus 8,16,32 or --gpus 8,16,...,512"
    if not parts:
        raise ConfigError(f"--gpus is empty; {hint}")
    out: list[int] = []
    i = 0
    while i < len(parts):
        if parts[i] in ("...", ".."):
            if len(out) < 2 or i + 1 >= len(parts):
                raise ConfigError(f"--gpus {text!r}: '...' needs two counts before it and one after; {hint}")
            a, b = out[-2], out[-1]
            end = _positive_int(parts[i + 1], text, hint)
            if b > a and b % a == 0:
                nxt = b * (b // a)
                while nxt < end:
                    out.append(nxt)
                    nxt *= b // a
            elif b > a:
                nxt = b + (b - a)
                while nxt < end:
                    out.append(nxt)
                    nxt += b - a
            else:
                raise ConfigError(f"--gpus {text!r}: counts before '...' must increase; {hint}")
            out.append(end)
            i += 2
            continue
        out.append(_positive_int(parts[i], text, hint))
        i += 1
    if sorted(set(out)) != out:
        raise ConfigError(f"--gpus {text!r}: counts must increase without repeats; {hint}")
    return out


def _positive_int(part: str, text: str, hint: str) -> int:
    try:
        value = int(part)
    except ValueError:
        raise ConfigError(f"--gpus {text!r}: {part!r} is not a whole number; {hint}") from None
    if value < 1:
        raise ConfigError(f"--gpus {text!r}: {value} is not a positive count; {hint}")
    return value


def parse_count(text: str) -> int:
    """``"25557032"``, ``"25.6e6"``, ``"300M"``, ``"1.5B"`` to an integer."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgG]?)\s*", text)
    if not m:
        raise ConfigError(f"--params {text!r} is not a count; write e.g. --params 25e6 or --params 300M")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[m.group(2).lower()]
    value = int(round(float(m.group(1)) * scale))
    if value < 1:
        raise ConfigError(f"--params must be at least 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ringtrain plan",
        description="Predict data-parallel throughput, scaling efficiency and step breakdown.",
        epilog=f"networks: {', '.join(LINKS)} (or a number of Gbit/s, 25gbit, or Mbit/s, 100mbit); intra-host: {', '.join(INTRA_LINKS)}",
    )
    p.add_argument("--model", help=f"{', '.join(MODELS)} or custom (default resnet50; custom when "
                   "--params or --module describes the model)")
    p.add_argument("--params", help="custom: parameter count, e.g. 300M")
    p.add_argument("--layers", type=int,
                   help=f"with --params: equal layers whose gradients become ready uniformly through "
                        f"backward (default {DEFAULT_CUSTOM_LAYERS}; 1 = no overlap)")
    p.add_argument("--module", help="custom: 'package.module:factory' returning a torch.nn.Module")
    p.add_argument("--input-shape", help="with --module: one sample's shape, e.g. 3,224,224, to count MACs")
    p.add_argument("--step-ms", type=float, help="measured single-GPU step time (overrides the catalogue)")
    p.add_argument("--backward-fraction", type=float, default=DEFAULT_BACKWARD_FRACTION,
                   help="share of the single-GPU step spent in backward, while gradients become ready "
                        f"(default {DEFAULT_BACKWARD_FRACTION:.3f}; 0 = no overlap)")
    p.add_argument("--gpu", default="p100", help="GPU of the catalogue speeds: p100 or v100 (default p100)")
    p.add_argument("--batch", type=int, default=64, help="samples per GPU per step (default 64)")
    p.add_argument("--gpus", default=_DEFAULT_GPUS, help=f"GPU counts (default {_DEFAULT_GPUS})")
    p.add_argument("--gpus-per-host", type=int, default=4, help="GPUs in one host (default 4)")
    p.add_argument("--network", default="25gbit", help="link between hosts (default 25gbit, TCP)")
    p.add_argument("--intra", default="pcie3", help="link inside a host (default pcie3)")
    p.add_argument("--strategy", default="ring",
                   help=f"comma list of {', '.join(STRATEGIES)}, or all (default ring)")
    p.add_argument("--framework", help=f"{', '.join(FRAMEWORKS)} (default horovod; ddp with --lowcomm)")
    p.add_argument("--bucket-mb", type=float, help="bucket / fusion size in MB (default: the framework's)")
    p.add_argument("--compression", default="none", choices=("none", "fp16"), help="gradient wire format")
    p.add_argument("--ps-shards", type=int, help="parameter servers (default: one per host)")
    p.add_argument("--ps-per-host", action="store_true",
                   help="ps: one worker per host sums its GPUs' gradients before pushing")
    p.add_argument("--inter", choices=("ring", "hd"), help="hierarchical: across-host algorithm (default ring)")
    p.add_argument("--jitter", type=float, default=DEFAULT_JITTER_CV,
                   help=f"straggler spread of one GPU's step time (default {DEFAULT_JITTER_CV})")
    p.add_argument("--baseline-gpus", type=int, default=1, help="efficiency relative to this many GPUs")
    p.add_argument("--plot", help="write a PNG of efficiency vs GPUs per strategy to this path")
    p.add_argument("--json", help="also write the predictions as JSON to this path")
    p.add_argument("--validate", action="store_true", help="print published results vs predictions")
    p.add_argument("--calibrate", action="store_true",
                   help="fit alpha and B of loopback Gloo and check a real 2- and 4-process step; "
                        "started as the ranks of a job (ringrun, torchrun, srun), it fits the job's network")
    p.add_argument("--rtt-ms", type=float,
                   help="round trip between hosts in ms: every message pays it (a slow link's delay)")
    lc = p.add_argument_group("exchanging every H steps (--lowcomm)")
    lc.add_argument("--lowcomm", action="store_true",
                    help="per-step exchange vs rt.LocalSGD / rt.DiLoCo: step cost of each, and where "
                         "exchanging every H steps pays")
    lc.add_argument("--sync-every", help="values of H to show (default 10,50)")
    lc.add_argument("--fragments", type=int, help="DiLoCo fragments (default 1)")
    g = p.add_argument_group("model parallelism (--parallel)")
    g.add_argument("--parallel", action="store_true",
                   help="plan pipeline x tensor x data layouts: per-rank memory, step time, "
                        "bubble; recommends one unless --layout is given")
    g.add_argument("--layout", help="PxTxD: pipeline stages x tensor ranks x data ranks")
    g.add_argument("--shard", action=argparse.BooleanOptionalAction, default=None,
                   help="with --layout: shard state over the data ranks (default yes)")
    g.add_argument("--microbatches", type=int, help="micro-batches per step (default 4 x stages)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe"),
                   help="pipeline schedule (default 1f1b)")
    g.add_argument("--hidden", type=int, help="model width (for activations and tensor traffic)")
    g.add_argument("--heads", type=int, help="attention heads (tensor degree must divide them)")
    g.add_argument("--seq", type=int, help="sequence length in tokens")
    g.add_argument("--vocab", type=int, help="vocabulary (embedding + head stay whole under -t)")
    g.add_argument("--global-batch", type=int, help="samples per step over all ranks")
    g.add_argument("--device-memory", type=float, help="GiB of memory per device")
    g.add_argument("--tflops", type=float,
                   help="achieved TFLOP/s of one device, instead of --step-ms "
                        "(step = 6 x params x tokens / FLOP/s, Kaplan et al. 2020)")
    return p


def _module_layers(spec: str, input_shape: str | None) -> list[Layer]:
    if ":" not in spec:
        raise ConfigError(f"--module {spec!r}: write it as 'package.module:factory'")
    mod_name, attr = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--module {spec!r}: cannot import it ({exc}); check the name and PYTHONPATH") from None
    except Exception as exc:  # the user's module raised while importing: one line, not its traceback
        raise ConfigError(f"--module {spec!r}: importing it raised {type(exc).__name__}: {exc}; "
                          "check that it imports in this environment") from None
    import torch

    try:
        module = factory if isinstance(factory, torch.nn.Module) else factory()
    except Exception as exc:  # the user's factory: report it in one line
        raise ConfigError(f"--module {spec!r}: calling it failed ({exc}); give a factory that needs no arguments") from None
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"--module {spec!r} did not give a torch.nn.Module")
    example = None
    if input_shape:
        try:
            shape = [int(x) for x in input_shape.split(",")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise ConfigError(f"--input-shape {input_shape!r}: write whole numbers >= 1, e.g. 3,224,224")
        example = torch.randn(1, *shape)
    try:
        return from_module(module, example)
    except (RuntimeError, ValueError, TypeError) as exc:  # the model refused the example input
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--module {spec!r} failed on an input of shape {input_shape or 'none given'} "
                          f"({first}); give the shape of one sample with --input-shape") from None


def build_scenario(args: argparse.Namespace, default_framework: str = "horovod") -> tuple[Scenario, str, str]:
    """The scenario the flags describe, its model's name, and where its step time came from."""
    # --params or --module describes a model of the user's own: taking the catalogue's
    # default instead would answer for a model the user never named.
    if args.params and args.module:
        raise ConfigError("--params and --module both describe the model; give one: --params N for "
                          "equal layers, --module package.module:factory for a real one")
    own = "--params" if args.params else "--module" if args.module else None
    model = args.model if args.model is not None else "custom" if own else "resnet50"
    custom = model.strip().lower() == "custom"
    if own and not custom:
        raise ConfigError(f"{own} describes a custom model but --model is {model}; "
                          f"drop --model {model} or pass --model custom")
    if args.layers is not None and not (custom and args.params and not args.module):
        raise ConfigError(
            f"--layers {args.layers} only applies to --model custom --params N; "
            "catalogue and --module models have their own layers"
        )
    if custom:
        if args.module:
            layers = _module_layers(args.module, args.input_shape)
            name = args.module
        elif args.params:
            count = DEFAULT_CUSTOM_LAYERS if args.layers is None else args.layers
            layers = from_param_count(parse_count(args.params), layers=count)
            name = f"custom ({args.params} parameters in {len(layers)} equal layers)"
        else:
            raise ConfigError("--model custom needs --params N or --module package.module:factory")
        if args.step_ms is None:
            raise ConfigError("--model custom needs --step-ms: the measured single-GPU step time in ms")
    else:
        name = canonical_model(model)
        layers = model_layers(name)
    if args.step_ms is not None:
        if args.step_ms <= 0:
            raise ConfigError(f"--step-ms must be > 0, got {args.step_ms}")
        compute, source = args.step_ms / 1e3, "given with --step-ms"
    else:
        compute, source = step_time(args.gpu, name, args.batch)
    framework_name = args.framework if args.framework is not None else default_framework
    if framework_name not in FRAMEWORKS:
        raise ConfigError(f"unknown framework {framework_name!r}; choose one of: {', '.join(FRAMEWORKS)}")
    framework = FRAMEWORKS[framework_name]
    if args.framework is None and default_framework == "ddp":
        # --lowcomm compares against DDP-style buckets; without a framework named, no
        # per-tensor launch cost (the periodic modes pack the whole model into buckets too).
        framework = replace(framework, per_tensor_s=0.0)
    if args.bucket_mb is not None:
        if args.bucket_mb < 0:
            raise ConfigError(f"--bucket-mb must be >= 0, got {args.bucket_mb}")
        framework = replace(framework, bucket_bytes=args.bucket_mb * 2**20)
    inter = link(args.network)
    topo = Topology(args.gpus_per_host, intra_link(args.intra),
                    inter if args.rtt_ms is None else with_rtt(inter, args.rtt_ms))
    sc = Scenario(
        tuple(layers), compute, topo, "ring", framework,
        wire_bytes=2 if args.compression == "fp16" else 4, ps_shards=args.ps_shards,
        ps_per_host=args.ps_per_host,
        inter=args.inter or "ring", backward_fraction=args.backward_fraction, jitter_cv=args.jitter, batch=args.batch,
    )
    return sc, name, source


def _strategies(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return [s for s in STRATEGIES if s != "tree"]
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ConfigError(f"--strategy is empty; choose from: {', '.join(STRATEGIES)}, all")
    for s in names:
        check_strategy(s)
    return names


def _plan(args: argparse.Namespace) -> str:
    sc, name, source = build_scenario(args)
    counts = parse_gpus(args.gpus)
    if args.baseline_gpus < 1:
        raise ConfigError(f"--baseline-gpus must be >= 1, got {args.baseline_gpus}")
    results: dict[str, list[StepBreakdown]] = {}
    for strategy in _strategies(args.strategy):
        results[strategy] = scaling(replace(sc, strategy=strategy), counts, args.baseline_gpus)
    text = [format_header(sc, name, source)]
    text += [format_scaling(s, rows, replace(sc, strategy=s)) for s, rows in results.items()]
    if args.plot:
        from ringtrain.plan.plot import plot_efficiency

        path = plot_efficiency(results, args.plot, f"{name} on {sc.topology.inter.name}")
        text.append(f"wrote {path}")
    if args.json:
        _write_json(args.json, scaling_json(results, sc))
        text.append(f"wrote {args.json}")
    return "\n\n".join(text)


def _plan_lowcomm(args: argparse.Namespace) -> str:
    from ringtrain.plan.lowcomm import format_modes, mode_costs, recommend

    sc, name, source = build_scenario(args, default_framework="ddp")
    if args.strategy not in ("ring", "hd", "hierarchical"):
        raise ConfigError(f"--lowcomm compares allreduce exchanges: --strategy ring, hd or hierarchical, "
                          f"got {args.strategy!r}")
    sc = replace(sc, strategy=args.strategy)
    sync_every = args.sync_every if args.sync_every is not None else "10,50"
    try:
        hs = [int(h) for h in sync_every.split(",") if h.strip()]
    except ValueError:
        raise ConfigError(f"--sync-every {sync_every!r}: give whole numbers, e.g. 10,50") from None
    if not hs or min(hs) < 1:
        raise ConfigError(f"--sync-every {sync_every!r}: give whole numbers >= 1, e.g. 10,50")
    counts = parse_gpus(args.gpus)
    text = [format_header(sc, name, source)]
    rows = []
    for n in counts:
        costs = mode_costs(sc, n, hs, 1 if args.fragments is None else args.fragments)
        advice = recommend(sc, n)
        text.append(format_modes(costs, advice))
        rows += [{**c.__dict__, "exchange_share": c.exchange_share, "pays": advice.pays,
                  "recommended_sync_every": advice.sync_every} for c in costs]
    if args.json:
        _write_json(args.json, rows)
        text.append(f"wrote {args.json}")
    return "\n\n".join(text)


def _check_json_path(path: str) -> Path:
    """Refuse a --json path that cannot be written, before anything is computed or written."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--json {path!r} is a folder; give a file path, e.g. {target / 'plan.json'}")
    if not target.parent.is_dir():
        what = ("is a file, not a folder; choose another path" if target.parent.exists()
                else "does not exist; create it or choose another path")
        raise ConfigError(f"--json: folder {str(target.parent)!r} {what}")
    return target


def _write_json(path: str, data: Any) -> None:
    target = _check_json_path(path)
    try:
        target.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"--json {path!r} cannot be written ({exc.strerror}); choose another path") from None


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"2x4x8"`` -> (pipeline, tensor, data)."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ConfigError(f"--layout {text!r}: write PxTxD with whole numbers >= 1, e.g. 2x4x8 "
                          "(pipeline stages x tensor ranks x data ranks)")
    return values[0], values[1], values[2]


def _plan_parallel(args: argparse.Namespace) -> str:
    if not args.params or args.layers is None:
        raise ConfigError("--parallel needs --params N and --layers L (transformer blocks)")
    spec = ModelSpec(parse_count(args.params), args.layers, args.hidden, args.heads, args.seq,
                     args.vocab)
    if args.gpus == _DEFAULT_GPUS:
        raise ConfigError("--parallel needs --gpus N: the number of devices to lay out")
    counts = parse_gpus(args.gpus)
    if len(counts) != 1:
        raise ConfigError(f"--parallel plans one GPU count at a time, got --gpus {args.gpus}")
    gpus = counts[0]
    if args.global_batch is None:
        raise ConfigError("--parallel needs --global-batch B (samples per step over all ranks)")
    if args.global_batch < 1:
        raise ConfigError(f"--global-batch must be >= 1, got {args.global_batch}")
    if args.step_ms is not None:
        if args.step_ms <= 0:
            raise ConfigError(f"--step-ms must be > 0, got {args.step_ms}")
        compute_s, source = args.step_ms / 1e3, "given with --step-ms"
    elif args.tflops and args.seq:
        compute_s = 6 * spec.params * args.global_batch * args.seq / (args.tflops * 1e12)
        source = f"6 x params x tokens at {args.tflops:g} TFLOP/s"
    else:
        raise ConfigError("--parallel needs --step-ms T (one device, whole global batch) or "
                          "--tflops F with --seq S")
    inter = link(args.network)
    topo = Topology(args.gpus_per_host, intra_link(args.intra),
                    inter if args.rtt_ms is None else with_rtt(inter, args.rtt_ms))
    if args.device_memory is not None and args.device_memory <= 0:
        raise ConfigError(f"--device-memory must be > 0 GiB, got {args.device_memory:g}")
    if args.microbatches is not None and args.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {args.microbatches}")
    memory = args.device_memory * 2**30 if args.device_memory else None
    header = (f"{spec.params / 1e6:.1f}M parameters in {spec.layers} layers, global batch "
              f"{args.global_batch}, single-device step {compute_s:.3f} s ({source}); "
              f"{gpus} devices, {args.gpus_per_host} per host ({topo.intra.name} inside, "
              f"{topo.inter.name} between)")
    if args.layout:
        p, t, d = parse_layout(args.layout)
        if p * t * d != gpus:
            raise ConfigError(f"--layout {args.layout} uses {p * t * d} devices but --gpus is "
                              f"{gpus}; make P x T x D equal --gpus")
        _check_layout(args, spec, p, t, d)
        m = 1 if p == 1 else (args.microbatches or 4 * p)
        lay = LayoutChoice(p, t, d, True if args.shard is None else args.shard, m, args.schedule or "1f1b")
        pred = predict(spec, lay, compute_s=compute_s, global_batch=args.global_batch,
                       topology=topo, device_memory=memory)
        text = format_predictions([pred], header)
        text += (f"\n\npipeline bubble: (p-1)/(m+p-1) = {pred.schedule_bubble:.1%} of the "
                 f"forward+backward, {pred.bubble_share:.1%} of the whole step")
        preds = [pred]
    else:
        if memory is None:
            raise ConfigError("--parallel without --layout recommends one: give "
                              "--device-memory GiB per device")
        preds = recommend(spec, gpus, device_memory=memory, compute_s=compute_s,
                          global_batch=args.global_batch, topology=topo,
                          microbatches=args.microbatches, schedule=args.schedule or "1f1b")
        if not preds:
            return (f"{header}\n\nno layout of {gpus} devices fits {args.device_memory:g} GiB "
                    "per device: add devices, shorten the sequence or the micro-batch, or "
                    "use devices with more memory")
        best = preds[0].layout
        text = format_predictions(preds[:10], header)
        text += (f"\n\nrecommended: --pipeline {best.pipeline} --tensor {best.tensor} "
                 f"({best.data} data ranks, {'sharded' if best.shard else 'replicated'}"
                 + (f", {best.microbatches} micro-batches" if best.pipeline > 1 else "")
                 + f"): {preds[0].step_s * 1e3:.1f} ms per step, "
                 f"{preds[0].memory_bytes / 2**30:.2f} GiB per device")
    if args.json:
        _write_json(args.json, [pr.to_json() for pr in preds])
        text += f"\nwrote {args.json}"
    return text


def _check_layout(args: argparse.Namespace, spec: ModelSpec, p: int, t: int, d: int) -> None:
    """The rules a recommended layout follows, for one the user gives (--layout)."""
    if p > spec.layers:
        raise ConfigError(f"--layout {args.layout}: {p} pipeline stages for {spec.layers} layers; "
                          f"a stage needs at least one layer, so use at most {spec.layers} stages")
    if spec.heads and spec.heads % t:
        raise ConfigError(f"--layout {args.layout}: {t} tensor ranks do not divide --heads {spec.heads}; "
                          "choose a tensor degree that divides the heads")


#: Flags that only one mode reads, and the defaults that mean "not given".
_MODE_FLAGS: dict[str, tuple[str, ...]] = {
    "--parallel": ("layout", "shard", "microbatches", "schedule", "hidden", "heads", "seq", "vocab",
                   "global_batch", "device_memory", "tflops"),
    "--lowcomm": ("sync_every", "fragments"),
}
#: Flags of the data-parallel modes that a mode ignores (beyond _MODE_FLAGS); None: every
#: flag but the mode's own and those listed in _KEEPS.
_IGNORED_BY: dict[str, tuple[str, ...] | None] = {
    "parallel": ("model", "module", "input_shape", "backward_fraction", "gpu", "batch", "strategy",
                 "framework", "bucket_mb", "compression", "ps_shards", "ps_per_host", "inter", "jitter",
                 "baseline_gpus"),
    "lowcomm": ("baseline_gpus", "ps_shards", "ps_per_host"),
    "validate": None,
    "calibrate": None,
}
_KEEPS = {"validate": ("validate",), "calibrate": ("calibrate", "json")}
#: Float flags: every one must be a finite number (NaN and inf pass "> 0" checks).
_FLOAT_FLAGS = ("step_ms", "backward_fraction", "bucket_mb", "jitter", "rtt_ms", "device_memory", "tflops")


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags the chosen mode would ignore, and values that are not numbers."""
    for name in _FLOAT_FLAGS:
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for mode, names in _MODE_FLAGS.items():
        if getattr(args, mode[2:]):
            continue
        given = [n for n in names if getattr(args, n) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} only applies with {mode}; add {mode} or drop {flag}")
    if args.jitter is not None and args.jitter < 0:
        raise ConfigError(f"--jitter must be >= 0 (a spread of step times), got {args.jitter:g}")
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1 sample per GPU, got {args.batch}")
    if args.fragments is not None and args.fragments < 1:
        raise ConfigError(f"--fragments must be >= 1, got {args.fragments}")
    if args.input_shape and not args.module:
        raise ConfigError("--input-shape applies to a --module model (to count its MACs); drop it or add --module")
    if not (args.parallel or args.lowcomm or args.validate or args.calibrate):
        wanted = {s.strip() for s in args.strategy.lower().split(",")}
        if (args.ps_shards is not None or args.ps_per_host) and not wanted & {"ps", "all"}:
            raise ConfigError("--ps-shards and --ps-per-host describe parameter servers; add ps to --strategy "
                              "(e.g. --strategy ring,ps) or drop them")
        if args.inter is not None and not wanted & {"hierarchical", "all"}:
            raise ConfigError("--inter is the across-host algorithm of --strategy hierarchical; add it to "
                              "--strategy or drop --inter")
    if args.validate and args.json:
        raise ConfigError("--validate prints its table and writes no JSON; drop --json")
    _refuse_ignored(args)
    if args.plot and (args.parallel or args.lowcomm):
        raise ConfigError("--plot draws the data-parallel scaling plan; drop it with "
                          f"{'--parallel' if args.parallel else '--lowcomm'}")


def _refuse_ignored(args: argparse.Namespace) -> None:
    """A flag the chosen mode never reads is an error naming it, not a silent no-op."""
    given = {k for k, v in vars(args).items() if v != _DEFAULTS.get(k)}
    mode = next((m for m in _IGNORED_BY if getattr(args, m)), None)
    if mode is not None:
        ignored = _IGNORED_BY[mode]
        extra = sorted(given - set(_KEEPS[mode])) if ignored is None else sorted(given & set(ignored))
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise ConfigError(f"{flag} has no effect with --{mode}; drop {flag}")
    if "gpu" in given and args.step_ms is not None:
        raise ConfigError("--gpu picks the catalogue's step time, and --step-ms replaces it; drop one")


_DEFAULTS = vars(build_parser().parse_args([]))


def _validate() -> str:
    from ringtrain.plan.validation import TOLERANCE_PP, format_table, run

    rows = run()
    held = sum(r.holds for r in rows if r.case.role == "validation")
    total = sum(r.case.role == "validation" for r in rows)
    lines = [format_table(rows), "", f"{held} of {total} predictions within {TOLERANCE_PP:g} points."]
    for r in rows:
        if r.case.known_gap:
            lines.append(f"- {r.case.key}: {r.case.known_gap}")
    return "\n".join(lines)


def _calibrate(args: argparse.Namespace) -> str:
    import os

    from ringtrain.env import parse_env
    from ringtrain.plan.calibrate import format_calibration, run_calibration, run_calibration_in_job

    launched = parse_env(os.environ)
    if launched.size > 1:  # started as the ranks of a job: measure its own network
        found = run_calibration_in_job()
        if found is None:
            return f"rank {launched.rank}: calibration measured; rank 0 reports"
        cal = found
    else:
        cal = run_calibration()
    if args.json:
        _write_json(args.json, cal.to_json())
    return format_calibration(cal)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ringtrain plan``; returns the exit code."""
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        _check_flags(args)
        if args.json:  # before --plot's file is written, so a bad --json leaves no file behind
            _check_json_path(args.json)
        if args.parallel:
            out = _plan_parallel(args)
        elif args.lowcomm:
            out = _plan_lowcomm(args)
        elif args.validate:
            out = _validate()
        elif args.calibrate:
            out = _calibrate(args)
        else:
            out = _plan(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ConfigError as exc:
        print(f"ringtrain plan: error: {exc}", file=sys.stderr)
        return 2
    except RingtrainError as exc:
        print(f"ringtrain plan: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
