"""
Parquet files and `datasets` save_to_disk Arrow files, read as corpus records: the only code of the
project that needs pyarrow. data_stream.py imports it when it meets such a file, so text and jsonl
corpora need neither this file nor pyarrow.

A leaf: it imports nothing of the project. A mistake the user must fix (a missing or non-text
column, a file that does not read) is raised as the exception class the caller passes (`error`),
in one line.
"""
import collections

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROW_GROUP_CACHE_BYTES = 1 << 27  # decoded parquet row groups a process keeps (cold reads only)


def read_arrow(path):
    """A save_to_disk .arrow file (Arrow stream format; the file format too), memory-mapped."""
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def _check_text_column(path, schema, text_field, error):
    if text_field not in schema.names:
        raise error(f"{path} has no column {text_field!r} (it has: {', '.join(schema.names)}); "
                    "name the text with --text-field")
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):  # pandas categoricals
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise error(f"{path}: column {text_field!r} is {kind}, not text; name the text with --text-field")


def index_records(path, fmt, text_field, error):
    """The records of a parquet ('parquet') or Arrow ('arrow') file that hold text: their row group
    (arrow: 0), row and length in characters, and the count of empty ones. The text column is read
    once here for the lengths (byte balance of the shards) and the empty records."""
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(path)
            _check_text_column(path, pf.schema_arrow, text_field, error)
            columns = [(g, pf.read_row_group(g, columns=[text_field]).column(0)) for g in range(pf.num_row_groups)]
        else:
            table = read_arrow(path)
            _check_text_column(path, table.schema, text_field, error)
            columns = [(0, table.column(text_field))]
    except (OSError, pa.ArrowException) as e:
        raise error(f"corpus file {path} does not read as {fmt} ({str(e).splitlines()[0]})") from None
    groups, rows, lengths, empty = [], [], [], 0
    for group, column in columns:
        column = column.cast(pa.large_string())  # dictionary-encoded and all-null columns too
        length = pc.fill_null(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0).to_numpy()
        keep = np.flatnonzero(length > 0)
        empty += len(length) - len(keep)
        groups.append(np.full(len(keep), group, np.int64)), rows.append(keep)
        lengths.append(pc.fill_null(pc.utf8_length(column), 0).to_numpy()[keep])
    if not columns:  # a parquet file with no row group: an empty shard of an export
        groups, rows, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    return np.concatenate(groups), np.concatenate(rows).astype(np.int64), np.concatenate(lengths), empty


def open_records(path, fmt, text_field):
    """What record_text reads from, opened once per process: parquet: the file and the row groups
    decoded so far; arrow: the text column of the memory-mapped table."""
    if fmt == "parquet":
        return pq.ParquetFile(path), collections.OrderedDict()
    return read_arrow(path).column(text_field)


def record_text(handle, fmt, group, row, text_field):
    """The text of one record (None: a null), from open_records' handle."""
    if fmt == "parquet":  # a row is read by decoding its row group: recent ones are kept
        parquet, groups = handle
        if group not in groups:
            groups[group] = parquet.read_row_group(group, columns=[text_field]).column(0)
            while len(groups) > 1 and sum(g.nbytes for g in groups.values()) > ROW_GROUP_CACHE_BYTES:
                groups.popitem(last=False)
        groups.move_to_end(group)
        return groups[group][row].as_py()
    return handle[row].as_py()
