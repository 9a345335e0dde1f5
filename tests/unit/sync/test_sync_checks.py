"""Pure parts of mismatch detection and stall inspection: the messages users read."""

from __future__ import annotations

import pytest
import torch

from ringtrain.agreement.signature import describe_mismatch, entry
from ringtrain.sync.stall import Arrival, describe_stall, is_peer_failure

MODEL = [entry("fc2.bias", (10,), torch.float32), entry("fc2.weight", (10, 128), torch.float32),
         entry("fc1.bias", (128,), torch.float32), entry("fc1.weight", (128, 784), torch.float32)]


def _with(i: int, **change: object) -> list:
    out = list(MODEL)
    name, shape, dtype = out[i]
    out[i] = entry(change.get("name", name), change.get("shape", shape), change.get("dtype", dtype))
    return out


def test_identical_signatures_pass() -> None:
    assert describe_mismatch({0: MODEL, 1: list(MODEL), 2: list(MODEL)}) is None


def test_shape_mismatch_names_first_differing_tensor_and_ranks() -> None:
    msg = describe_mismatch({0: MODEL, 1: MODEL, 2: _with(2, shape=(64,)), 3: MODEL})
    assert msg is not None
    assert "tensor #2 is 'fc1.bias' [128] float32 on ranks 0, 1, 3 but 'fc1.bias' [64] float32 on rank 2" in msg
    assert "Rank 2 differ" in msg


def test_dtype_mismatch_is_reported() -> None:
    msg = describe_mismatch({0: MODEL, 1: _with(1, dtype=torch.float64)})
    assert msg is not None and "'fc2.weight' [10, 128] float64 on rank 1" in msg


def test_order_and_length_differences() -> None:
    swapped = [MODEL[1], MODEL[0], *MODEL[2:]]
    msg = describe_mismatch({0: MODEL, 1: swapped})
    assert msg is not None and "tensor #0 is 'fc2.bias'" in msg and "'fc2.weight'" in msg
    msg = describe_mismatch({0: MODEL, 1: MODEL[:3]})
    assert msg is not None and "tensor #3" in msg and "nothing (its list ends here) on rank 1" in msg


def test_settings_mismatch_when_tensors_agree() -> None:
    msg = describe_mismatch({0: MODEL, 1: MODEL},
                            {0: {"strategy": "ring"}, 1: {"strategy": "ps"}})
    assert msg is not None and "setting strategy='ring' on rank 0 but 'ps' on rank 1" in msg


def test_message_is_the_same_whatever_the_reading_order() -> None:
    sigs = {0: MODEL, 1: _with(0, shape=(11,)), 2: _with(3, dtype=torch.float16)}
    assert describe_mismatch(sigs) == describe_mismatch(dict(reversed(list(sigs.items()))))


def test_many_groups_are_summarised() -> None:
    sigs = {r: _with(0, shape=(r,)) for r in range(8)}
    msg = describe_mismatch(sigs)
    assert msg is not None and "more groups" in msg


ARR = Arrival(seq=12, name="bucket0[fc2.bias..fc1.weight]", count=4)


def test_stall_lists_missing_ranks_with_their_last_exchange() -> None:
    last = {0: ARR, 1: Arrival(11, "bucket1[conv.weight]", 3), 2: ARR, 3: None}
    msg = describe_stall(0, 4, ARR, last, gone={1}, waited_s=5.0, timeout_s=5.0)
    assert "'bucket0[fc2.bias..fc1.weight]' for the 4th time (exchange #12)" in msg
    assert "within 5 s" in msg and "RINGTRAIN_STALL_TIMEOUT" in msg
    assert "rank 1 (last arrived at 'bucket1[conv.weight]' for the 3rd time (exchange #11); exited)" in msg
    assert "rank 3 (never reached an exchange)" in msg
    assert "rank 2" not in msg  # it arrived


def test_stall_on_peer_failure_and_unreachable_store() -> None:
    msg = describe_stall(1, 2, ARR, None, set(), 0.4, 60, cause="the connection to rank 0 broke")
    assert "because a peer went away (the connection to rank 0 broke)" in msg
    assert "rank 0, which hosts the job's store, cannot be reached" in msg


def test_stall_when_everybody_arrived() -> None:
    msg = describe_stall(0, 2, ARR, {0: ARR, 1: Arrival(13, "later", 1)}, set(), 5, 5)
    assert "every rank reached this exchange" in msg


def test_arrival_round_trips_through_the_store_format() -> None:
    assert Arrival.from_json(ARR.to_json()) == ARR
    assert Arrival(0, "x", 11).label().endswith("11th time (exchange #0)")
    assert Arrival(0, "x", 22).label().endswith("22nd time (exchange #0)")


@pytest.mark.parametrize("text,peer", [
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234", True),
    ("Connection reset by peer", True),
    ("Operation timed out!", False),
    ("Input tensor sizes must be equal", False),
])
def test_peer_failure_classification(text: str, peer: bool) -> None:
    assert is_peer_failure(RuntimeError(text)) is peer
