"""One typed configuration for a run: dataclasses, loaded from YAML, overridable.

    dlrm train --config configs/tiny.yaml data.batch_size=512 optim.sparse=adam

Every key is a dataclass field below; an unknown key, a value of the wrong type or
one out of its range (dlrm/config_rules.py) is a :class:`ConfigError` naming the
key. The full config is printed at the start of a run and saved beside the
checkpoint (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from data.errors import UserError, one_line
from data.generate import GenerateConfig
from dlrm.config_rules import check_config, idle_hotline_keys

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # a number YAML 1.1 misses


class ConfigError(UserError):
    """A config file or override that does not fit the schema below."""


class Paths(str):
    """The type of a key naming data files: a file, directory or glob, a comma-separated
    list of those, or a YAML list of them (``train: [/data/day_0, /data/day_1]``), held
    as one comma-separated string (what ``data.files.expand_paths`` reads)."""


@dataclass
class DataConfig:
    train: Paths = ""  # files, directories or globs of Parquet files, comma-separated or a list
    eval: Paths = ""
    label: str = "label"
    # Columns; empty means "infer from the Parquet files" (float → dense; int, string,
    # binary, dictionary and lists of those → sparse; rows: see `encoding` below).
    dense: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)
    # Columns no feature takes when dense or sparse is inferred: a row id, a timestamp
    # kept for joins (Avazu's `id`: data.exclude=[id]).
    exclude: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # per-feature table rows
    tables: dict[str, str] = field(default_factory=dict)  # feature → shared table name
    batch_size: int = 2048  # global: split across ranks
    eval_batch_size: int = 8192
    shuffle: bool = True
    # Rows of a shuffle window (held in memory per rank, and per decode worker; the unit
    # data.workers share out). auto: 4 x the largest row group of data.train (footers),
    # at least 65536 and at most 256 MB of records, so a row group that straddles two
    # windows given to two workers (both decode it whole) costs at most about a quarter
    # more decoding. A run saves the rows it used (RUN/config.yaml, its checkpoints), and
    # auto on resume takes its checkpoint's: the batches stay those it started with.
    shuffle_buffer: str = "auto"
    # batches decoded ahead by the background thread; each decode worker (data.workers)
    # decodes a whole shuffle window ahead, at least this many (ParquetReader.worker_depth)
    prefetch: int = 4
    # Processes decoding row groups in parallel (data/decode_workers.py), the batches the
    # same as with 0 (one background thread). auto: with CUDA, the cores the training
    # processes leave free (cores / local ranks - 1), as many as /dev/shm holds the
    # batches of; on CPU 0 (the trainer's threads use every core). A count /dev/shm
    # cannot hold is one error line before the workers start (docker: --shm-size).
    workers: str = "auto"
    # Benchmark: train on the first epoch's batches read once and kept (on the device under
    # CUDA), replayed every epoch: the step's rate without the input (dlrm/train/staged.py)
    in_memory: bool = False
    id_policy: Literal["error", "hash", "modulo"] = "error"  # ids >= table rows
    # Eval (in training and dlrm eval) with data.id_policy=error: an id past its
    # trained table is looked up as nothing (left out of its bag) and counted per
    # column beside the AUC; true: refuse it as training does (dlrm eval --strict-ids)
    eval_strict_ids: bool = False
    dense_nan: Literal["error", "zero"] = "error"  # NaN/inf dense values
    # Bad rows or row groups (nulls, NaN, bad ids, unreadable or vanished files):
    # fail = stop with file / row group / column / row; skip = drop them, count them,
    # report them at the end and list them in RUN/bad_data.jsonl.
    on_error: Literal["fail", "skip"] = "fail"
    # Read in the batch order of a job of this many ranks (0 = this job's own);
    # one process with order_world_size=W sees the global batches of a W-rank job.
    order_world_size: int = 0
    # Categorical columns (int, string, binary, dictionary, list of those): how a
    # value becomes a table row (data/preprocess.py). auto: vocabulary for strings and
    # binary and for ints whose max id is far beyond their distinct count, else the id
    # itself; vocabulary: fitted by one pass over data.train, row 0 = out-of-vocabulary;
    # hash: stable hash into data.rows[column] (else hash_rows) buckets, no pass;
    # identity: the int id is the row (data.id_policy for ids >= rows).
    encoding: Literal["auto", "identity", "vocabulary", "hash"] = "auto"
    encodings: dict[str, Literal["auto", "identity", "vocabulary", "hash"]] = field(
        default_factory=dict)  # per column, over `encoding`
    min_frequency: int = 1  # vocabulary: values seen fewer times share the OOV row 0
    max_rows: int = 0  # vocabulary: at most this many rows per table, most frequent (0 = all)
    hash_rows: int = 1 << 20  # hash: buckets of a column data.rows does not size
    # Dense columns: none | log1p (log(1 + max(x, 0))) | standardize ((x - mean) / std,
    # statistics from the same pass); dense_transforms sets single columns ({I1: log1p}).
    dense_transform: Literal["none", "log1p", "standardize"] = "none"
    dense_transforms: dict[str, Literal["none", "log1p", "standardize"]] = field(
        default_factory=dict)
    # A directory holding a fit's preprocessing.json and vocabularies (`dlrm fit --out`,
    # or a run directory): used instead of fitting, refused if the data files are not
    # the ones it was fitted over (sha256 of their Parquet footers). "" = fit.
    preprocessing: str = ""
    # Processes that count the vocabulary pass's categorical columns, each over a
    # disjoint share of the row groups (0 or 1 = in this process: one worker would only
    # be waited for); the counts are exact and merged, so the vocabularies are the same
    # bit for bit.
    fit_workers: int = 0
    # min_frequency > 1, or a vocabulary capped by max_rows / rows: a count-min sketch
    # pass first drops values that cannot reach it or the cap's top (data/fit_cap.py), so
    # exact counting holds only the survivors (the vocabulary is the same; a pass more).
    fit_sketch: bool = True


@dataclass
class ModelConfig:
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 16])  # last = embedding_dim
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])  # last = 1
    interaction: Literal["dot", "dcn"] = "dot"
    dcn_layers: int = 3
    dcn_rank: int = 0  # 0 = full-rank DCNv2 cross layers, else low-rank


@dataclass
class OptimConfig:
    dense: Literal["sgd", "adagrad", "adam"] = "adagrad"
    dense_lr: float = 0.01
    sparse: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    sparse_lr: float = 0.05
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warm-up from 0
    decay_start: int = 0  # step where linear decay to 0 starts (0 = no decay)
    decay_steps: int = 0


@dataclass
class TablePlacement:
    """Pin one table to a strategy (and ranks) instead of letting the planner choose."""

    sharding: Literal["table_wise", "column_wise", "row_wise", "data_parallel"] = "table_wise"
    ranks: list[int] = field(default_factory=list)  # empty: planner's choice (TW) or all ranks


@dataclass
class EmbeddingsConfig:
    # native: our collection; torchrec: TorchRec's DLRM under DistributedModelParallel
    # (FBGEMM fused optimizer; on CPU no Adam), to compare with or to fall back on;
    # torch_baseline: one nn.EmbeddingBag(sparse=True) per table and a stock torch
    # optimizer, one process (dlrm/models/torch_baseline.py), the bench's plain-PyTorch row.
    backend: Literal["native", "torchrec", "torch_baseline"] = "native"
    pooling: Literal["sum", "mean"] = "sum"
    # Storage type of every table's weights (TorchRec's data_type, fbgemm's
    # weights_precision): fp16/bf16 halve table memory; lookups and updates are
    # computed in fp32, written back with stochastic rounding (embeddings/rounding.py).
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    # Per table, over `dtype` ({C1: bf16}); tables of each dtype are stacked apart.
    dtypes: dict[str, Literal["fp32", "fp16", "bf16"]] = field(default_factory=dict)
    # Element-wise optimizer state (adagrad's sum, adam's moments): computed in fp32,
    # stored in this type with stochastic rounding; row-wise Adagrad's sum stays fp32.
    state_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    # Fused: the sparse optimizer runs inside backward (no KV gradient kept).
    # Off: backward produces KV gradients (unique ids, rows) that the optimizer
    # then applies; a user who wants to see embedding gradients sets this off.
    fused: bool = True
    # The lookup's and update's kernels: auto = Triton on CUDA (embeddings/kernels: one
    # launch for every bag, optimizer fused in the sorted backward), torch elsewhere;
    # triton forces them (on CPU only under TRITON_INTERPRET=1, as the tests run them).
    kernels: Literal["auto", "triton", "torch"] = "auto"
    # Hybrid parallel (more than one rank): the planner places every table unless
    # pinned here, within memory_per_rank (e.g. "16GB"; empty = no limit).
    # sharded: tables on the ranks per the plan; hotline: hot rows on the device,
    # the rest in host memory, one pass per mini-batch (see hotline:)
    placement: Literal["sharded", "hotline"] = "sharded"
    plan: dict[str, TablePlacement] = field(default_factory=dict)
    memory_per_rank: str = ""
    replicate_max_bytes: int = 1 << 20  # tables this small are replicated (data_parallel)


@dataclass
class HotlineConfig:
    """embeddings.placement=hotline: which rows are hot and how they are chosen."""

    budget: str = "256MB"  # device bytes for hot rows (weights + optimizer state)
    profile_fraction: float = 0.05  # share of the training batches profiled at start
    profile_seconds: float = 60.0  # profiling time bound
    refresh_every: int = 0  # steps; re-choose the hot rows from the batches since (0 = never)
    # room the budget has left once every counted row is hot takes rows no profile saw,
    # the smallest tables first (a budget over the tables holds every row); false keeps
    # them on the host (the device memory left unused)
    fill_unseen: bool = True
    pipeline: bool = True  # gather cold rows on a host thread while the step's hot side runs
    # The step is one pass per mini-batch: the dense model (MLPs, interaction, loss) runs
    # once over it, the cold rows gathered while the hot lookups and the bottom MLP run.
    # (hotline.dense_pass is gone: see REMOVED_KEYS below.)
    # CUDA graphs inside the eager Hotline step; auto = on where they can run (CUDA, one
    # process, and each option's own conditions), else off without a word (the summary's
    # step_mode says which ran); on = asked for: where they cannot run, one warning line
    # and the step eager; off = eager. YAML's true / false read as on / off.
    # graph_dense: the dense model's halves (bottom MLP; interaction and top MLP; under
    # autocast with train.precision=bf16), train.accumulate=1 (dlrm/train/dense_graphs.py).
    # graph_split: the on-device split of each mini-batch (dlrm/train/split_graphs.py;
    # several table dtypes: replayed for batches with the captured ids per feature). One H200 (26 tables,
    # budget 128MB, batch 4096): 1.32x with graph_dense, 1.43x with both (README).
    graph_dense: Literal["auto", "on", "off"] = "auto"
    graph_split: Literal["auto", "on", "off"] = "auto"
    # graph_step: the whole step captured and replayed, the cold rows staged into static
    # buffers (dlrm/train/hotline_graph.py): one process, the hot tier on the Triton
    # kernels (a static step per dtype group); where it runs it replaces graph_dense.
    # One H200 (bench_gpu.yaml, 510732f): 1,170,850 samples/s against the eager step's
    # 634,883 (1.84x), 1.75x with bf16 tables.
    graph_step: Literal["auto", "on", "off"] = "auto"
    # host threads of ours gathering cold rows into the pinned buffer, each a slice of
    # the ids, one numba kernel each (embeddings/host_rows.py; 1: the gather thread
    # itself); 0 = one index_select over torch's intra-op threads (train.threads), the
    # gather until 2026-11-28, whose parallel region, as wide as the machine, waited on
    # cores the decode workers held. host_embedding uses the same gather
    gather_threads: int = 1
    # where a static step's cold rows are updated: device = in the replay, by the hot
    # rows' kernel, the host storing the results (embeddings/hotline/cold_stage.py: every
    # table type and optimizer); host = their
    # gradient goes home and the host tier's update thread applies it, which the next
    # step's gather waits for (the 2026-11-27 H200: the GPU idle 2 of 3.4 ms a step)
    cold_update: Literal["device", "host"] = "device"
    # how a step's cold rows reach a GPU and go home: host = gathered on a host thread into
    # a pinned buffer, copied over, a static step's updated rows copied back and stored by
    # the host-update thread; mapped = the host tables registered with CUDA once, read and
    # written in place by the device (embeddings/hotline/mapped.py: an index_select and an
    # index_copy_ a tensor on the step loop's stream, no gather thread, no copy; one
    # process). Not yet measured on a GPU (scripts/gpu_session.sh bench runs it beside
    # host); where CUDA refuses to register the tables, one warning line and host
    cold_path: Literal["host", "mapped"] = "host"


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: int = 0  # 0 = run the epochs
    eval_every: int = 0  # steps; 0 = only at the end
    log_every: int = 50
    checkpoint_every: int = 0  # steps; 0 = not by steps (checkpoint_seconds and the end still save)
    checkpoint_seconds: float = 1800.0  # also save once this much time passed since the last save (0 = off)
    keep_checkpoints: int = 2  # complete checkpoints kept in RUN/checkpoints/ (the newest)
    # the end of the run saves a checkpoint; false: it does not (a benchmark's runs:
    # bench_gpu's 8.6 GB of tables written for nothing, row after row). A signal's stop,
    # checkpoint_every, checkpoint_seconds and keep_best still save.
    final_checkpoint: bool = True
    # The eval that scored best by best_metric: keep_best saves a checkpoint at each eval
    # that improves on it and never prunes it (RUN/checkpoints/best.json names it);
    # early_stop=N ends the run after N evals in a row that did not improve on it
    # (0 = off). Both need data.eval and, for early_stop, train.eval_every
    # (dlrm/train/best.py).
    keep_best: bool = False
    early_stop: int = 0
    best_metric: Literal["auc", "logloss"] = "auc"
    # Warm start: a fresh run copies the dense part and each table's rows, matched by
    # value, from this run directory's newest checkpoint (or a RUN/checkpoints/step-N);
    # a resume ignores it (dlrm/checkpoint/warm_start.py). "" = start from the seed.
    init_from: str = ""
    # Record the rows each rank trains on: the values of this column (dense integer
    # or single-hot sparse) per step in RUN/trace/rank-R.jsonl ("" = off; tests, audits)
    trace_rows: str = ""
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # Keep freed host memory in the process (glibc malloc thresholds) so each
    # step's large temporaries are not page-faulted in again (dlrm/host_memory.py)
    reuse_host_memory: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # under torchrun; auto: nccl with CUDA
    accumulate: int = 1  # micro-batches per optimizer step (one step = a k times larger batch)
    ddp_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_warmup: int = 100  # uncompressed steps before PowerSGD starts
    timeout_s: int = 600  # collectives; a dead peer ends the job instead of hanging
    # bf16: the MLPs and the interaction run under autocast (bf16 matmuls, fp32
    # weights); embeddings, optimizers, loss and eval stay fp32. Opt-in: results
    # then differ from fp32 training by bf16 rounding (see README).
    # CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa products, fp32
    # accumulation), as torch.backends.cuda.matmul.allow_tf32; false: full fp32
    tf32: bool = True
    # CUDA graphs: capture the whole step once and replay it (dlrm/train/graphs.py):
    # auto = where the step is capturable, else eager (the summary says which ran);
    # on = a run that cannot is a one-line error; off = eager
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    # bf16 measured slower than fp32 at start (no native bf16: dlrm/train/precision.py):
    # fp32 = train in fp32 with a warning; error = stop; none = keep bf16 (benchmarks)
    precision_fallback: Literal["fp32", "error", "none"] = "fp32"
    time_sections: bool = False  # ms per step by section in the summary (dlrm bench)
    # Steps left out of samples/s and the sections (allocator, caches, compiles and
    # CUDA-graph capture settle in them); dlrm bench also skips Hotline's profile window.
    timing_warmup: int = 5
    # torch.profiler over steps profile_start .. +profile_steps-1: RUN/profile/rank-R.txt
    # (operators by time) and .json (Chrome trace); 0 steps = off
    profile_start: int = 10
    profile_steps: int = 0
    # torch: the profiler above (the steps run eager); python: cProfile of the step loop's
    # Python, the steps as they run (CUDA graphs too): RUN/profile/rank-R-python.txt;
    # threads: each thread's CPU and context switches a step, nothing recorded during the
    # steps: RUN/profile/rank-R-threads.txt (every mode's report starts with this census)
    profile_mode: Literal["torch", "python", "threads"] = "torch"
    progress: bool = True
    # Print the resolved config and the full sharding plan at start (dlrm train
    # --print-config); off: a short header, the config is in RUN/config.yaml
    print_config: bool = False
    # Also write the metrics as TensorBoard scalars in RUN/tensorboard/ (rank 0;
    # needs `pip install tensorboard`): loss, samples/s, eval, Hotline stats
    tensorboard: bool = False


@dataclass
class Config:
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    hotline: HotlineConfig = field(default_factory=HotlineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------- load


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                warn: Callable[[str], None] | None = None, resuming: bool = False) -> Config:
    """Read ``path`` (YAML; None = defaults) and apply ``key.sub=value`` overrides.
    ``warn``: told of keys set that this config does not read (config_rules.py) and of
    removed keys kept (``REMOVED_KEYS``). ``resuming``: the config resumes a run that
    has a checkpoint (a removed value it may have started with is then let through)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({one_line(e)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        raw = loaded
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = nxt
        try:
            node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            node[parts[-1]] = value
    note = removed_key_note(raw, resuming)
    if warn is not None and note is not None:
        warn(note)
    cfg = from_dict(Config, raw, "")
    broken = check_config(cfg)
    if broken is not None:
        raise ConfigError(broken)
    idle = idle_hotline_keys(raw, cfg)
    if warn is not None and idle is not None:
        warn(idle)
    return cfg


# --------------------------------------------------------------------------- removed keys

# Keys that are gone, with the values a config from before could hold. A saved config
# (RUN/config.yaml, a checkpoint's meta.json) of a run from before still loads (dlrm
# eval, export, a resume): from_dict drops them; load_config says what became of them.
REMOVED_KEYS: dict[str, tuple[str, ...]] = {"hotline.dense_pass": ("once", "per_micro_batch")}


def _removed(key: str, value: Any) -> bool:
    """Whether ``key`` is one of ``REMOVED_KEYS`` (a value it never held: a ConfigError)."""
    old = REMOVED_KEYS.get(key)
    if old is not None and value not in old:
        raise ConfigError(f"config key {key}: {value!r} is not one of {list(old)} (a removed key: drop it)")
    return old is not None


def removed_key_note(raw: dict[str, Any], resuming: bool) -> str | None:
    """What became of ``hotline.dense_pass`` in a config a user gives (None: not set).
    ``per_micro_batch``, the Hotline paper's step (a popular and a non-popular
    micro-batch, the dense model run on each), was removed after one H200 measured one
    pass per mini-batch 1.41x faster: a new run asking for it is refused; a resume of a
    run that had it goes on with one pass. Both steps are one optimizer step over the
    mini-batch, tested equal to ordinary training; only the float sums' order differs."""
    section = raw.get("hotline")
    if not isinstance(section, dict) or "dense_pass" not in section:
        return None
    value = section["dense_pass"]
    _removed("hotline.dense_pass", value)
    if value == "once":
        return "note: hotline.dense_pass=once is Hotline's only step now: the key can go"
    why = ("removed after one H200 measured one pass per mini-batch 1.41x faster "
           "(477,258 against 339,362 samples/s, configs/bench_gpu.yaml)")
    if not resuming:
        raise ConfigError(f"config key hotline.dense_pass=per_micro_batch: {why}; drop the key")
    return (f"note: hotline.dense_pass=per_micro_batch was {why}; this resume trains one pass per "
            "mini-batch: the same training maths (both equal ordinary training), float sums in another order")


def from_dict(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'}: expected a mapping")
    raw = {k: v for k, v in raw.items() if not _removed(f"{prefix}{k}", v)}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key, _, rest = str(unknown[0]).partition(":")
        hint = (f"; YAML reads '{unknown[0]}' as one key: write '{key}: {rest}', a space after the colon"
                if rest and key in names else "")
        raise ConfigError(
            f"config key {prefix}{unknown[0]} does not exist (known in "
            f"{prefix.rstrip('.') or 'top level'}: {', '.join(sorted(names))}){hint}"
        )
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**values)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, key + ".")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if value not in allowed:
            raise ConfigError(f"config key {key}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            value = [value]  # a single value where a list is expected: a list of one
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key}: expected a mapping, got {value!r}")
        for k, v in value.items():  # {C1:bf16}: one key C1:bf16 with no value, to YAML
            if v is None and isinstance(k, str) and ":" in k:
                name, _, rest = k.partition(":")
                raise ConfigError(f"config key {key}: YAML reads '{k}' as one key with no value: "
                                  f"write '{name}: {rest}', a space after the colon")
        return {_coerce(k_tp, k, key): _coerce(v_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key {key}: expected a number, got {value!r}")
    if tp is Paths and isinstance(value, list):  # a YAML list of paths ([] is none, as "")
        if all(isinstance(v, str) for v in value):
            return ",".join(v.strip() for v in value)
        raise ConfigError(f"config key {key}: expected a path or a list of paths, got {value!r}")
    if tp in (str, Paths):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key {key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp} for {key}")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

