"""Parquet files through ``pyarrow``, one shard per row group.

A row group is Parquet's unit of reading (its columns are stored, compressed and
read together), so it is the natural shard: the loader gives each rank whole row
groups, and a worker decodes a row group once, keeps it, and serves the samples of
the batches it gets from it. ``ds[i]`` is a dict ``{column: value}``: numeric
columns become numpy scalars, fixed-size lists of numbers become numpy rows (zero
copy from Arrow's buffers), anything else the Python value (``bytes`` for binary).

``pyarrow`` is optional (``pip install 'ringtrain[formats]'``); it is imported when a
``ParquetDataset`` is made. Files by URL are read through a :class:`ShardCache`: making
the dataset reads only each file's footer (its row counts), by range requests where the
server takes them, and a worker downloads a file when it first reads one of its row
groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.data.remote import ShardCache, is_remote
from ringtrain.data.shards import Shards
from ringtrain.errors import DataError

__all__ = ["ParquetDataset"]


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install 'ringtrain[formats]' "
                        "(or pyarrow)") from None
    return pq


def _column(col: Any) -> Any:
    """A row group's column as something indexable per row."""
    import pyarrow as pa  # type: ignore[import-not-found]

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if arr.null_count == 0:
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            return arr.to_numpy(zero_copy_only=False)
        if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type)
                                               or pa.types.is_floating(t.value_type)):
            flat = arr.flatten()
            # A null inside a row: to_numpy would make it NaN and every row of the row
            # group float (int [3, null] read as [3., nan]); the Python value keeps None.
            if flat.null_count == 0:
                return flat.to_numpy(zero_copy_only=False).reshape(len(arr), t.list_size)
    return arr.to_pylist()


def _check_columns(columns: list[str] | None, schema: Any, path: str) -> None:
    """Refuse a column the file does not have: pyarrow skips unknown names without a
    word, so a misspelt column made every row an empty dict (or lacked that field)."""
    if columns is None:
        return
    top = schema.to_arrow_schema().names
    leaves = [schema.column(i).path for i in range(len(schema))]
    for c in columns:
        # a top-level column, or a nested field's dotted path (or a prefix of one)
        if c not in top and not any(p == c or p.startswith(c + ".") for p in leaves):
            raise DataError(f"Parquet file {path} has no column {c!r}; its columns are "
                            f"{top[:20]}")


class ParquetDataset(Shards):
    """Rows of Parquet files as a sharded dataset (one shard per row group).

    Args:
        paths: files (paths or URLs).
        columns: read only these columns (default: all; one may be given as a str); a
            name the files lack is a DataError.
        transform: ``f(row dict) -> sample``, run in the workers.
        cache: where files by URL are downloaded (default: a :class:`ShardCache`).
    """

    def __init__(self, paths: str | Sequence[str], columns: Sequence[str] | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None,
                 cache: ShardCache | None = None) -> None:
        pq = _pq()
        self.paths = [paths] if isinstance(paths, str) else [str(p) for p in paths]
        if isinstance(columns, str):  # one column, not its characters
            columns = [columns]
        self.columns = None if columns is None else list(columns)
        self.cache = cache or ShardCache()
        self._groups: list[tuple[int, int]] = []  # shard -> (file, row group)
        names, sizes = [], []
        first: tuple[str, list[str]] | None = None  # a file's columns, when all are read
        for f, path in enumerate(self.paths):
            try:
                # The footer only: a remote file is not downloaded to count its rows.
                with self.cache.open_ranges(path) as src:
                    meta = pq.ParquetFile(src).metadata
            except (OSError, ValueError) as err:
                raise DataError(f"cannot read Parquet file {path}: {err}") from None
            _check_columns(self.columns, meta.schema, path)
            if self.columns is None:
                mine = meta.schema.to_arrow_schema().names
                if first is None:
                    first = (path, mine)
                elif sorted(mine) != sorted(first[1]):
                    # Rows of different keys: the default collate takes a batch's first
                    # row's keys, so a column that row lacks was dropped for the whole
                    # batch, silently (or the batch failed, depending on the order).
                    shared = [c for c in first[1] if c in mine]
                    raise DataError(
                        f"Parquet files {first[0]} and {path} have different columns "
                        f"({first[1][:10]} and {mine[:10]}); pass columns= with the ones "
                        f"every file has ({shared[:10]}), or give the files one schema")
            for g in range(meta.num_row_groups):
                self._groups.append((f, g))
                names.append(f"{path} row group {g}")
                sizes.append(meta.row_group(g).num_rows)
        super().__init__(names, sizes, transform)
        self._cached: tuple[int, dict[str, Any]] | None = None  # one decoded row group
        self._file: tuple[int, Any] | None = None  # the open file it came from

    def _row_group(self, shard: int) -> dict[str, Any]:
        if self._cached is not None and self._cached[0] == shard:
            return self._cached[1]
        f, g = self._groups[shard]
        if self._file is None or self._file[0] != f:  # keep the open file (and its footer)
            self._file = (f, self._open_file(self.paths[f]))
        table = self._file[1].read_row_group(g, columns=self.columns)
        if table.num_rows != self.shard_sizes[shard]:  # the file changed since it was counted
            raise DataError(f"{self.shard_names[shard]} holds {table.num_rows} rows, but "
                            f"{self.shard_sizes[shard]} when the dataset was made: the file "
                            "changed; make the ParquetDataset again")
        cols = {name: _column(table.column(name)) for name in table.column_names}
        self._cached = (shard, cols)
        return cols

    def _open_file(self, path: str) -> Any:
        pq = _pq()
        try:
            return pq.ParquetFile(self.cache.path(path))
        except FileNotFoundError:
            if not is_remote(path):
                raise DataError(f"Parquet file {path} does not exist (it did when the dataset "
                                "was made)") from None
            # evicted by another worker between its download and this open: fetch it again
            return pq.ParquetFile(self.cache.path(path))

    def shard_source(self, shard: int) -> str:
        return self.paths[self._groups[shard][0]]

    def read_shard(self, shard: int, offsets: list[int]) -> list[Any]:
        cols = self._row_group(shard)
        items = list(cols.items())
        out = []
        for o in offsets:
            out.append({name: col[o] for name, col in items})
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cached"] = state["_file"] = None
        return state
