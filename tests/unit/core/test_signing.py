"""What ringtrain writes to the unauthenticated store is sealed with the job's secret."""

from __future__ import annotations

from ringtrain.env import parse_env
from ringtrain.signing import Signer
from ringtrain.sync.stall import Arrival


def test_sealed_values_open_only_with_the_same_secret_and_key() -> None:
    s = Signer("job-secret")
    sealed = s.seal("last/1", "[3, \"bucket0\", 2]")
    assert s.open("last/1", sealed) == "[3, \"bucket0\", 2]"
    assert s.open("last/2", sealed) is None, "a value cannot be replayed under another key"
    assert Signer("other").open("last/1", sealed) is None
    assert s.open("last/1", "[9, \"forged\", 1]") is None
    assert s.open("last/1", "deadbeef:[9, \"forged\", 1]") is None


def test_without_a_secret_values_are_plain() -> None:
    s = Signer("")
    assert not s.active and s.seal("k", "v") == "v" and s.open("k", b"v") == "v"


def test_the_secret_comes_from_the_launch_environment_and_is_not_shown() -> None:
    env = parse_env({"RINGTRAIN_RANK": "0", "RINGTRAIN_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29500", "RINGTRAIN_JOB_SECRET": "s3cr3t"})
    assert env.secret == "s3cr3t" and "s3cr3t" not in repr(env)


def test_a_forged_stall_report_is_read_as_no_report() -> None:
    seal = Signer("job")
    good = seal.seal("ringtrain/sync/stall/last/1", Arrival(4, "bucket0", 2).to_json())
    assert Arrival.from_json(seal.open("ringtrain/sync/stall/last/1", good) or "") == Arrival(4, "bucket0", 2)
    assert seal.open("ringtrain/sync/stall/last/1", Arrival(99, "x", 1).to_json()) is None
