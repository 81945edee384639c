"""The few lines ``dlrm train`` prints before its progress bar, in place of the
resolved config (kept in RUN/config.yaml; ``train.print_config=true`` or
``--print-config`` prints it too):

    data       train: 3 files, 1,000,000 rows; eval: 1 file, 100,000 rows
    schema     13 dense, 26 sparse (data.dense, data.sparse: inferred from the footer ...)
    tables     26, 33,762,577 rows x 16 = 2.0 GiB (fp32)
    plan       table_wise: 20 tables on 2 ranks
    plan       row_wise: 6 tables on 2 ranks
    device     cpu, fp32
    run        runs/latest (full config: runs/latest/config.yaml)

and, when integer columns became embedding tables without ``data.sparse`` naming
them, one warning line that names them and gives the override.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from data.errors import DataError
from data.files import footer, hive_partitions
from data.roles import declared_roles
from data.schema import Schema, column_kind, exemplar, type_name
from dlrm.config import Config
from dlrm.parallel.planning import run_tables
from embeddings.plan.sizes import format_bytes
from embeddings.plan.types import ShardingPlan


def _rows(files: list[str]) -> tuple[int, int]:
    """(rows in the readable footers, files whose footer does not open): under
    data.on_error=skip an unreadable file is left out of the run, not an error here."""
    rows = unreadable = 0
    for f in files:
        try:
            rows += footer(f).metadata.num_rows
        except DataError:
            unreadable += 1
    return rows, unreadable


def _files(what: str, files: list[str]) -> str:
    rows, unreadable = _rows(files)
    skipped = f" ({unreadable} unreadable, left out)" if unreadable else ""
    return f"{what}: {len(files)} file{'s' * (len(files) != 1)}, {rows:,} rows{skipped}"


def integer_sparse_columns(cfg: Config, schema: Schema, first_file: str) -> list[str]:
    """Single integer columns that became sparse features though ``data.sparse`` named
    none: counts and ages look the same as ids in a footer. Empty when it was given."""
    if cfg.data.sparse:
        return []
    arrow = footer(first_file).schema_arrow
    roles = declared_roles(arrow) if not cfg.data.dense else None
    declared = set(roles.sparse) if roles else set()
    return [f.name for f in schema.sparse if f.name not in declared
            and arrow.get_field_index(f.name) >= 0 and column_kind(arrow.field(f.name).type) == "int"]


def integer_warning(cfg: Config, schema: Schema, first_file: str) -> str | None:
    """One line naming the integer columns taken as sparse, with the override."""
    ints = integer_sparse_columns(cfg, schema, first_file)
    if not ints:
        return None
    if len(ints) <= 6:  # a user's file: the exact override
        named, dense = ", ".join(ints), ",".join([*schema.dense, *ints])
        which = "they are"
    else:  # Criteo-like ids: the line stays a line
        named = f"{len(ints)} columns, {', '.join(ints[:3])}, ..., {ints[-1]}"
        dense = ",".join([*_ends(list(schema.dense)), "THOSE"])
        which = "some are"
    return (f"warning: integer columns taken as sparse features (one embedding table each, sized "
            f"by the largest value): {named}; if {which} counts or measures, train them as dense "
            f"with data.dense=[{dense}] (naming data.sparse=[...] silences this)")


def left_out_warning(schema: Schema, first_file: str, exclude: list[str] | None = None) -> str | None:
    """One line naming the columns no feature can take (timestamps, decimals, structs,
    ...): inferred away, they were dropped without a word. Columns ``data.exclude``
    names are left out on purpose."""
    arrow = footer(first_file).schema_arrow
    used = set(schema.columns) | set(exclude or [])
    left = [f"{f.name} ({type_name(f.type)})" for f in arrow
            if f.name not in used and column_kind(f.type) == "other"]
    if not left:
        return None
    shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
    return (f"warning: columns of types no feature takes are left out: {shown}; to train on "
            "one, cast it to float (dense) or to int or string (sparse) in the Parquet files")


def roles_off(cfg: Config, schema: Schema, first_file: str) -> list[str]:
    """The columns whose role the files declare (data/roles.py) but that were not trained
    in it, each with why: missing from the file the schema is read from, or of a type the role cannot take (a
    string column declared dense becomes a sparse feature; a float one declared sparse,
    a dense one). A file edited after our writer wrote it keeps the declaration. Empty
    where data.dense or data.sparse name the roles, or the files declare none."""
    if cfg.data.dense or cfg.data.sparse:
        return []
    arrow = footer(first_file).schema_arrow
    roles = declared_roles(arrow)
    if roles is None:
        return []
    sides = {"dense": set(schema.dense), "sparse": {f.name for f in schema.sparse}}
    off = []
    for declared, names in (("dense", roles.dense), ("sparse", roles.sparse)):
        for name in names:
            if name in (cfg.data.exclude or []) or name in sides[declared]:
                continue
            if arrow.get_field_index(name) < 0:
                off.append(f"{name} (declared {declared}, missing from {Path(first_file).name})")
                continue
            other = "sparse" if declared == "dense" else "dense"
            now = f"trained as {other}" if name in sides[other] else "left out"
            off.append(f"{name} (declared {declared}, {type_name(arrow.field(name).type)}: {now})")
    return off


def roles_warning(off: list[str]) -> str | None:
    """One line naming ``roles_off``'s columns (without it the schema line said "as the
    files declare" all the same), and the two ways out."""
    if not off:
        return None
    shown = ", ".join(off[:6]) + (f" and {len(off) - 6} more" if len(off) > 6 else "")
    return (f"warning: columns not in the role the files declare: {shown}; if the files were changed "
            "by mistake, write those columns back as declared; if on purpose, name the roles with "
            "data.dense=[...] and data.sparse=[...] (that silences this)")


