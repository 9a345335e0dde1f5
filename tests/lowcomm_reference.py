"""One-process references for rt.LocalSGD and rt.DiLoCo, written out from the papers.

N workers are N copies of the model in one process, stepped one after the other; the
sync is written as the algorithm states it, with nothing of ringtrain's code (the
fragments are given as explicit index lists, the schedule as the formula):

    every step:  each worker w: zero_grad, loss(batch(step, w)).backward(), inner_w.step()
    fragment f syncs after step s when s % H == ((f + 1) * H // F) % H:
        delta_i = mean_w (synced_i - theta_w,i)                  for i in fragment f
        LocalSGD: theta_i = synced_i - delta_i
        DiLoCo:   theta_i = synced_i; grad_i = delta_i; outer.step() on fragment f only
        every worker takes theta_i; synced_i = theta_i

Also: synchronous data parallelism on the global batch (one model, the N batches
concatenated, mean loss) and per-step parameter averaging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Batch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, worker) -> (x, y)
Loss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def periodic(make_model: Callable[[], torch.nn.Module], batch: Batch, loss: Loss, n: int, steps: int,
             sync_every: int, parts: Sequence[Sequence[int]],
             inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
             outer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
             wire: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
    """LocalSGD (``outer`` None) or DiLoCo; returns the synced parameters at the end and,
    per worker, its parameters after the last step. ``wire``: each worker's change is
    rounded to this dtype before the mean (what compression does, up to the sum's order)."""
    workers = [make_model() for _ in range(n)]
    for w in workers[1:]:
        w.load_state_dict(workers[0].state_dict())
    inners = [inner(list(w.parameters())) for w in workers]
    synced = [p.detach().clone() for p in workers[0].parameters()]
    glob = make_model()
    glob.load_state_dict(workers[0].state_dict())
    glob_params = list(glob.parameters())
    outer_opt = outer(glob_params) if outer is not None else None
    F = len(parts)
    for s in range(1, steps + 1):
        for w, (model, opt) in enumerate(zip(workers, inners, strict=True)):
            x, y = batch(s - 1, w)
            opt.zero_grad()
            loss(model, x, y).backward()
            opt.step()
        for f, part in enumerate(parts):
            if s % sync_every != ((f + 1) * sync_every // F) % sync_every:
                continue
            with torch.no_grad():
                deltas = {}
                for i in part:
                    changes = [synced[i] - list(m.parameters())[i] for m in workers]
                    if wire is not None:
                        changes = [c.to(wire).to(c.dtype) for c in changes]
                    deltas[i] = torch.stack(changes).mean(0)
            if outer_opt is None:
                new = {i: synced[i] - deltas[i] for i in part}
            else:
                with torch.no_grad():
                    for j, p in enumerate(glob_params):
                        p.grad = None
                        if j in deltas:
                            p.copy_(synced[j])
                            p.grad = deltas[j].clone()
                outer_opt.step()
                new = {i: glob_params[i].detach().clone() for i in part}
            with torch.no_grad():
                for i in part:
                    synced[i] = new[i].clone()
                    for m in workers:
                        list(m.parameters())[i].copy_(new[i])
    return synced, [[p.detach().clone() for p in m.parameters()] for m in workers]


def synchronous(make_model: Callable[[], torch.nn.Module], batch: Batch, loss: Loss, n: int, steps: int,
                inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Data parallelism as one process on the global batch: the workers' batches
    concatenated, the mean loss over all of them."""
    model = make_model()
    opt = inner(list(model.parameters()))
    for s in range(steps):
        parts = [batch(s, w) for w in range(n)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        loss(model, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def averaging(make_model: Callable[[], torch.nn.Module], batch: Batch, loss: Loss, n: int, steps: int,
              inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Per-step parameter averaging: every worker steps, then all take the mean."""
    workers = [make_model() for _ in range(n)]
    for w in workers[1:]:
        w.load_state_dict(workers[0].state_dict())
    opts = [inner(list(w.parameters())) for w in workers]
    for s in range(steps):
        for w, (model, opt) in enumerate(zip(workers, opts, strict=True)):
            x, y = batch(s, w)
            opt.zero_grad()
            loss(model, x, y).backward()
            opt.step()
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in workers), strict=True):
                mean = torch.stack([p.detach() for p in ps]).mean(0)
                for p in ps:
                    p.copy_(mean)
    return [p.detach().clone() for p in workers[0].parameters()]
