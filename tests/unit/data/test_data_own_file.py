"""A batch without a slot travels in a shared file of its own (a descriptor on the
socket, not its bytes), and the refill after a batch makes at most the slots asked for."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import torch

from ringtrain.data import workers
from ringtrain.data.collate import unpack
from ringtrain.data.protocol import Oversize, decode
from ringtrain.data.shm import SlotPool


def test_a_batch_in_its_own_file_arrives_whole_and_only_a_descriptor_crosses_the_socket() -> None:
    batch = {"x": torch.arange(3 * 64 * 64 * 16, dtype=torch.float32).reshape(16, 3, 64, 64),
             "y": torch.arange(16), "name": ["a", "b"]}
    here, there = mp.Pipe()
    try:
        workers._send_in_own_file(there, seq=7, slot_id=-1, out=batch)
        msg = decode(here.recv())
        assert isinstance(msg, Oversize) and (msg.seq, msg.slot_id) == (7, -1)
        assert msg.nbytes >= batch["x"].numel() * 4
        fd_message = os.read(here.fileno(), 1 << 20)  # the descriptor's one byte, no array bytes
        assert len(fd_message) <= 1
    finally:
        here.close()
        there.close()


def test_the_receiver_maps_the_file_and_the_batch_is_intact() -> None:
    batch = {"x": torch.randn(8, 3, 32, 32), "y": torch.arange(8)}
    here, there = mp.Pipe()
    try:
        workers._send_in_own_file(there, seq=1, slot_id=3, out=batch)
        msg = decode(here.recv())
        from multiprocessing.reduction import recv_handle

        mm = workers._map_own_file(recv_handle(here))
        got = unpack(msg.spec, np.frombuffer(mm, dtype=np.uint8))
        assert torch.equal(got["x"], batch["x"]) and torch.equal(got["y"], batch["y"])
        del got  # the map lives as long as the batch's arrays do
    finally:
        here.close()
        there.close()


def test_acquire_without_create_hands_out_only_free_slots() -> None:
    pool = SlotPool(4)
    pool.fit(4096, headroom=0.0)
    assert pool.acquire(create=False) is None  # none made yet
    first = pool.acquire()
    assert first is not None and len(pool.slots) == 1
    pool.release(first.id)
    again = pool.acquire(create=False)
    assert again is not None and again.id == first.id and len(pool.slots) == 1
    pool.close()


def test_created_counts_a_replacement_for_a_slot_too_small() -> None:
    # The feed limits how many slots one dispatch may make by this count: a slot that
    # grew (retired, then made again at the new size) is a slot made.
    pool = SlotPool(2)
    pool.fit(4096, headroom=0.0)
    small = pool.acquire()
    assert small is not None and pool.created == 1
    pool.release(small.id)
    pool.fit(1 << 20, headroom=0.0)  # batches got bigger
    big = pool.acquire()
    assert big is not None and big.id != small.id and big.size >= 1 << 20
    assert len(pool.slots) == 1 and pool.created == 2 and pool.retired == [small.id]
    assert pool.acquire(create=False) is None  # the small one is gone, not handed out
    pool.close()
