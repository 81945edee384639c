"""The data.* settings a fit was made with, and the check that a run's settings still
give that fit when the run does not fit again.

Two runs take a saved fit instead of fitting: a resume (RUN/preprocessing.json) and
``data.preprocessing=DIR``. Before this check, each ignored the data.* settings that
shape a fit, silently: a resume with ``data.min_frequency=3`` or
``data.encodings={C1: hash}`` trained on the old mapping. Now a setting that would
give another fit stops the run with one line naming it. Only what changes the fit
counts: ``min_frequency`` where the fit has a vocabulary, ``hash_rows`` where a hashed
table takes it; an ``auto`` column (the default) takes whatever the fit decided. A fit saved before the
settings were recorded is checked on what it holds (encodings, dense transforms).
"""

from __future__ import annotations

from typing import Any

from data.errors import UserError
from data.schema import Schema


def recorded(opts: Any) -> dict[str, Any]:
    """What preprocessing.json keeps of ``opts`` (data/preprocess.py ``Options``)."""
    return {"encoding": opts.encoding, "encodings": dict(sorted(opts.encodings.items())),
            "min_frequency": opts.min_frequency, "max_rows": opts.max_rows, "hash_rows": opts.hash_rows,
            "rows": dict(sorted(opts.rows.items()))}


def check_settings(fit: Any, opts: Any, schema: Schema, where: str, hint: str) -> None:
    """One line if ``opts`` (this run's settings) would not give ``fit`` (a
    data/preprocess.py ``Preprocessing``: its encodings, transforms and the settings
    it was fitted with, {} if not recorded), saved at ``where``. ``hint``: what the
    user can do, ending the line."""
    differs = _differences(fit.encodings, fit.transforms, fit.settings, opts, schema)
    if differs:
        raise UserError(f"{where}: {differs[0]}; {hint}")


def _differences(encodings: dict[str, str], transforms: dict[str, str], saved: dict[str, Any],
                 opts: Any, schema: Schema) -> list[str]:
    out = []
    for name, transform in sorted(transforms.items()):
        want = opts.dense_transforms.get(name, opts.dense_transform)
        if want != transform:
            out.append(f"data.dense_transform(s) asks {want} for {name}, the fit has {transform}")
    for f in schema.sparse:
        have = encodings.get(f.table_name)
        want = opts.encodings.get(f.name, opts.encoding)
        # auto (the default) leaves the choice to the fit; an explicit ask passes when
        # it is what the fit was asked or what it has
        before = saved["encodings"].get(f.name, saved["encoding"]) if "encoding" in saved else "auto"
        if have is not None and want not in ("auto", before, have):
            asked = f" (asked {before})" if "encoding" in saved and before != have else ""
            out.append(f"data.encoding(s) asks {want} for {f.name}, the fit has {have}{asked}")
    if "vocabulary" in encodings.values():
        out += _changed(saved, opts, ("min_frequency", "max_rows"))
    capped = [f.name for f in schema.sparse if encodings.get(f.table_name) in ("vocabulary", "hash")]
    rows_then, rows_now = saved.get("rows", {}), opts.rows
    if "rows" in saved:
        out += [f"data.rows.{n} is {rows_now.get(n, 'unset')} here, {rows_then.get(n, 'unset')} for the fit"
                for n in capped if rows_now.get(n) != rows_then.get(n)]
    if any(encodings.get(f.table_name) == "hash" and f.name not in opts.rows for f in schema.sparse):
        out += _changed(saved, opts, ("hash_rows",))
    return out


def _changed(saved: dict[str, Any], opts: Any, keys: tuple[str, ...]) -> list[str]:
    return [f"data.{k} is {getattr(opts, k)} here, {saved[k]} for the fit"
            for k in keys if k in saved and saved[k] != getattr(opts, k)]
