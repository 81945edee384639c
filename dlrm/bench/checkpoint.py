"""``dlrm bench --checkpoint``: how fast a checkpoint is written and resumed, and what
memory either needs beyond the model itself.

    process 1   build the config's model ─► save_checkpoint ─────────► save GB/s,
                (tables from its generate: section)                    peak RSS during the save
    process 2   build for a resume (no random init) ─► verify ─► load ─► load GB/s,
                                                                       peak RSS during the resume

Each phase runs in a fresh process, so that one's high-water mark says nothing of the
other's. Peak RSS is the kernel's (``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs`` right before the phase); where that cannot be reset, a thread
samples ``VmRSS`` every 2 ms. The overhead reported is the peak minus what the process
held without the save (the live model and the interpreter), set against the issue's
bound: 10% of the model state or 512 MiB, whichever is larger. ``dd`` with and without
``oflag=direct`` to the same directory gives the disk's own rate beside it.
"""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MIB = 2**20


def rss_bytes(field: str = "VmRSS") -> int:
    """``field`` (VmRSS, VmHWM) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def read_chars() -> int:
    """Bytes this process has read through read(2) and its kin so far
    (``rchar`` of /proc/self/io; a mapped file's pages are not counted)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


@contextmanager
def peak_rss() -> Iterator[Callable[[], int]]:
    """The process's peak RSS in bytes while the block runs (call the yielded
    function after it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        peak = [rss_bytes()]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.002):
                peak[0] = max(peak[0], rss_bytes())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield lambda: peak[0]
        finally:
            stop.set()
            thread.join()
        return
    result = [0]
    try:
        yield lambda: result[0]
    finally:
        result[0] = rss_bytes("VmHWM")


def allowed_overhead(state_bytes: int) -> int:
    """The issue's bound beyond the live model: 10% of it or 512 MiB, the larger."""
    return max(state_bytes // 10, 512 * MIB)


def _model(config: str, overrides: list[str], resume: bool) -> tuple[Any, Any, Any, Any]:
    """(cfg, schema, model, dense optimizer) of the config's generate: tables."""
    from data.generate import generator_schema
    from dlrm.config import load_config
    from dlrm.parallel.parallelize import build_model
    from dlrm.train.optim import build_dense_optimizer

    cfg = load_config(config, overrides)
    schema = generator_schema(cfg.generate)
    model = build_model(cfg, schema, "cpu", None, resume=resume)
    return cfg, schema, model, build_dense_optimizer(cfg, model.dense_parameters())


def state_bytes(model: Any) -> int:
    """Bytes of the model's tensors that a checkpoint holds (tables, optimizer state, MLPs)."""
    dense, tables = model.state_for_checkpoint()
    total = sum(t.nbytes for t in dense["dense"].values())
    if tables is not None:
        total += sum(t.nbytes for _, held in tables.held for t in held.values())
    return total


def tables_sum(model: Any) -> float:
    """The float64 sum of every table and optimizer state value: the same before the
    save and after the resume (a cheap check that the load filled everything)."""
    _, tables = model.state_for_checkpoint()
    import torch

    return sum(float(t.sum(dtype=torch.float64)) for _, held in tables.held for t in held.values())


def save_phase(config: str, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """Build the model (timed: the random init a resume skips), then save it."""
    import torch

    from dlrm.checkpoint.manager import Progress, save_checkpoint
    from dlrm.config import to_dict

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg, schema, model, opt = _model(config, overrides, resume=False)
    build_s = time.perf_counter() - t0
    before = rss_bytes()
    t0 = time.perf_counter()
    with peak_rss() as peak:
        ckpt = save_checkpoint(Path(run_dir), model, opt, Progress(global_step=1), to_dict(cfg), schema)
    seconds = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    return {"build_s": build_s, "state_bytes": state_bytes(model), "rss_before": before,
            "peak_rss": peak(), "seconds": seconds, "disk_bytes": disk, "tables_sum": tables_sum(model)}


def load_phase(config: str, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """A resume as ``dlrm train`` does it: build for a resume, verify, load."""
    import torch

    from dlrm.checkpoint.manager import resume_checkpoint
    from dlrm.config import to_dict

    torch.set_num_threads(1)
    before = rss_bytes()
    with peak_rss() as peak:
        t0 = time.perf_counter()
        cfg, schema, model, opt = _model(config, overrides, resume=True)
        build_s = time.perf_counter() - t0
        built = rss_bytes()  # the tables' pages are not touched yet: the load fills them
        t1 = time.perf_counter()
        io0 = read_chars()
        resume_checkpoint(Path(run_dir), model, opt, to_dict(cfg), schema, warn=lambda _: None)
        load_s = time.perf_counter() - t1  # verified while read: no separate pass
        read_bytes = read_chars() - io0
        total_s = time.perf_counter() - t0
    return {"build_s": build_s, "load_s": load_s, "read_bytes": read_bytes, "seconds": total_s,
            "state_bytes": state_bytes(model), "rss_before": before, "rss_built": built, "peak_rss": peak(),
            "rss_after": rss_bytes(), "tables_sum": tables_sum(model)}


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a new interpreter (a clean high-water mark)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def dd_rates(directory: Path, mbytes: int = 3200) -> dict[str, float]:
    """GB/s of ``dd`` writing ``mbytes`` of zeros to ``directory`` in 16 MiB blocks,
    through the page cache (with a final fsync, as a checkpoint does) and with
    ``oflag=direct``."""
    target = directory / "dd.tmp"
    out = {}
    for name, flags in (("dd_gb_s", ["conv=fsync"]), ("dd_direct_gb_s", ["oflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={mbytes // 16}", *flags],
                       check=True, capture_output=True)
        out[name] = mbytes * MIB / (time.perf_counter() - t0) / 1e9
        target.unlink()
    return out


def checkpoint_bench(config: str, overrides: list[str], out: Path, dd_mbytes: int = 3200) -> dict[str, Any]:
    """Save then resume the config's model under ``out``; the figures (and removes
    the checkpoint afterwards). ``dd`` runs before the save and after the resume (a
    shared disk's rate moves): the mean of the two is set beside the save."""
    run_dir = out / "checkpoint-bench"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    try:
        before = dd_rates(run_dir, dd_mbytes)
        save = in_fresh_process(save_phase, config, overrides, str(run_dir))
        load = in_fresh_process(load_phase, config, overrides, str(run_dir))
        after = dd_rates(run_dir, dd_mbytes)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    disk = {k: (before[k] + after[k]) / 2 for k in before}
    disk["dd_rounds"] = [before, after]
    state = save["state_bytes"]
    save["overhead"] = save["peak_rss"] - save["rss_before"]
    save["gb_s"] = save["disk_bytes"] / save["seconds"] / 1e9
    load["overhead"] = load["peak_rss"] - load["rss_after"]
    load["gb_s"] = save["disk_bytes"] / load["load_s"] / 1e9
    return {"state_bytes": state, "allowed_overhead": allowed_overhead(state), "save": save,
            "resume": load, **disk}


def format_checkpoint(r: dict[str, Any]) -> str:
    """The bench's lines for a checkpoint report."""
    gb = 1e9
    s, ld = r["save"], r["resume"]
    head = (f"checkpoint of {r['state_bytes'] / gb:.2f} GB of model state ({s['disk_bytes'] / gb:.2f} GB "
            f"on disk); allowed overhead {r['allowed_overhead'] / gb:.2f} GB")
    save = (f"save:   {s['seconds']:.1f} s, {s['gb_s']:.2f} GB/s; peak RSS {s['peak_rss'] / gb:.2f} GB, "
            f"{s['overhead'] / gb:+.2f} GB over the {s['rss_before'] / gb:.2f} GB before it")
    resume = (f"resume: {ld['seconds']:.1f} s (build {ld['build_s']:.1f} s, load and verify {ld['load_s']:.1f} s, "
              f"{ld['gb_s']:.2f} GB/s, read {ld['read_bytes'] / gb:.2f} GB); peak RSS {ld['peak_rss'] / gb:.2f} GB, "
              f"{ld['overhead'] / gb:+.2f} GB over the {ld['rss_after'] / gb:.2f} GB after it")
    disk = (f"disk:   dd {r['dd_gb_s']:.2f} GB/s (fsynced), {r['dd_direct_gb_s']:.2f} GB/s (oflag=direct), "
            f"mean of before and after (the save ran at {s['gb_s'] / r['dd_gb_s']:.0%} of the first); "
            f"a fresh build's random init took {s['build_s']:.1f} s")
    return f"{head}\n{save}\n{resume}\n{disk}"
