"""Criteo Kaggle / Terabyte TSV → Parquet, streamed in blocks.

    input line   label \t I1..I13 (integers, may be empty or negative) \t C1..C26 (hex hashes)
                 (or comma-separated with a header line label,I1..I13,C1..C26, as DeepCTR's
                 criteo_sample.txt; integers may be written as floats: 260.0)
    output       label float32 | I1..I13 float32 = log(1 + max(x, 0)), empty → 0
                 | C1..C26 int64: empty → 0 (reserved), hex h → h + 1,
                   or with max_ind_range R > 0: h % (R - 1) + 1, so ids lie in [0, R)

Blocks of a few MB are parsed by pyarrow.csv (``.gz`` inputs are decompressed on the
fly) and converted with vectorised numpy; nothing holds a whole input. A line with
the wrong number of fields, a non-integer I field or label, or a non-hex C field is a
:class:`DataError` naming the input file and its line number.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from data.errors import DataError, UserError, quoted
from data.schema import CRITEO_DENSE, CRITEO_SPARSE

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

_COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
_INTEGER = r"^-?[0-9]{1,18}(\.0*)?$"  # 260.0: an integer written as a float
_HEAD_BYTES = 1 << 16  # enough for a header line
_MAX_HEX = 15  # hex digits; 15 keep h + 1 inside int64


def convert_criteo(
    inputs: list[str],
    out_dir: str,
    max_ind_range: int = 0,
    row_group_rows: int = 65536,
    file_rows: int = 1_000_000,
) -> list[str]:
    """Convert Criteo TSV files (in order, as one stream) to ``out_dir/part-NNNNN.parquet``.

    Returns the written files; see :func:`data.files.write_parts` for the layout.
    """
    import pyarrow as pa

    from data.files import write_parts
    from data.roles import Roles, with_roles

    if max_ind_range < 0 or max_ind_range == 1:
        raise UserError(f"max_ind_range {max_ind_range} must be 0 (off) or >= 2")
    schema = with_roles(pa.schema(
        [("label", pa.float32())]
        + [(c, pa.float32()) for c in CRITEO_DENSE]
        + [(c, pa.int64()) for c in CRITEO_SPARSE]
    ), Roles("label", tuple(CRITEO_DENSE), tuple(CRITEO_SPARSE), "dlrm convert-criteo"))

    def tables() -> Iterator[pa.Table]:
        for path in inputs:
            yield from _convert_file(path, max_ind_range)

    return write_parts(out_dir, tables(), schema, file_rows, row_group_rows)


def _convert_file(path: str, max_ind_range: int) -> Iterator[pa.Table]:
    """One input, block by block, as converted Arrow tables; what cannot be read or
    parsed is a DataError naming the file."""
    import pyarrow as pa
    import pyarrow.csv as pv

    bad_rows: list[pv.InvalidRow] = []

    def on_invalid(row: pv.InvalidRow) -> str:
        bad_rows.append(row)
        return "error"

    if os.path.isdir(path):
        raise DataError("is a directory; name its TSV files (e.g. DIR/day_*)", file=path)
    try:
        stream = pa.input_stream(path)
    except FileNotFoundError:
        raise DataError("does not exist", file=path) from None
    try:
        yield from _blocks(path, stream, max_ind_range, bad_rows, on_invalid)
    except pa.ArrowInvalid as e:
        raise _parse_error(e, bad_rows, path) from None
    except OSError as e:  # a truncated or corrupt .gz (after its good blocks were converted)
        raise DataError(f"cannot read ({quoted(e)})", file=path) from None


def _blocks(path: str, stream: Any, max_ind_range: int, bad_rows: list, on_invalid: Any) -> Iterator[pa.Table]:
    """``_convert_file``'s blocks of the opened ``stream``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pv

    delimiter, header = _layout(path)
    line = 2 if header else 1  # line number of the block's first row
    with stream:
        reader = pv.open_csv(  # parses the first block already
            stream,
            read_options=pv.ReadOptions(column_names=_COLUMNS, use_threads=False,
                                        block_size=1 << 22, skip_rows=int(header)),
            parse_options=pv.ParseOptions(delimiter=delimiter, quote_char=False,
                                          ignore_empty_lines=False,
                                          invalid_row_handler=on_invalid),
            convert_options=pv.ConvertOptions(column_types=dict.fromkeys(_COLUMNS, pa.string()),
                                              strings_can_be_null=False),
        )
        for block in reader:
            where = (path, line)
            label = _integers(block.column("label"), "label", where)
            if np.any((label < 0) | (label > 1)):
                i = int(np.argmax((label < 0) | (label > 1)))
                raise DataError(f"line {line + i}: label {label[i]} is not 0 or 1",
                                file=path, column="label")
            cols: dict[str, np.ndarray] = {"label": label.astype(np.float32)}
            for c in CRITEO_DENSE:
                x = np.maximum(_integers(block.column(c), c, where), 0)
                cols[c] = np.log1p(x.astype(np.float64)).astype(np.float32)
            for c in CRITEO_SPARSE:
                cols[c] = _hex_ids(block.column(c), c, where, max_ind_range)
            yield pa.table(cols)
            line += block.num_rows


