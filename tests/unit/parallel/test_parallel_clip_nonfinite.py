"""``Parallel.clip_grad_norm_`` with a NaN gradient scales as torch's clip_grad_norm_ does.

torch multiplies every gradient by ``clamp(max_norm / (nan + 1e-6), max=1)``, NaN: the
whole model's gradients become NaN. The clipping here compared ``coef < 1.0``, False for
NaN, and left every other gradient as it was: the same NaN norm returned, but the next
update moved the finite parameters as if nothing had happened, where torch's run has
NaN everywhere (and a script that checks the norm sees both the same).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ringtrain.parallel import parallelize


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _grads_with_nan(model: nn.Module) -> None:
    x, y = torch.ones(3, 4), torch.zeros(3, 2)
    nn.functional.mse_loss(model(x), y).backward()
    model[0].bias.grad[0] = float("nan")  # type: ignore[index]


def test_a_nan_norm_scales_every_gradient_as_torch_does() -> None:
    plain = _model()
    _grads_with_nan(plain)
    torch_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0))
    par = parallelize(_model(), nn.functional.mse_loss)
    _grads_with_nan(par.module)
    norm = par.clip_grad_norm_(1.0)
    assert math.isnan(norm) and math.isnan(torch_norm)
    for mine, theirs in zip(par.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad.isnan(), theirs.grad.isnan())
        assert bool(theirs.grad.isnan().all())
