"""Readers for the formats people have: image folders, WebDataset tars, Parquet, records."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ringtrain.data import (
    ImageFolder,
    Loader,
    ParquetDataset,
    RecordShards,
    RecordWriter,
    TarShards,
    decode_image,
)
from ringtrain.data.decode import jpeg_decoders
from ringtrain.data.tar import expand_braces
from ringtrain.errors import DataError

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the dev extra)")


def _image(k: int, size: int = 24) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    base = (np.sin(xx / (2 + k % 5)) + np.cos(yy / 3)) * 60 + 128
    return np.stack([base, base[::-1], np.full_like(base, 10 * k % 255)], -1).astype(np.uint8)


def _encode(img: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


# ---- decoding ------------------------------------------------------------------------
def test_png_decodes_exactly_and_jpeg_closely_with_every_decoder() -> None:
    img = _image(3)
    assert np.array_equal(decode_image(_encode(img, "PNG")), img)
    jpeg = _encode(img, "JPEG")
    outs = {d: decode_image(jpeg, decoder=d) for d in jpeg_decoders()}
    assert "pillow" in outs
    for out in outs.values():
        assert out.shape == img.shape and out.dtype == np.uint8
        assert np.abs(out.astype(int) - img).mean() < 6  # lossy, but the same picture
    if "simplejpeg" in outs:  # both are libjpeg-turbo underneath: (nearly) the same pixels
        assert np.abs(outs["simplejpeg"].astype(int) - outs["pillow"]).max() <= 2
    grey = decode_image(jpeg, mode="L")
    assert grey.shape == (24, 24, 1)
    with pytest.raises(DataError, match="decoder"):
        decode_image(jpeg, decoder="magic")


# ---- image folder --------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for k in range(9):
        cls = ["cat", "dog", "emu"][k % 3]
        (tmp_path / cls / "sub").mkdir(parents=True, exist_ok=True)
        name = tmp_path / cls / ("sub" if k % 2 else "") / f"{k}.{'png' if k % 4 else 'jpg'}"
        name.write_bytes(_encode(_image(k), "PNG" if k % 4 else "JPEG"))
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    return tmp_path


def test_image_folder_has_classes_labels_and_decoded_images(folder: Path) -> None:
    ds = ImageFolder(folder)
    assert ds.classes == ["cat", "dog", "emu"] and len(ds) == 9
    seen = {}
    for i in range(len(ds)):
        img, label = ds[i]
        k = int(ds.path(i).stem)
        assert ds.classes[label] == ["cat", "dog", "emu"][k % 3]
        assert img.shape == (24, 24, 3)
        if k % 4:
            assert np.array_equal(img, _image(k))  # PNG: lossless
        seen[k] = label
    assert sorted(seen) == list(range(9))
    raw, _ = ImageFolder(folder, decode=False)[0]
    assert isinstance(raw, bytes)
    again = pickle.loads(pickle.dumps(ds))  # spawn workers get it pickled
    assert again.path(4) == ds.path(4)


def test_image_folder_through_the_loader(folder: Path) -> None:
    ds = ImageFolder(folder, transform=lambda a: torch.from_numpy(a).permute(2, 0, 1))
    with Loader(ds, batch_size=4, num_workers=0, device="cpu", shuffle=False) as loader:
        batches = list(loader)
    assert [tuple(x.shape) for x, _ in batches] == [(4, 3, 24, 24)] * 2 + [(1, 3, 24, 24)]
    assert torch.cat([y for _, y in batches]).tolist() == ds.labels.tolist()


def test_image_folder_order_is_files_then_sorted_subfolders_depth_first(tmp_path: Path) -> None:
    # The order fixes which sample an index is: it must not depend on the directory's
    # listing order, and it is what os.walk(sorted) gave before the listing was rewritten.
    for rel in ("a/z.jpg", "a/b.JPG", "a/m/c.png", "a/m/n/d.jpg", "a/k/e.jpg", "a/k/f.txt",
                "b/x.jpeg", "b/y/0.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    (tmp_path / "a" / "link").symlink_to(tmp_path / "b" / "y")  # followed, like a folder
    ds = ImageFolder(tmp_path, decode=False)
    rels = [str(ds.path(i).relative_to(tmp_path)) for i in range(len(ds))]
    assert rels == ["a/b.JPG", "a/z.jpg", "a/k/e.jpg", "a/link/0.png", "a/m/c.png",
                    "a/m/n/d.jpg", "b/x.jpeg", "b/y/0.png"]
    assert ds.labels.tolist() == [0] * 6 + [1] * 2 and ds.labels.dtype == np.int32


def test_image_folder_names_a_folder_it_cannot_list(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "locked").mkdir(parents=True)
    (tmp_path / "a" / "1.jpg").write_bytes(b"")
    real = __import__("os").scandir

    def scandir(path: object) -> object:
        if isinstance(path, bytes) and path.endswith(b"locked/"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr("ringtrain.data.imagefolder.os.scandir", scandir)
    with pytest.raises(DataError, match=r"cannot list .*a/locked/: Permission denied"):
        ImageFolder(tmp_path)


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not a directory"):
        ImageFolder(tmp_path / "missing")
    with pytest.raises(DataError, match="no class folders"):
        ImageFolder(tmp_path)
    (tmp_path / "a").mkdir()
    with pytest.raises(DataError, match="no image files"):
        ImageFolder(tmp_path)


def test_image_folder_takes_one_extension_as_a_str(folder: Path) -> None:
    # Before: extensions=".jpg" was split into its characters, so every file ending in
    # "j", "p", "g" or "." was listed: the .png files too (and any .svg).
    (folder / "dog" / "drawing.svg").write_text("<svg/>")
    ds = ImageFolder(folder, extensions=".jpg")
    assert len(ds) == 3 and all(ds.path(i).suffix == ".jpg" for i in range(len(ds)))

# ---- WebDataset tar shards -----------------------------------------------------------
def _write_tar(path: Path, first: int, n: int) -> None:
    with tarfile.open(path, "w") as tf:
        for k in range(first, first + n):
            for field, data in (("jpg", _encode(_image(k), "JPEG")), ("cls", str(k).encode()),
                                ("meta.json", json.dumps({"k": k}).encode())):
                info = tarfile.TarInfo(f"train/{k:05d}.{field}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def test_tar_shards_group_members_into_samples(tmp_path: Path) -> None:
    _write_tar(tmp_path / "s-00.tar", 0, 5)
    _write_tar(tmp_path / "s-01.tar", 5, 3)
    ds = TarShards(str(tmp_path / "s-{00..01}.tar"))
    assert ds.shard_sizes == (5, 3) and len(ds) == 8
    sample = ds[6]
    assert sample["__key__"] == "train/00006" and sample["cls"] == b"6"
    assert json.loads(sample["meta.json"]) == {"k": 6}
    assert decode_image(sample["jpg"]).shape == (24, 24, 3)
    only = TarShards([str(tmp_path / "s-00.tar")], fields=["cls"])
    assert set(only[0]) == {"__key__", "cls"}
    index = tmp_path / "index.json"  # the wids index format: sizes without a scan
    index.write_text(json.dumps({"shardlist": [{"url": "s-00.tar", "nsamples": 5},
                                               {"url": "s-01.tar", "nsamples": 3}]}))
    listed = TarShards(str(index), transform=lambda s: int(s["cls"]))
    assert listed.shard_sizes == (5, 3) and [listed[i] for i in range(8)] == list(range(8))
    assert expand_braces("a{8..10}b{0..1}") == ["a8b0", "a8b1", "a9b0", "a9b1", "a10b0", "a10b1"]
    with pytest.raises(DataError, match="cannot read tar shard"):
        (tmp_path / "bad.tar").write_bytes(b"x" * 700)
        TarShards([str(tmp_path / "bad.tar")])


def test_tar_shards_take_one_field_as_a_str(tmp_path: Path) -> None:
    # Before: fields="cls" became the set of its characters, so every field was dropped
    # and each sample was {"__key__": ...} alone.
    _write_tar(tmp_path / "s.tar", 0, 2)
    assert TarShards([str(tmp_path / "s.tar")], fields="cls")[1] == {"__key__": "train/00001",
                                                                     "cls": b"1"}


def test_tar_shards_read_what_the_webdataset_package_writes(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset", reason="needs the formats extra: pip install "
                                                   "-e '.[formats]'")
    with wds.TarWriter(str(tmp_path / "w.tar")) as sink:
        for k in range(6):
            sink.write({"__key__": f"s{k:03d}", "png": _encode(_image(k), "PNG"),
                        "cls": str(k % 2).encode()})
    ds = TarShards([str(tmp_path / "w.tar")],
                   transform=lambda s: (decode_image(s["png"]), int(s["cls"])))
    assert len(ds) == 6
    for k in range(6):
        img, label = ds[k]
        assert np.array_equal(img, _image(k)) and label == k % 2


# ---- Parquet -------------------------------------------------------------------------
def test_parquet_rows_with_row_groups_as_shards(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra: pip install "
                                               "-e '.[formats]'")
    import pyarrow.parquet as pq

    n = 50
    table = pa.table({
        "x": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 3, dtype=np.float32)), 3),
        "y": pa.array(np.arange(n, dtype=np.int64)),
        "name": pa.array([f"row{i}" for i in range(n)]),
        "blob": pa.array([bytes([i]) * 3 for i in range(n)], type=pa.binary()),
    })
    pq.write_table(table.slice(0, 30), tmp_path / "a.parquet", row_group_size=12)
    pq.write_table(table.slice(30), tmp_path / "b.parquet", row_group_size=12)
    ds = ParquetDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert ds.shard_sizes == (12, 12, 6, 12, 8) and len(ds) == 50
    row = ds[37]
    assert row["y"] == 37 and row["name"] == "row37" and row["blob"] == bytes([37]) * 3
    assert np.array_equal(row["x"], [111, 112, 113])
    with Loader(ds, batch_size=8, num_workers=0, device="cpu", seed=1) as loader:
        got = [b for b in loader]
    ys = torch.cat([b["y"] for b in got])
    assert sorted(ys.tolist()) == list(range(50))
    for b in got:
        assert torch.equal(b["x"][:, 0], b["y"].float() * 3)
    cols = ParquetDataset(str(tmp_path / "a.parquet"), columns=["y"])
    assert cols[3] == {"y": 3}


def test_parquet_errors_name_the_file(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow", reason="needs the formats extra: pip install -e '.[formats]'")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet"):
        ParquetDataset(str(tmp_path / "junk.parquet"))


def test_parquet_columns_a_str_or_a_name_the_file_lacks(tmp_path: Path) -> None:
    # Before: columns="y" became ["y"]'s characters and a misspelt name was skipped by
    # pyarrow without a word: every row read as {} (or without that field).
    pa = pytest.importorskip("pyarrow", reason="needs the formats extra: pip install "
                                               "-e '.[formats]'")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"label": [1, 2], "s": [{"a": 1}, {"a": 2}]}), tmp_path / "a.parquet")
    path = str(tmp_path / "a.parquet")
    assert ParquetDataset(path, columns="label")[1] == {"label": 2}
    assert ParquetDataset(path, columns=["s.a"])[0] == {"s": {"a": 1}}  # a nested field
    with pytest.raises(DataError, match=r"a.parquet has no column 'lable'; its columns are \['label', 's'\]"):
        ParquetDataset(path, columns=["label", "lable"])


# ---- the record store, by shard ------------------------------------------------------
def test_record_shards_split_by_shard(tmp_path: Path) -> None:
    with RecordWriter(tmp_path / "r", shard_records=10) as w:
        for k in range(35):
            w.write(k.to_bytes(4, "little"))
    ds = RecordShards(tmp_path / "r", transform=lambda b: int.from_bytes(b, "little"))
    assert ds.shard_sizes == (10, 10, 10, 5)
    assert ds.shard_names[0].endswith("shard-00000.rec")
    ranks = []
    for r in range(2):
        with Loader(ds, batch_size=5, num_workers=0, device="cpu", rank=r, world_size=2,
                    seed=3) as loader:
            ranks.append(torch.cat(list(loader)).tolist())
    assert len(ranks[0]) == len(ranks[1]) == 18  # ceil(35 / 2): one padded sample
    assert set(ranks[0]) | set(ranks[1]) == set(range(35))
    assert len({v // 10 for v in ranks[0]}) <= 3  # a rank stays on a few shards
