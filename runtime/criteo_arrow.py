"""Criteo TSV lines parsed by pyarrow's CSV reader: the fast path of CriteoTSVReader.

pyarrow splits the lines into 40 binary columns (in C++, no Python object per field);
the fields are then turned into numbers with numpy on pyarrow's buffers. The fast path
accepts only the canonical form of every field, for which its numbers are those of the
Python parser (CriteoTSVReader.parse) by construction:

* label `0` or `1`;
* integer: empty (0) or `-?[0-9]{1,18}` (fits int64; Python's int() reads the same value);
* categorical: empty (missing) or `[0-9a-fA-F]{1,16}`;
* no `\\r` anywhere, exactly 40 fields on every line, no empty line.

Anything else (a malformed record, but also forms Python's int() accepts and these do
not: `+5`, ` 5`, `1_000`) returns None, and the reader parses the lines with the Python
parser, which gives its result or its error with the line and byte offset. So both paths
give the same batches and the same errors on every input.
"""

from __future__ import annotations

import numpy as np

__all__ = ["parse_block"]

_FIELDS = 40
_INTEGERS = 13
_NAMES = [f"f{i}" for i in range(_FIELDS)]
_DIGIT = np.full(256, -1, dtype=np.int16)
_DIGIT[np.frombuffer(b"0123456789", dtype=np.uint8)] = np.arange(10)
_NIBBLE = np.full(256, -1, dtype=np.int16)
_NIBBLE[np.frombuffer(b"0123456789", dtype=np.uint8)] = np.arange(10)
_NIBBLE[np.frombuffer(b"abcdef", dtype=np.uint8)] = np.arange(10, 16)
_NIBBLE[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16)
_MINUS = ord("-")


def _buffers(column: object) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1] int64 from 0, bytes uint8) of a binary pyarrow column."""
    arr = column.combine_chunks()  # type: ignore[attr-defined]
    _, off_buf, data_buf = arr.buffers()
    off = np.frombuffer(off_buf, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    off = off.astype(np.int64)
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    return off - off[0], data[off[0] : off[-1]]


def _segment_sum(terms: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Sum of terms[off[i]:off[i+1]] per i, exact modulo 2**64 (uint64 wrap-around)."""
    c = np.concatenate(([np.uint64(0)], np.cumsum(terms, dtype=np.uint64)))
    return c[off[1:]] - c[off[:-1]]


def _field_end(off: np.ndarray, size: int) -> np.ndarray:
    """For each byte, the offset one past the last byte of its field."""
    return np.repeat(off[1:], np.diff(off))[:size]


def _integers(off: np.ndarray, data: np.ndarray) -> np.ndarray | None:
    """int64 values of `-?[0-9]{1,18}` or empty (0) fields; None if any field is not one."""
    n = len(off) - 1
    lengths = np.diff(off)
    starts = off[:-1]
    negative = np.zeros(n, dtype=bool)
    nonempty = lengths > 0
    negative[nonempty] = data[starts[nonempty]] == _MINUS
    digits = lengths - negative
    if np.any(digits > 18) or np.any(negative & (digits == 0)):
        return None
    d = _DIGIT[data]
    first_digit = np.zeros(len(data), dtype=bool)  # the minus signs are not digits
    first_digit[starts[negative]] = True
    if np.any((d < 0) & ~first_digit):
        return None
    place = _field_end(off, len(data)) - 1 - np.arange(len(data))
    terms = np.where(first_digit, 0, d).astype(np.uint64) * (
        np.uint64(10) ** place.astype(np.uint64)
    )
    values = _segment_sum(terms, off).astype(np.int64)
    return np.where(negative, -values, values)


def _hex(off: np.ndarray, data: np.ndarray) -> np.ndarray | None:
    """uint64 values of `[0-9a-fA-F]{1,16}` or empty (0) fields; None if any is not one."""
    if np.any(np.diff(off) > 16):
        return None
    nib = _NIBBLE[data]
    if np.any(nib < 0):
        return None
    place = _field_end(off, len(data)) - 1 - np.arange(len(data))
    terms = nib.astype(np.uint64) << (place.astype(np.uint64) * np.uint64(4))
    return _segment_sum(terms, off)


def parse_block(
    block: bytes, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The `n` Criteo lines in `block` as (labels float32 [n], integers int64 [n, 13], hex
    values uint64 [n, 26], missing bool [n, 26]); None when a field is not canonical."""
    import pyarrow as pa
    import pyarrow.csv as csv

    if b"\r" in block:
        return None
    try:
        table = csv.read_csv(
            pa.py_buffer(block),
            read_options=csv.ReadOptions(
                column_names=_NAMES, use_threads=False, block_size=max(len(block) + 1, 1 << 16)
            ),
            parse_options=csv.ParseOptions(
                delimiter="\t", quote_char=False, escape_char=False, ignore_empty_lines=False
            ),
            convert_options=csv.ConvertOptions(
                column_types={c: pa.binary() for c in _NAMES},
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if table.num_rows != n:
        return None
    off, data = _buffers(table.column(0))
    if np.any(np.diff(off) != 1):
        return None
    labels = data
    if np.any((labels != ord("0")) & (labels != ord("1"))):
        return None
    ints = np.empty((n, _INTEGERS), dtype=np.int64)
    for c in range(_INTEGERS):
        v = _integers(*_buffers(table.column(1 + c)))
        if v is None:
            return None
        ints[:, c] = v
    cats = _FIELDS - 1 - _INTEGERS
    hexv = np.empty((n, cats), dtype=np.uint64)
    missing = np.empty((n, cats), dtype=bool)
    for c in range(cats):
        off, data = _buffers(table.column(1 + _INTEGERS + c))
        v = _hex(off, data)
        if v is None:
            return None
        hexv[:, c] = v
        missing[:, c] = np.diff(off) == 0
    return (labels == ord("1")).astype(np.float32), ints, hexv, missing
