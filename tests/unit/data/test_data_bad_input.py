"""Bad input to the data pipeline and to Resumable: one line from ringtrain's own error
types that names the problem and a fix, never a wrong result (found by an audit)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import ringtrain as rt
from ringtrain.errors import CheckpointError, DataError


def _jpeg() -> bytes:
    y, x = np.mgrid[0:240, 0:320]
    arr = np.stack([x * 255 // 320, y * 255 // 240, (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_a_truncated_jpeg_is_refused_not_filled_with_grey() -> None:
    # Before, the region decoder took libjpeg-turbo's "premature end" warning as success
    # and returned the missing rows as flat 128 (a crop of the lower half: all grey).
    cut = _jpeg()[:len(_jpeg()) // 2]
    crop = rt.data.DecodeCrop(64, flip=0.0)
    for box in ((0, 0, 320, 240), (0, 160, 320, 80)):
        with pytest.raises(DataError, match="truncated"):
            crop.apply(cut, box=box)
    with pytest.raises(DataError, match="truncated"):
        rt.data.decode_image(cut)


@pytest.mark.parametrize(("data", "words"), [
    (b"", "the file is empty (0 bytes)"),
    (b"hello world", "not an image Pillow can read (11 bytes starting b'hello wo')"),
])
def test_bytes_that_are_no_image_say_what_they_are(data: bytes, words: str) -> None:
    with pytest.raises(DataError, match=words.replace("(", r"\(").replace(")", r"\)")):
        rt.data.decode_image(data)
    with pytest.raises(DataError, match="leave the file out|leave it out"):
        rt.data.DecodeCrop(32).apply(data, box=(0, 0, 1, 1))


def test_the_photo_pipeline_names_the_bad_file_and_a_file_gone_since_listing(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(_jpeg())
    (tmp_path / "cat" / "b.jpg").write_bytes(b"not a photo")
    ds = rt.data.ImageFolder(tmp_path, decode=False, transform=rt.data.DecodeCrop(32))
    assert ds[0][0].shape == (3, 32, 32)
    with pytest.raises(DataError, match=r"cannot decode .*b\.jpg: not an image"):
        ds[1]
    (tmp_path / "cat" / "a.jpg").unlink()
    with pytest.raises(DataError, match=r"cannot read .*a\.jpg: No such file .* build it again"):
        ds[0]


def _loader(**kw: object) -> rt.data.Loader:
    return rt.data.Loader(list(range(20)), batch_size=4, shuffle=True, seed=0, num_workers=0, device="cpu",
                          **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "words"), [
    ({"timeout": 0}, "timeout must be a number of seconds > 0, or None"),
    ({"timeout": -1}, "timeout must be a number of seconds > 0, or None"),
    ({"timeout": float("nan")}, "timeout must be a number of seconds > 0, or None"),
])
def test_loader_arguments_that_cannot_work_are_refused(kw: dict[str, object], words: str) -> None:
    # A timeout of -1 was taken: every batch then failed blaming the dataset.
    with pytest.raises(DataError, match=words):
        _loader(**kw)
    with pytest.raises(DataError, match="is not a torch device"):
        rt.data.Loader(list(range(4)), batch_size=2, num_workers=0, device="bogus")


def test_a_loader_state_that_is_not_one_says_what_to_pass() -> None:
    good = _loader()
    it = iter(good)
    next(it)
    state = good.state_dict()
    whole = {"model": torch.nn.Linear(300, 300).state_dict(), "loader": state}
    with pytest.raises(DataError) as exc:
        _loader().load_state_dict(whole)
    text = str(exc.value)
    # Before, the message printed the whole checkpoint (5 KB for one 300x300 layer).
    assert len(text) < 300 and "keys ['loader', 'model']" in text and "state['loader']" in text
    for bad in ({**state, "position": 2.7}, {**state, "position": -8}, {**state, "epoch": "abc"},
                {k: v for k, v in state.items() if k != "epoch"}):
        with pytest.raises(DataError, match="pass what state_dict"):
            _loader().load_state_dict(bad)


class _Sharded:
    """A sharded dataset: two shards of 10 samples."""

    shard_sizes = (10, 10)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("sharded", [False, True])
def test_a_loader_position_past_the_epoch_is_refused(sharded: bool) -> None:
    # A hand-edited position past the end moved silently to the next epoch's start.
    def make() -> rt.data.Loader:
        return rt.data.Loader(_Sharded() if sharded else list(range(20)), batch_size=4, shuffle=True,
                              seed=0, num_workers=0, device="cpu")

    good = make()
    it = iter(good)
    next(it)
    state = good.state_dict()
    end = 20
    with pytest.raises(DataError, match=f"position={end + 1}, past the end"):
        make().load_state_dict({**state, "position": end + 1})
    at_end = make()
    at_end.load_state_dict({**state, "position": end})  # the epoch done: the next one's start
    assert at_end.state_dict()["epoch"] == state["epoch"] + 1


def _resumable(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> object:
    return rt.elastic.Resumable(path, model=model, optimizer=optimizer, every=1)


def test_resumable_stops_on_checkpoints_it_cannot_use(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    saver = rt.elastic.Resumable(tmp_path / "run", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 every=1)
    saver.resume()
    saver.save(5)
    other = torch.nn.Linear(5, 3)
    with pytest.raises(CheckpointError, match=r"holds another model \(weight is \(3, 4\) there, \(3, 5\) here\)"):
        rt.elastic.Resumable(tmp_path / "run", model=other).resume()
    before = other.weight.detach().clone()
    assert torch.equal(other.weight, before)  # refused before anything was copied in
    adam_model = torch.nn.Linear(4, 3)
    with pytest.raises(CheckpointError, match="another optimizer's state"):
        rt.elastic.Resumable(tmp_path / "run", model=adam_model,
                             optimizer=torch.optim.Adam(adam_model.parameters())).resume()
    # every checkpoint damaged: before, a silent fresh start (and the next saves pruned them)
    ckpt = next((tmp_path / "run").glob("step-*.ckpt"))
    ckpt.write_bytes(ckpt.read_bytes()[:len(ckpt.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged \(step-000000005\.ckpt\)"):
        rt.elastic.Resumable(tmp_path / "run", model=torch.nn.Linear(4, 3)).resume()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; give Resumable a folder"):
        rt.elastic.Resumable(tmp_path / "afile", model=torch.nn.Linear(4, 3)).resume()
    foreign = tmp_path / "foreign"
    rt.checkpoint.save(foreign / "step-7.ckpt", {"weights": torch.ones(2)})
    with pytest.raises(CheckpointError, match="was not written by Resumable"):
        rt.elastic.Resumable(foreign, model=torch.nn.Linear(4, 3)).resume()
    assert rt.elastic.Resumable(tmp_path / "empty", model=torch.nn.Linear(4, 3)).resume() == 0


def test_a_read_only_file_system_is_a_checkpoint_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, removing the temporary file raised the same OSError again and hid the
    # CheckpointError that names the path.
    import builtins

    real_open = builtins.open

    def read_only(file: object, mode: str = "r", *args: object, **kw: object) -> object:
        if "w" in mode and str(file).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kw)  # type: ignore[call-overload]

    def no_unlink(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(builtins, "open", read_only)
    monkeypatch.setattr(Path, "unlink", no_unlink)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*x\.ckpt.*Read-only"):
        rt.checkpoint.save(tmp_path / "x.ckpt", {"x": torch.ones(2)})
    assert os.path.isdir(tmp_path)


def test_checkpoint_load_of_a_torch_file_or_a_folder_says_what_to_use(tmp_path: Path) -> None:
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="plain torch.save file: load it with torch.load"):
        rt.checkpoint.load(tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="is a directory; .* rt.checkpoint.load_sharded"):
        rt.checkpoint.load(tmp_path)


def test_a_record_writer_on_a_full_disk_leaves_no_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.data.records import RecordWriter

    with pytest.raises(OSError), RecordWriter(tmp_path / "store") as w:
        w.write(b"x" * 10)
        real = w._file
        assert real is not None

        class Full:
            name = real.name

            def close(self) -> None:  # the flush at close meets the full disk again
                real.close()
                raise OSError(errno.ENOSPC, "No space left on device")

        w._file = Full()  # type: ignore[assignment]
        raise OSError(errno.ENOSPC, "No space left on device")
    assert not [p for p in (tmp_path / "store").iterdir() if p.suffix in (".tmp", ".rec")]


def test_a_sharded_save_that_fails_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: torch's multi-line CheckpointException, and the half-written .dcp.tmp-<token>
    # directory stayed (a later save cannot tell that a token's writer is gone).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def full(*_a: object, **_k: object) -> None:
        raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointError, match=r"cannot write sharded checkpoint .*s\.dcp: rank 0: No space left"
                                              r" on device; free space or save elsewhere"):
        rt.checkpoint.save_sharded(tmp_path / "s.dcp", {"w": torch.ones(3)})
    assert list(tmp_path.iterdir()) == []
