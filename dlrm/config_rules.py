"""What each config value may be: one rule per key, checked when a config is loaded.

``from_dict`` (dlrm/config.py) already holds every value to its type (an int, a
float, one of a Literal's names); this file holds it to its range, so a bad value
is one line naming the key at load instead of a traceback deep in a run:

    config key model.embedding_dim=-4: must be an integer >= 1
    config key model.top_mlp=[512, 256, 2]: must end at 1 (one logit per sample)

``RULES`` maps a dotted key to a :class:`Rule`: what is allowed, in words, and a
check of the value. A new numeric key needs a line here
(tests/test_config_rules.py fails without one). ``RELATIONS`` are the checks that
read more than one key (an MLP's last width against the embedding dim).

The checks take the config as a plain value (a ``dlrm.config.Config``, read by
attribute); this file imports nothing of dlrm.config, which imports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from embeddings.plan.sizes import parse_size
from embeddings.plan.types import PlanError


@dataclass(frozen=True)
class Rule:
    """What a value may be: ``allowed`` says it in words, ``fits`` checks it."""

    allowed: str  # a noun phrase: "an integer >= 1"
    fits: Callable[[Any], bool]


def at_least(low: int) -> Rule:
    """An integer >= ``low`` (0 where 0 means off, 1 for counts and sizes)."""
    return Rule(f"an integer >= {low}", lambda v: v >= low)


def number(low: float = 0.0, high: float = math.inf, *, open_low: bool = True) -> Rule:
    """A finite number in (low, high] (``open_low=False``: [low, high])."""
    above = f"> {low:g}" if open_low else f">= {low:g}"
    return Rule(
        f"a finite number {above}" + (f" and <= {high:g}" if high < math.inf else ""),
        lambda v: math.isfinite(v) and (v > low if open_low else v >= low) and v <= high,
    )


def size(*, empty_ok: bool) -> Rule:
    """A byte count as people write it: "16GB", "512MiB", "4096" ("" too where ``empty_ok``)."""
    def fits(v: str) -> bool:
        if not v.strip():
            return empty_ok
        try:
            parse_size(v)
        except PlanError:
            return False
        return True
    return Rule("a size above 0 like 256MB, 16GiB or 4096 (bytes)" + (', or "" for no limit' if empty_ok else ""),
                fits)


def each(rule: Rule, *, non_empty: bool = False, mapping: bool = False) -> Rule:
    """Every item of a list (``mapping``: every value of a mapping) by ``rule``."""
    def fits(v: list[Any] | dict[Any, Any]) -> bool:
        items = list(v.values()) if isinstance(v, dict) else v
        return bool(items or not non_empty) and all(rule.fits(x) for x in items)
    kind = "mapping, each value" if mapping else "list, each"
    return Rule(f"a {'non-empty ' if non_empty else ''}{kind} {rule.allowed}", fits)


POSITIVE, OFF_OR_MORE = at_least(1), at_least(0)
LAYERS = each(at_least(1), non_empty=True)

RULES: dict[str, Rule] = {
    "seed": OFF_OR_MORE,
    "data.rows": each(POSITIVE, mapping=True),
    "data.batch_size": POSITIVE,
    "data.eval_batch_size": POSITIVE,
    "data.shuffle_buffer": Rule('"auto" or an integer >= 1',
                                lambda v: v == "auto" or (v.isdigit() and int(v) >= 1)),
    "data.prefetch": OFF_OR_MORE,
    "data.workers": Rule('"auto" or an integer >= 0', lambda v: v == "auto" or v.isdigit()),
    "data.order_world_size": OFF_OR_MORE,
    "data.min_frequency": POSITIVE,
    "data.max_rows": OFF_OR_MORE,
    "data.fit_workers": OFF_OR_MORE,
    "data.hash_rows": POSITIVE,
    "generate.rows": POSITIVE,
    "generate.dense": OFF_OR_MORE,
    "generate.sparse": OFF_OR_MORE,
    "generate.table_rows": each(POSITIVE, non_empty=True),
    "generate.zipf": number(open_low=False),
    "generate.multi_hot": OFF_OR_MORE,
    "generate.max_bag": OFF_OR_MORE,
    "generate.signal": number(open_low=False),
    "generate.row_group_rows": POSITIVE,
    "generate.file_rows": POSITIVE,
    "model.embedding_dim": POSITIVE,
    "model.bottom_mlp": LAYERS,
    "model.top_mlp": LAYERS,
    "model.dcn_layers": POSITIVE,
    "model.dcn_rank": OFF_OR_MORE,
    "optim.dense_lr": number(),
    "optim.sparse_lr": number(),
    "optim.eps": number(),
    "optim.warmup_steps": OFF_OR_MORE,
    "optim.decay_start": OFF_OR_MORE,
    "optim.decay_steps": OFF_OR_MORE,
    "embeddings.plan.*.ranks": each(OFF_OR_MORE),
    "embeddings.memory_per_rank": size(empty_ok=True),
    "embeddings.replicate_max_bytes": OFF_OR_MORE,
    "hotline.budget": size(empty_ok=False),
    "hotline.profile_fraction": number(high=1.0),
    "hotline.profile_seconds": number(),
    "hotline.refresh_every": OFF_OR_MORE,
    "hotline.gather_threads": OFF_OR_MORE,
    "train.epochs": POSITIVE,
    "train.max_steps": OFF_OR_MORE,
    "train.eval_every": OFF_OR_MORE,
    "train.early_stop": OFF_OR_MORE,
    "train.log_every": OFF_OR_MORE,
    "train.timing_warmup": OFF_OR_MORE,
    "train.checkpoint_every": OFF_OR_MORE,
    "train.checkpoint_seconds": number(open_low=False),
    "train.keep_checkpoints": POSITIVE,
    "train.threads": OFF_OR_MORE,
    "train.accumulate": POSITIVE,
    "train.powersgd_warmup": OFF_OR_MORE,
    "train.timeout_s": POSITIVE,
    "train.profile_start": OFF_OR_MORE,
    "train.profile_steps": OFF_OR_MORE,
}


# --------------------------------------------------------------------------- relations
# Each: the config → (key, value, what is allowed) of the first value that breaks it.

Broken = tuple[str, Any, str] | None


def mlp_ends(cfg: Any) -> Broken:
    """The bottom MLP's output is one more vector beside the pooled embeddings (both
    interactions stack them), so it ends at embedding_dim; the top MLP ends at one logit."""
    m = cfg.model
    if m.bottom_mlp[-1] != m.embedding_dim:
        why = f"the {m.interaction} interaction stacks it beside the embeddings"
        return "model.bottom_mlp", m.bottom_mlp, f"must end at model.embedding_dim ({m.embedding_dim}): {why}"
    if m.top_mlp[-1] != 1:
        return "model.top_mlp", m.top_mlp, "must end at 1 (one logit per sample)"
    return None


def generated_tables(cfg: Any) -> Broken:
    """generate.table_rows is one value for every table or one per table."""
    g = cfg.generate
    if len(g.table_rows) not in (1, g.sparse):
        return ("generate.table_rows", g.table_rows,
                f"must be one value or generate.sparse ({g.sparse}) values")
    if g.multi_hot > g.sparse:
        return "generate.multi_hot", g.multi_hot, f"must be <= generate.sparse ({g.sparse})"
    return None


def table_dtypes(cfg: Any) -> Broken:
    """Per-table dtypes and half optimizer state are the native engine's (every placement:
    tables of several dtypes are stacked apart, Hotline keeps one collection per dtype)."""
    e = cfg.embeddings
    if e.backend != "native" and (e.dtypes or e.state_dtype != "fp32"):
        key, value = ("embeddings.dtypes", e.dtypes) if e.dtypes else ("embeddings.state_dtype", e.state_dtype)
        return key, value, "needs embeddings.backend=native"
    return None


def hotline_backend(cfg: Any) -> Broken:
    """Hotline's two tiers are native collections: TorchRec's model has no host tier
    (the run profiled, then died in an AttributeError at its first step)."""
    e = cfg.embeddings
    if e.placement == "hotline" and e.backend != "native":
        return ("embeddings.backend", e.backend,
                "embeddings.placement=hotline runs on embeddings.backend=native only (drop one of the two)")
    return None


def best_eval(cfg: Any) -> Broken:
    """keep_best and early_stop go by the evals: without an eval set there are none, and
    early_stop counts evals, which without eval_every are one (the run's end)."""
    t = cfg.train
    if (t.keep_best or t.early_stop) and not cfg.data.eval:
        key, value = ("train.early_stop", t.early_stop) if t.early_stop else ("train.keep_best", t.keep_best)
        return key, value, "needs an eval set: set data.eval=PATH"
    if t.early_stop and not t.eval_every:
        return ("train.early_stop", t.early_stop,
                "counts evals: set train.eval_every=STEPS too (without it the run evaluates once, at its end)")
    return None


RELATIONS: list[Callable[[Any], Broken]] = [mlp_ends, generated_tables, table_dtypes, hotline_backend,
                                            best_eval]


def idle_hotline_keys(given: dict[str, Any], cfg: Any) -> str | None:
    """A warning naming the ``hotline.*`` keys ``given`` (the YAML with its overrides,
    before defaults) when Hotline is off: nothing reads them, and the run trained as
    an ordinary one, silently. A warning, not a refusal: one file may serve both
    placements (configs/bench_gpu.yaml: dlrm bench runs native and Hotline engines)."""
    section = given.get("hotline")
    if not isinstance(section, dict) or not section or cfg.embeddings.placement == "hotline":
        return None
    keys = ", ".join(f"hotline.{k}" for k in section)
    return (f"warning: {keys} set, but Hotline is off (embeddings.placement={cfg.embeddings.placement}): "
            "they do nothing; embeddings.placement=hotline turns it on")


# --------------------------------------------------------------------------- check


def values(node: Any, prefix: str = "", rule_prefix: str = "") -> Iterable[tuple[str, str, Any]]:
    """(rule key, key, value) of every field below dataclass ``node``. A mapping of
    dataclasses (embeddings.plan) has ``*`` for its keys in the rule key."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key, rule_key = f"{prefix}{f.name}", f"{rule_prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from values(value, key + ".", rule_key + ".")
        elif isinstance(value, dict) and any(dataclasses.is_dataclass(v) for v in value.values()):
            for k, v in value.items():
                yield from values(v, f"{key}.{k}.", f"{rule_key}.*.")
        else:
            yield rule_key, key, value


def check_config(cfg: Any) -> str | None:
    """The first broken rule as one line naming the key, its value and what is allowed."""
    for rule_key, key, value in values(cfg):
        rule = RULES.get(rule_key)
        if rule is not None and not rule.fits(value):
            return f"config key {key}={value!r}: must be {rule.allowed}"
    for relation in RELATIONS:
        broken = relation(cfg)
        if broken is not None:
            key, value, message = broken
            return f"config key {key}={value!r}: {message}"
    return None