def _layout(path: str) -> tuple[str, bool]:
    """(delimiter, header?) from the first line: Criteo's own files are tab-separated
    without a header; a line holding no tab but commas is CSV; a first field "label"
    is a header, which must name the 40 columns in order."""
    import pyarrow as pa

    with pa.input_stream(path) as stream:
        first = stream.read(_HEAD_BYTES).split(b"\n", 1)[0].rstrip(b"\r").decode(errors="replace")
    delimiter = "," if "\t" not in first and "," in first else "\t"
    fields = [f.strip() for f in first.split(delimiter)]
    if fields[0].lower() != "label":
        return delimiter, False
    if fields != _COLUMNS:
        raise DataError(f"line 1: a header naming {len(fields)} columns ({', '.join(fields[:4])}, ...) "
                        f"where {', '.join(_COLUMNS[:3])}, ..., C26 ({len(_COLUMNS)}) were expected",
                        file=path)
    return delimiter, True


def _parse_error(e: Exception, bad_rows: list, path: str) -> DataError:
    """The parser's error as a DataError naming the line it recorded, if any."""
    if bad_rows:
        row = bad_rows[0]
        return DataError(
            f"line {row.number}: {row.actual_columns} fields where {row.expected_columns} "
            "were expected", file=path,
        )
    return DataError(f"cannot parse ({str(e).strip()[:200]})", file=path)


def _integers(arr: pa.Array, column: str, where: tuple[str, int]) -> np.ndarray:
    """Decimal integers [n] int64 from strings; an empty field is 0 (not for the label)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    empty = pc.equal(arr, "")
    ok = pc.match_substring_regex(arr, _INTEGER)
    if column != "label":
        ok = pc.or_(empty, ok)
    ok = ok.to_numpy(zero_copy_only=False)
    if not ok.all():
        i = int(np.argmax(~ok))
        value = arr[i].as_py()
        what = f"empty {column}" if value == "" else f"{value!r} is not an integer"
        raise DataError(f"line {where[1] + i}: {what}", file=where[0], column=column)
    whole = pc.replace_substring_regex(arr, r"\.0*$", "")  # 260.0 -> 260
    return pc.cast(pc.if_else(empty, "0", whole), pa.int64()).to_numpy()


@functools.cache
def _hex_table() -> np.ndarray:
    """ASCII byte → hex digit value, 255 for anything else."""
    import numpy as np

    table = np.full(256, 255, dtype=np.uint8)
    for i, ch in enumerate("0123456789abcdef"):
        table[ord(ch)] = i
        table[ord(ch.upper())] = i
    return table


def _hex_ids(arr: pa.Array, column: str, where: tuple[str, int], max_ind_range: int
             ) -> np.ndarray:
    """Ids [n] int64 from hex strings: empty → 0, h → h + 1 (or h % (R - 1) + 1)."""
    import numpy as np

    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1]
    lengths = np.diff(offsets)
    width = int(lengths.max()) if n else 0
    if width == 0:
        return np.zeros(n, dtype=np.int64)
    if width > _MAX_HEX:
        i = int(np.argmax(lengths > _MAX_HEX))
        raise DataError(f"line {where[1] + i}: {arr[i].as_py()!r} has more than {_MAX_HEX} "
                        "hex digits", file=where[0], column=column)
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
    h = np.zeros(n, dtype=np.uint64)
    bad = np.zeros(n, dtype=bool)
    digits = _hex_table()
    for j in range(width):  # right-aligned: digit j of a value of width `width`
        present = lengths >= width - j
        pos = np.where(present, offsets[1:] - (width - j), 0)
        d = digits[data[pos]]
        bad |= present & (d == 255)
        h = np.where(present, (h << np.uint64(4)) | d.astype(np.uint64), h)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"line {where[1] + i}: {arr[i].as_py()!r} is not hexadecimal",
                        file=where[0], column=column)
    if max_ind_range:
        h = h % np.uint64(max_ind_range - 1)
    return np.where(lengths > 0, h.astype(np.int64) + 1, 0)
