"""A multi-process test base: run a function on W ranks of a real process group.

    results = run_ranks(3, my_fn, arg)      # my_fn(rank, world_size, arg) on 3 ranks

Each rank is a fresh process joined into a gloo (or nccl) group on a free localhost
port, with deterministic algorithms; every rank's exit code is checked and its return
value (picklable) comes back in rank order.

Ranks are forked from a forkserver that has imported torch and the reader already
(the decode workers' own, data/decode_workers.py: one process has one), not spawned:
a spawned rank spent ~2.5 s of a core importing torch, and the suite starts a few
hundred. A rank gets the caller's environment as it is at the call (the forkserver's
is from when it started) and SIGTERM's default action back (the forkserver ignores it
for the decode workers). Module attributes the caller patched are not seen, as under
spawn.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, out_dir: str, fn: Callable, args: tuple,
           env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment, not the forkserver's
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        Path(out_dir, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        # objects a caught exception's traceback kept in a cycle (a model and its process
        # groups) are freed now, not by the collector at exit after the groups are gone:
        # gloo aborted there ("terminate called without an active exception") now and then
        gc.collect()
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", timeout: float = 300) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; their results, rank order."""
    from data.decode_workers import FORKSERVER_PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, port, backend, out_dir, fn, args, env))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(out_dir, f"{r}.err") for r in range(world_size)]
        messages = [e.read_text() for e in errors if e.exists()]
        codes = [p.exitcode for p in procs]
        if messages or any(c != 0 for c in codes):
            raise AssertionError(f"ranks exited with {codes}:\n" + "\n".join(messages))
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
