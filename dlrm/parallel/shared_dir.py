"""Is a directory the same one on every rank? (several machines need a shared file system)

Every rank of a run writes into the run directory (its own table shards of each
checkpoint) and reads from it (a resume, the preprocessing, the hot profile). On one
machine that is one directory. With several, ``--out runs/x`` names a directory on
each machine's own disk unless the path is on a shared file system, and nothing
failed: rank 0's checkpoint lacked the other machines' shards (they went to their
own disks), so the run trained to the end and its checkpoints could not be loaded
(``rank-1.0.bin is missing``), by a resume or by ``dlrm eval``.

::

    rank 0:  write DIR/.dlrm-shared-<token>  ─► broadcast (name, token)
    every rank:  read it (retrying briefly: NFS) ─► all-gather (seen?, host)
    rank 0:  delete it ─► barrier ─► every rank: raise one line if any rank did not see it

A run directory that does not exist yet is probed in its nearest existing parent,
where rank 0 will create it (nothing is left there: a bad-data run still leaves no
run directory). :func:`check_same_file` is the read-only form for ``dlrm eval``: the
checkpoint's meta.json has the same bytes on every rank.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from pathlib import Path

from data.atomic import existing_part
from data.errors import UserError
from dlrm.parallel.distributed import DistInfo, all_gather_objects, barrier, broadcast_object

PROBE_PREFIX = ".dlrm-shared-"
PATIENCE_S = 5.0  # an NFS client may take its attribute-cache time to see a new file


class NotShared(UserError):
    """A path that is not the same directory or file on every rank."""


def check_shared_dir(directory: Path, info: DistInfo, what: str = "run directory") -> None:
    """Raise :class:`NotShared` on every rank if some rank cannot read what rank 0
    writes into ``directory`` (a collective; nothing to do for one process)."""
    if info.world_size == 1:
        return
    probe = None
    if info.is_main:
        probe = _write_probe(Path(directory))
    probe = broadcast_object(probe, info)
    if probe is None:  # rank 0 cannot write there: creating the run directory says why
        return
    path, token = probe
    seen = all_gather_objects((_sees(Path(path), token), socket.gethostname()), info)
    if info.is_main:  # every rank has looked (the gather): gone before any returns
        Path(path).unlink(missing_ok=True)
    barrier(info)
    blind = [(rank, host) for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise NotShared(f"the {what} {directory} is not shared by the ranks: "
                        f"{_ranks(blind)} cannot see a file rank 0 ({seen[0][1]}) wrote into it; "
                        "with several machines put it on a file system every machine mounts "
                        "at the same path (NFS, Lustre, ...)")


def check_same_file(path: Path, info: DistInfo, what: str) -> None:
    """Raise :class:`NotShared` on every rank if ``path`` is missing on some rank or
    its bytes differ from rank 0's (a collective; read-only). ``dlrm eval`` is its one
    caller: ranks naming different paths found different newest checkpoints, and are
    told so rather than sent to a shared file system."""
    if info.world_size == 1:
        return
    digest = _digest(Path(path))
    seen = all_gather_objects((digest, socket.gethostname(), str(path)), info)
    picked = {rank: named for rank, (_, _, named) in enumerate(seen) if named != seen[0][2]}
    if picked:  # each rank found the newest checkpoint itself, and a save came between
        rank, named = next(iter(picked.items()))
        raise NotShared(f"the ranks found different newest checkpoints ({seen[0][2]} on rank 0, "
                        f"{named} on rank {rank}): the run saved one meanwhile; evaluate again, "
                        "or name a checkpoint directory (RUN/checkpoints/step-N)")
    seen = [(d, host) for d, host, _ in seen]
    missing = [(rank, host) for rank, (d, host) in enumerate(seen) if d is None]
    other = [(rank, host) for rank, (d, host) in enumerate(seen) if d is not None and d != seen[0][0]]
    if missing or other:
        said = []
        if other:
            verb = "reads" if len(other) == 1 else "read"
            said.append(f"{_ranks(other)} {verb} other bytes than rank 0 ({seen[0][1]})")
        if missing:
            said.append(f"{_ranks(missing)} cannot read it")
        raise NotShared(f"the {what} {path} is not the same on every rank: {', '.join(said)}; with "
                        "several machines put the run on a file system every machine mounts at the "
                        "same path")


def _write_probe(directory: Path) -> tuple[str, str] | None:
    token = secrets.token_hex(16)
    path = existing_part(directory) / f"{PROBE_PREFIX}{token}"
    try:
        with open(path, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return None
    return str(path), token


def _sees(path: Path, token: str) -> bool:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _ranks(found: list[tuple[int, str]]) -> str:
    shown = ", ".join(f"{rank} ({host})" for rank, host in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    return f"rank{'s' if len(found) > 1 else ''} {shown}{more}"
