"""The columns' roles, written into a Parquet file's footer by our own writers.

A footer says a column is int64, not whether it is an id or a count, so inference
(:func:`data.schema.infer_schema`) takes every integer column as sparse and the header
warns about it. Files that ``dlrm generate`` and ``dlrm convert-criteo`` write know
better: they record each column's role in the schema's key-value metadata::

    b"hybrid_dlrm.roles": {"label": "label", "dense": ["I1", ...], "sparse": ["C1", ...],
                          "written_by": "dlrm convert-criteo"}

Inference follows a declared role where the column's type allows it and infers the
rest as before. The entry is plain JSON: pyarrow, pandas and Spark keep or drop it
without harm, and a file that lost it is inferred as any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

ROLES_KEY = b"hybrid_dlrm.roles"


@dataclass(frozen=True)
class Roles:
    """Columns by role, as a writer declared them."""

    label: str
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    written_by: str


def with_roles(arrow: pa.Schema, roles: Roles) -> pa.Schema:
    """``arrow`` with ``roles`` in its metadata (other entries kept)."""
    entry = {"label": roles.label, "dense": list(roles.dense), "sparse": list(roles.sparse),
             "written_by": roles.written_by}
    return arrow.with_metadata({**(arrow.metadata or {}), ROLES_KEY: json.dumps(entry).encode()})


def declared_roles(arrow: pa.Schema) -> Roles | None:
    """The roles a file's schema declares; None when it declares none, or an entry
    that is not what :func:`with_roles` writes (another tool's key, an edited file):
    such a file is inferred, never refused."""
    raw = (arrow.metadata or {}).get(ROLES_KEY)
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
        dense, sparse = entry["dense"], entry["sparse"]
        label, written_by = entry["label"], entry.get("written_by", "")
    except (ValueError, TypeError, KeyError):
        return None
    names = [label, written_by, *dense, *sparse] if isinstance(dense, list) and isinstance(sparse, list) else []
    if not names or not all(isinstance(n, str) for n in names):
        return None
    return Roles(label=label, dense=tuple(dense), sparse=tuple(sparse), written_by=written_by)
