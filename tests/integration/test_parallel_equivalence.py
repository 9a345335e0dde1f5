"""Each technique, and all three at once, train exactly what one process trains.

The same model (same seed) and the same global batches, 10 AdamW steps, fp32: every
parameter and every step's loss within 1e-5 of a single-process run. (Sharded and
replicated data parallelism are checked the same way in test_parallel_sharding.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import run_world
from test_parallel_common import (
    SMALL,
    STEPS,
    accumulated_gradients,
    max_difference,
    train,
)

TOLERANCE = 1e-5
#: Tensor parallelism runs every split layer through DTensor, whose per-operation
#: overhead dominates on CPU: two blocks keep the 8-process run short.
TWO_BLOCKS = {**SMALL, "layers": 2}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {}


def _reference(references: dict[str, dict[str, Any]], model: dict[str, int]) -> dict[str, Any]:
    key = repr(sorted(model.items()))
    if key not in references:
        result = train({}, model=model)
        assert result is not None
        references[key] = result
    return references[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "layout", "model"), [
    pytest.param(2, {"pipeline": 2, "microbatches": 4, "schedule": "1f1b"}, SMALL,
                 id="pipeline-2-1f1b"),
    pytest.param(2, {"tensor": 2}, TWO_BLOCKS, id="tensor-2"),
    pytest.param(8, {"pipeline": 2, "tensor": 2, "shard": True, "microbatches": 2,
                     "schedule": "gpipe"}, TWO_BLOCKS, id="pipeline-2-tensor-2-sharded-2"),
])
def test_layout_matches_one_process(ranks: int, layout: dict[str, Any], model: dict[str, int],
                                    references: dict[str, dict[str, Any]]) -> None:
    reference = _reference(references, model)
    got = run_world(train, ranks, layout, STEPS, model, timeout=240)[0]
    assert len(got["losses"]) == STEPS
    loss_error = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True))
    param_error = max_difference(got["params"], reference["params"])
    print(f"{got['describe']}: loss error {loss_error:.2e}, parameter error {param_error:.2e}")
    assert loss_error <= TOLERANCE
    assert param_error <= TOLERANCE
    # Training happened: the loss moved.
    assert reference["losses"][-1] < reference["losses"][0] - 0.05
    if layout.get("pipeline", 1) > 1:  # rank 0, the first stage, waited and said so
        assert got["events"].get("pipeline_bubble", 0) >= STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "layout"), [
    pytest.param(2, {"pipeline": 2, "microbatches": 4}, id="pipeline-2"),
    pytest.param(4, {"pipeline": 2, "microbatches": 2, "shard": True, "schedule": "gpipe"},
                 id="pipeline-2-sharded-2"),
])
def test_gradients_accumulated_over_steps_match_one_process(ranks: int,
                                                            layout: dict[str, Any]) -> None:
    """Two step()s and no update: the sum of both batches' gradients, as in one process.

    Before, the schedule divided every .grad by m after each step (scale_grads), the
    first step's gradients too: they came out m times too small (0.21 off, 72%).
    """
    reference = accumulated_gradients({})
    got = run_world(accumulated_gradients, ranks, layout, timeout=240)[0]
    assert reference is not None
    error = max_difference(got, reference)
    print(f"{layout}: largest gradient difference {error:.2e}")
    assert error <= TOLERANCE
