"""Shared pieces of the model-parallel tests: the example's GPT, its data, one training run.

``train(layout)`` runs on every rank of a world (or alone, in the test process) and
trains the example's char-level GPT for a few steps on the same global batches of
standard-library source, each data rank taking its contiguous slice of every global
batch. Rank 0 returns the losses, the whole model's parameters (gathered) and the
largest rank's measured state bytes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt_parallel.py"

#: A model small enough for eight processes on two cores.
SMALL = {"block": 16, "layers": 4, "width": 32, "heads": 4}
#: The same with two blocks, for tensor parallelism (DTensor is slow per operation on CPU).
TWO_BLOCKS_MODEL = {**SMALL, "layers": 2}
GLOBAL_BATCH = 8
STEPS = 10
#: Adam turns rounding noise in near-zero gradients into steps of about lr, so the
#: tolerance of a layout-vs-single-process comparison scales with lr; 1e-3 keeps the
#: largest difference near 5e-6 after 10 steps (3e-3 gave 1.4e-5 under tensor=2).
LR = 1e-3


def gpt() -> Any:
    """The example module (loaded once per process)."""
    if "gpt_parallel" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpt_parallel", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpt_parallel"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpt_parallel"]


def global_batches(steps: int, batch: int, block: int, seed: int = 0) -> torch.Tensor:
    """``[steps, batch, block + 1]`` byte windows of standard-library source."""
    g = gpt()
    data = g.windows(g.stdlib_corpus(256 * 1024), block).tensors[0]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data[order[: steps * batch]].view(steps, batch, block + 1).long()


def build(layout: dict[str, Any], model: dict[str, int] | None = None, seed: int = 0) -> Any:
    from ringtrain.parallel import parallelize

    g = gpt()
    torch.manual_seed(seed)
    net = g.GPT(**(model or SMALL))
    return parallelize(net, g.lm_loss, tensor_plan=g.TENSOR_PLAN, **layout)


def local_batch(par: Any, batch: torch.Tensor) -> tuple[Any, Any]:
    """This rank's slice of one global batch, or (None, None) off the first stage."""
    if not par.reads_data:
        return None, None
    n = batch.shape[0] // par.data_size
    mine = batch[par.data_rank * n:(par.data_rank + 1) * n]
    return mine[:, :-1], mine[:, 1:]


def quiet() -> None:
    """Silence torch's notes that do not concern these tests (views out of FSDP modules,
    two all-gathers when the tests gather a 2-D sharded parameter whole)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def train(layout: dict[str, Any], steps: int = STEPS, model: dict[str, int] | None = None,
          batch: int = GLOBAL_BATCH, save: str | None = None) -> dict[str, Any] | None:
    """Train ``steps`` steps; with ``save``, checkpoint there and take one step more."""
    from ringtrain import events

    quiet()
    published: dict[str, int] = {}

    def count(kind: str, t0: float, t1: float, info: dict[str, Any]) -> None:
        published[kind] = published.get(kind, 0) + 1

    events.subscribe(count)  # what the step meter and the doctor would see
    par = build(layout, model)
    opt = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=0.0)
    data = global_batches(steps + 1, batch, (model or SMALL)["block"])
    losses, memory = [], 0
    for step in range(steps):
        x, y = local_batch(par, data[step])
        losses.append(par.step(x, y))
        if step == steps - 1:
            memory = par.state_memory(opt).total
        par.update(opt)
    events.unsubscribe(count)
    params = par.full_parameters()
    next_loss = None
    if save is not None:
        par.save(save, opt)
        next_loss = par.step(*local_batch(par, data[steps]), optimizer=opt)
    worst = torch.tensor(memory, dtype=torch.int64)
    if par.layout.size() > 1:
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    if par.rank != 0:
        return None
    return {"losses": losses, "params": params, "state_bytes": int(worst),
            "next_loss": next_loss, "describe": par.layout.describe(), "events": published}


def resume(path: str, layout: dict[str, Any], steps: int = STEPS,
           batch: int = GLOBAL_BATCH) -> dict[str, Any] | None:
    """Load ``path`` into ``layout`` (other initial values) and take the next step."""
    quiet()
    par = build(layout, seed=1)  # everything must come from the checkpoint
    opt = torch.optim.AdamW(par.parameters(), lr=LR, weight_decay=0.0)
    par.load(path, opt)
    params = par.full_parameters()
    data = global_batches(steps + 1, batch, SMALL["block"])
    next_loss = par.step(*local_batch(par, data[steps]), optimizer=opt)
    return {"params": params, "next_loss": next_loss} if par.rank == 0 else None


def accumulated_gradients(layout: dict[str, Any], calls: int = 2,
                          model: dict[str, int] | None = None,
                          batch: int = GLOBAL_BATCH) -> dict[str, torch.Tensor] | None:
    """Every parameter's gradient, whole, after ``calls`` step()s without an update
    (gradient accumulation over ``calls`` global batches); on rank 0."""
    quiet()
    par = build(layout, model)
    data = global_batches(calls, batch, (model or SMALL)["block"])
    for step in range(calls):
        par.step(*local_batch(par, data[step]))
    mine: dict[str, torch.Tensor] = {}
    for name, p in par.module.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        mine[name] = grad.detach().cpu().clone()
    parts: list[Any] = [mine]
    if par.layout.size() > 1:
        parts = [None] * par.layout.size()
        torch.distributed.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, grad in part.items():
            merged.setdefault(name, grad)
    return merged if par.rank == 0 else None


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bit-identical: {different[:5]}"


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
