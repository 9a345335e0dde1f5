from __future__ import annotations

import pytest
import torch

import ringtrain as rt
from ringtrain.errors import ConfigError
from ringtrain.schedule import warmup_factor


def test_scale_lr_without_init_is_the_single_worker_rate() -> None:
    assert rt.scale_lr(0.1) == pytest.approx(0.1)
    assert rt.scale_lr(0.1, factor=32) == pytest.approx(3.2)  # e.g. global batch 8192 / 256
    with pytest.raises(ConfigError):
        rt.scale_lr(0.0)


def test_warmup_ramps_linearly_to_the_scaled_rate() -> None:
    assert [warmup_factor(s, 4, 0.25) for s in range(6)] == [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0]
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.8)
    sched = rt.warmup(opt, warmup_steps=4, start_factor=0.25)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.2, 0.35, 0.5, 0.65, 0.8, 0.8])
    with pytest.raises(ConfigError):
        rt.warmup(opt, warmup_steps=3, start_factor=0.0)


def test_compression_wire_dtypes_and_round_trip_error() -> None:
    x = torch.randn(10_000)
    for comp, bits in ((rt.Compression.fp16, 11), (rt.Compression.bf16, 8)):
        wire, ctx = comp.compress(x)
        assert wire.element_size() == 2
        back = comp.decompress(wire, ctx)
        assert back.dtype == torch.float32
        # Relative rounding error is at most half a unit in the last kept bit.
        rel = ((back - x).abs() / x.abs().clamp_min(1e-3)).max().item()
        assert rel <= 2.0 ** -bits
    ints = torch.arange(5)
    assert rt.Compression.fp16.compress(ints)[0].dtype == torch.int64  # only floats are narrowed
