"""hvd.DistributedOptimizer's gradient_predivide_factor goes with op=Average only, as in
Horovod, which checks it before choosing its Adasum optimizer: op=hvd.Adasum with a
factor is Horovod's ValueError (``pytorch_mnist.py --use-adasum
--gradient-predivide-factor 2`` stops there), not a factor silently ignored."""

from __future__ import annotations

import pytest
import torch

import ringtrain.horovod as hvd


def _wrap(**kw: object) -> object:
    model = torch.nn.Linear(2, 1)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **kw)


@pytest.mark.parametrize("op", [hvd.Adasum, hvd.Sum])
def test_a_factor_with_another_op_is_horovods_error(hvd_one_rank: None, op: int) -> None:
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        _wrap(op=op, gradient_predivide_factor=2.0)


def test_a_factor_with_average_and_adasum_without_one_are_accepted(hvd_one_rank: None) -> None:
    assert isinstance(_wrap(gradient_predivide_factor=2.0), torch.optim.SGD)
    assert isinstance(_wrap(op=hvd.Adasum), torch.optim.SGD)