def partition_warning(files: list[str]) -> str | None:
    """One line naming Hive partition keys (``date=2026-11-01/`` directories) whose column
    is not inside the files: nothing reads a directory name, so the column was dropped
    without a word."""
    keys = hive_partitions(files)
    arrow = footer(exemplar(files)).schema_arrow
    missing = {k: d for k, d in keys.items() if arrow.get_field_index(k) < 0}
    if not missing:
        return None
    shown = ", ".join(f"{k} ({d}/)" for k, d in missing.items())
    return (f"warning: Hive partition columns are only in the directory names, not inside the "
            f"Parquet files, and are not read: {shown}; to train on one, write it into the "
            f"files as a column (Spark: write without partitionBy, or copy it to another column)")


def _ends(names: list[str]) -> list[str]:
    return names if len(names) <= 3 else [names[0], "...", names[-1]]


def _schema_line(cfg: Config, schema: Schema, first_file: str, off: int) -> str:
    """``off``: the columns not in their declared role (``roles_off``)."""
    given = [k for k, v in (("data.dense", cfg.data.dense), ("data.sparse", cfg.data.sparse)) if v]
    roles = None if given else declared_roles(footer(first_file).schema_arrow)
    but = f", but for {off} column{'s' * (off != 1)} (the warning above)" if off else ""
    how = ("as given by " + " and ".join(given) if given else
           f"as the files declare (written by {roles.written_by or 'a dlrm writer'}){but}" if roles else
           "inferred from the footer: float, bool -> dense; integer, string, list -> sparse")
    multi = sum(f.multi_hot for f in schema.sparse)
    multi_text = f" ({multi} multi-hot)" if multi else ""
    return f"{len(schema.dense)} dense, {len(schema.sparse)} sparse{multi_text}; {how}"


def _table_line(cfg: Config, schema: Schema) -> str:
    """Tables, rows and weight bytes in their stored types (embeddings.dtype/dtypes)."""
    tables = run_tables(cfg, schema)
    total, dim = sum(t.rows for t in tables), cfg.model.embedding_dim
    dtypes = Counter(t.dtype for t in tables)
    kinds = (f"{next(iter(dtypes))} weights" if len(dtypes) == 1 else
             "weights: " + ", ".join(f"{n} {d}" for d, n in dtypes.most_common()))
    return f"{len(tables)}, {total:,} rows x {dim} = {format_bytes(sum(t.bytes for t in tables))} ({kinds})"


def _plan_lines(cfg: Config, plan: ShardingPlan | None) -> list[str]:
    placement = cfg.embeddings.placement
    if plan is None:
        return [f"{placement}, {cfg.embeddings.backend} backend, every table whole on every rank"]
    counts = Counter(tp.sharding.value for tp in plan.tables.values())
    ranks = f"{plan.world_size} rank{'s' * (plan.world_size != 1)}"
    return [f"{placement} ({cfg.embeddings.backend} backend), {ranks}"] + [
        f"{kind}: {n} table{'s' * (n != 1)}" for kind, n in counts.items()]


def header(cfg: Config, schema: Schema, train_files: list[str], eval_files: list[str],
           plan: ShardingPlan | None, device: str, run_dir: Path) -> list[str]:
    """The header's lines (see the module docstring), the warning first if there is one."""
    data = _files("train", train_files) + ("; " + _files("eval", eval_files) if eval_files else "")
    first = exemplar(train_files)  # the file the schema was read from
    off = roles_off(cfg, schema, first)
    lines = [("data", data), ("schema", _schema_line(cfg, schema, first, len(off))),
             ("tables", _table_line(cfg, schema))]
    lines += [("plan", line) for line in _plan_lines(cfg, plan)]
    lines += [("device", f"{device}, {cfg.train.precision}"),
              ("run", f"{run_dir} (full config: {run_dir / 'config.yaml'})")]
    warnings = [integer_warning(cfg, schema, first), left_out_warning(schema, first, cfg.data.exclude),
                roles_warning(off), partition_warning(train_files)]
    return [w for w in warnings if w] + [f"{k:<9}{v}" for k, v in lines]
