"""Readers audit 4: data that came out silently wrong (a sample's files mixed, records at
the wrong offset, a truncated shard read as whole, 16-bit images saturated, Parquet
nulls turned into NaN, a sample order unlike torchvision's ImageFolder)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from datahelp import tar_of

from ringtrain.data import ImageFolder, RecordDataset, RecordWriter, TarShards, decode_image
from ringtrain.data.imagefolder import IMAGE_EXTENSIONS
from ringtrain.errors import DataError

_tar = tar_of


# ---- WebDataset tar shards -----------------------------------------------------------
@pytest.mark.parametrize(("members", "match"), [
    # a field twice: the second a.jpg overwrote the first (webdataset raises)
    (["a.jpg", "a.cls", "a.jpg", "b.jpg"], "sample 'a' has field 'jpg' twice"),
    # tar without --sort=name: a's label came back as a sample of its own
    (["a.jpg", "b.jpg", "a.cls", "b.cls"], "files of sample 'a' are not next to each other"),
])
def test_tar_shard_breaking_the_grouping_is_an_error(tmp_path: Path, members: list[str],
                                                     match: str) -> None:
    path = _tar(tmp_path / "s.tar", members)
    with pytest.raises(DataError, match=match):
        TarShards([str(path)])


def test_tar_fields_are_lower_cased_as_webdataset_does(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", ["._a.jpg", "a.JPG", "a.Cls", "b.jpg", "b.cls"])
    ds = TarShards([str(path)])
    # "._a.jpg" has no key (webdataset skips it); the fields of a and b are alike
    assert [sorted(ds[i]) for i in range(len(ds))] == [["__key__", "cls", "jpg"]] * 2
    assert TarShards([str(path)], fields="JPG")[0] == {"__key__": "a", "jpg": b"1"}


def test_tar_shard_cut_on_a_member_boundary_is_an_error(tmp_path: Path) -> None:
    whole = _tar(tmp_path / "whole.tar", ["a.jpg", "a.cls", "b.jpg", "b.cls"]).read_bytes()
    # header + data block of a.jpg, a.cls, b.jpg: b's label is gone, every header parses
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[:3 * 1024])
    with pytest.raises(DataError, match="without tar's end-of-archive blocks"):
        TarShards([str(cut)])
    mid = tmp_path / "mid.tar"
    mid.write_bytes(whole[:1024 + 512])  # inside a member's data: says truncated, not "header"
    with pytest.raises(DataError, match=r"it is truncated \(1536 bytes") as err:
        TarShards([str(mid)])
    assert "damaged header" not in str(err.value)


# ---- the record store ----------------------------------------------------------------
def test_record_writer_counts_an_array_by_its_bytes(tmp_path: Path) -> None:
    records = [np.arange(4, dtype=np.float32), memoryview(np.arange(3, dtype=np.int64)),
               np.arange(10, dtype=np.int16)[::2], b"hello"]
    with RecordWriter(tmp_path / "store") as w:
        w.write_many(records)
    ds = RecordDataset(tmp_path / "store", check_records=False)
    # len() of a float32[4] is 4, not 16: every later record was read at the wrong offset
    assert [ds[i] for i in range(4)] == [bytes(memoryview(r).tobytes()) for r in records]
    RecordDataset(tmp_path / "store", verify="full")


# ---- Parquet -------------------------------------------------------------------------
def test_parquet_null_inside_a_fixed_size_list_is_none_not_nan(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra (pyarrow)")
    pq = pytest.importorskip("pyarrow.parquet")
    from ringtrain.data import ParquetDataset

    vec = pa.array([[1, 2], [3, None], [5, 6]], pa.list_(pa.int64(), 2))
    pq.write_table(pa.table({"v": vec}), tmp_path / "a.parquet", row_group_size=2)
    ds = ParquetDataset(str(tmp_path / "a.parquet"))
    # the null was NaN and the whole row group float ([1., 2.], [3., nan])
    assert [list(ds[i]["v"]) for i in range(3)] == [[1, 2], [3, None], [5, 6]]
    assert all(type(ds[i]["v"][0]) is not np.float64 for i in range(3))


def test_parquet_file_changed_after_counting_is_an_error(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra (pyarrow)")
    pq = pytest.importorskip("pyarrow.parquet")
    from ringtrain.data import ParquetDataset

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": list(range(4))}), path, row_group_size=2)
    ds = ParquetDataset(str(path))
    pq.write_table(pa.table({"x": list(range(10, 16))}), path, row_group_size=3)
    with pytest.raises(DataError, match="holds 3 rows, but 2 when the dataset was made"):
        ds[0]


# ---- decoding ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_16_bit_greyscale_png_keeps_its_high_byte(mode: str) -> None:
    from PIL import Image

    grey = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64)
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, "PNG")  # mode I;16
    out = decode_image(buf.getvalue(), mode=mode)
    # Pillow's convert clipped at 255: 99% of the pixels white
    want = (grey >> 8).astype(np.uint8)[:, :, None]
    assert out.dtype == np.uint8
    assert np.array_equal(out, np.repeat(want, out.shape[2], axis=2))


# ---- image folders -------------------------------------------------------------------
def test_image_folder_order_and_extensions_match_torchvision(tmp_path: Path) -> None:
    files = ["c/x.jpg", "c/a/1.jpg", "c/a/x/2.jpg", "c/a-b/3.jpg", "c/a b/4.PNG",
             "c/b/5.ppm", "c/b/6.pgm", "d/7.JPEG"]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    ds = ImageFolder(tmp_path, decode=False)
    # torchvision.datasets.folder.make_dataset: sorted(os.walk(...)), then sorted files
    want = []
    for cls in sorted(e.name for e in os.scandir(tmp_path) if e.is_dir()):
        for root, _, names in sorted(os.walk(tmp_path / cls, followlinks=True)):
            want += [os.path.join(root, n) for n in sorted(names)]
    assert [str(ds.path(i)) for i in range(len(ds))] == want
    assert [ds[i][1] for i in range(len(ds))] == [0] * 7 + [1]


def test_image_folder_lists_what_torchvision_lists(tmp_path: Path) -> None:
    for rel in ["cat/1.jpg", "cat/2.gif", "dog/3.png"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    # torchvision's IMG_EXTENSIONS has no .gif: the same folder gives 2 samples there
    assert [ds_path.name for ds_path in map(ImageFolder(tmp_path, decode=False).path, range(2))] \
        == ["1.jpg", "3.png"]
    assert len(ImageFolder(tmp_path, decode=False)) == 2
    assert len(ImageFolder(tmp_path, decode=False, extensions=(*IMAGE_EXTENSIONS, ".gif"))) == 3
    # a class with nothing to read is refused, as torchvision's make_dataset does
    (tmp_path / "emu").mkdir()
    (tmp_path / "emu" / "4.gif").write_bytes(b"x")
    with pytest.raises(DataError, match="emu under .* hold no image files"):
        ImageFolder(tmp_path, decode=False)
