"""The meter and timeline on two real Gloo ranks with DistributedOptimizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from ringtest import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "observe"))
from observe_trace_check import check_trace  # noqa: E402


def _train(timeline: str) -> dict[str, Any]:
    import time

    import torch

    import ringtrain as rt
    from ringtrain import observe

    observe.start(timeline=timeline, progress=False, warmup=1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), fusion_mb=0.002)

    def batches():  # rank 1 prepares its batches slowly
        for _ in range(6):
            time.sleep(0.02 if rt.rank() == 1 else 0.0)
            yield torch.randn(8, 32), torch.randn(8, 4)

    for x, y in observe.instrument(batches()):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    summary = observe.summary()
    observe.flush()
    return summary


@pytest.mark.timeout(90)
def test_two_ranks_meter_and_one_merged_timeline(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    summaries = run_world(_train, 2, str(path), timeout=80)
    for rank, s in enumerate(summaries):
        json.dumps(s)  # plain data
        assert s["rank"] == rank and s["size"] == 2 and s["steps"] == 5
        assert sum(s["shares"].values()) == pytest.approx(1.0)
        assert s["exchange"]["buckets_per_step"] >= 2  # fusion_mb=0.002 splits the model
        assert s["samples_per_s"] > 0
    # Rank 1 waits for its data; rank 0 waits for rank 1 at the exchange.
    assert summaries[1]["shares"]["data_wait"] > summaries[0]["shares"]["data_wait"]
    assert summaries[0]["shares"]["exchange_wait"] > summaries[1]["shares"]["exchange_wait"]

    for rank in range(2):
        assert check_trace(json.loads((tmp_path / f"trace.rank{rank}.json").read_text())) == []
    merged = json.loads(path.read_text())
    assert check_trace(merged) == []
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    exchanges = [e for e in spans if e["cat"] == "exchange"]
    assert exchanges and all(e["args"]["bytes"] > 0 and e["args"]["tensors"] for e in exchanges)
    assert {"0.weight", "0.bias"} & {t for e in exchanges for t in e["args"]["tensors"]}
