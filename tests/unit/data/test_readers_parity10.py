"""Readers audit 10: a damaged tar header, webdataset's metadata members and split of
names that start with a dot, a field that would replace ``__key__``, and a record
store whose index (not its payload) is damaged under ``verify="full"``, and
torchvision's ``ImageFolder`` arguments and attributes; Parquet files of different columns."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from datahelp import tar_of

from ringtrain.data import ImageFolder, ParquetDataset, RecordDataset, RecordWriter, TarShards
from ringtrain.errors import DataError


def _tar(path: Path, members: list[str], fmt: int = tarfile.GNU_FORMAT) -> Path:
    return tar_of(path, members, fmt)


def _samples(path: Path) -> list[tuple[str, list[str]]]:
    ds = TarShards([str(path)])
    return [(ds[i]["__key__"], sorted(f for f in ds[i] if f != "__key__")) for i in range(len(ds))]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize(("offset", "what"), [(3, "a digit of the name"), (8, "the field"),
                                              (124 + 9, "the size")])
def test_tar_header_with_a_flipped_byte_is_an_error(tmp_path: Path, fmt: int, offset: int,
                                                    what: str) -> None:
    # A flipped byte in a ustar header was read without a word: sample 000001's label
    # became field "clr", a new sample "000101", or a 9-byte label b"3\0\0...".
    path = _tar(tmp_path / "s.tar", [f"{k:06d}.{e}" for k in range(3) for e in ("jpg", "cls")],
                fmt)
    assert _samples(path) == [(f"{k:06d}", ["cls", "jpg"]) for k in range(3)]
    raw = bytearray(path.read_bytes())
    head = 3 * 1024  # the 4th member, 000001.cls (each member: a header and a data block)
    assert raw[head:head + 10] == b"000001.cls"
    raw[head + offset] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"bad header checksum at byte {head}"):
        TarShards([str(path)])


def test_tar_members_split_as_webdataset_does(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", [
        "__meta__", "__index__/x.json",   # metadata members: webdataset skips them
        "a.jpg", "a.cls",
        "x.y/.h.jpg",                      # no key by webdataset's split: skipped
        "d/.DS_Store",                     # its split: key "d/", field "ds_store"
        "__x__.jpg",                       # not metadata: sample "__x__"
    ])
    assert _samples(path) == [("a", ["cls", "jpg"]), ("d/", ["ds_store"]), ("__x__", ["jpg"])]
    # the same samples from webdataset itself, where it is installed
    wds = pytest.importorskip("webdataset")
    theirs = [(s["__key__"], sorted(f for f in s if not f.startswith("__")))
              for s in wds.WebDataset(str(path), shardshuffle=False)]
    assert theirs == _samples(path)


@pytest.mark.parametrize("name", ["a.__key__", "a.__URL__"])
def test_tar_field_that_would_replace_the_key_is_an_error(tmp_path: Path, name: str) -> None:
    # "a.__key__" replaced the sample's key with the file's bytes (webdataset raises)
    path = _tar(tmp_path / "s.tar", ["a.jpg", name])
    with pytest.raises(DataError, match="would replace the sample's own"):
        TarShards([str(path)])


def test_full_verify_finds_a_damaged_record_index(tmp_path: Path) -> None:
    recs = [bytes([k]) * (10 + k) for k in range(20)]
    with RecordWriter(tmp_path / "store", shard_records=10) as w:
        w.write_many(recs)
    idx = tmp_path / "store" / "shard-00001.idx"
    raw = bytearray(idx.read_bytes())
    raw[32 + 8 * 4] ^= 0x02  # offsets[4] of shard 1 (after a 32-byte header): still increasing
    idx.write_bytes(bytes(raw))
    # The payload's crc32 still passes, so "full" said the store was sound, and with
    # check_records=False records 13 and 14 came back with the wrong bytes.
    with pytest.raises(DataError, match=r"record 13 \(record 3 of shard .*shard-00001.rec"):
        RecordDataset(tmp_path / "store", verify="full", check_records=False)


def test_image_folder_has_torchvisions_arguments_and_attributes(tmp_path: Path) -> None:
    from PIL import Image

    for rel in ["cat/b.png", "cat/sub/a.png", "cat/skip.png", "dog/a.png", "dog/notes.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (2, 2)).save(tmp_path / rel, format="PNG")
    (tmp_path / "emu").mkdir()
    ds = ImageFolder(tmp_path, allow_empty=True)  # emu keeps index 1, with no samples
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert ds.targets == [0, 0, 0, 1]
    assert ds.samples == ds.imgs == [(str(tmp_path / p), t) for p, t in [
        ("cat/b.png", 0), ("cat/skip.png", 0), ("cat/sub/a.png", 0), ("dog/a.png", 1)]]
    # is_valid_file decides instead of the extensions (torchvision passes the path)
    picked = ImageFolder(tmp_path, is_valid_file=lambda p: "skip" not in p, allow_empty=True)
    assert [Path(p).name for p, _ in picked.samples] == ["b.png", "a.png", "a.png", "notes.txt"]
    with pytest.raises(DataError, match="not both"):
        ImageFolder(tmp_path, extensions=".png", is_valid_file=lambda p: True)
    with pytest.raises(DataError, match="emu under .* allow_empty=True"):
        ImageFolder(tmp_path)


def test_parquet_files_with_different_columns_are_refused_unless_columns_are_named(tmp_path: Path) -> None:
    # Their rows had different keys; the default collate takes a batch's first row's keys,
    # so a column that row lacked was dropped for the whole batch without a word.
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra (pyarrow)")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"x": [1, 2], "y": [3, 4]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"y": [5, 6], "x": [7, 8], "z": [0, 0]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"y": [9], "x": [10]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"different columns .*pass columns= with the ones every file has \(\['x', 'y'\]\)"):
        ParquetDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    named = ParquetDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], columns=["x", "y"])
    assert [sorted(named[i]) for i in range(len(named))] == [["x", "y"]] * 4
    same = ParquetDataset([str(tmp_path / "a.parquet"), str(tmp_path / "c.parquet")])  # order aside
    assert [int(same[i]["x"]) for i in range(len(same))] == [1, 2, 10]
