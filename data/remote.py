"""Data files named by URI (s3://, gs://, hdfs://, file://), through pyarrow's own file systems.

    is_uri("s3://bucket/criteo/train/")          True; "train/" and "/data/x.parquet": False
    expand_uri("s3://bucket/criteo/train/")     every *.parquet below the prefix, in name order
    expand_uri("s3://bucket/eval/part-*.parquet")  the keys the glob matches
    resolve("s3://bucket/eval/part-1.parquet")  (its FileSystem, "bucket/eval/part-1.parquet")

A URI is listed (``get_file_info(FileSelector(prefix, recursive=True))``) and the listing is
held to the rules :mod:`data.files` applies to local paths: a prefix ("directory") gives every
``*.parquet`` below it; a glob matches part by part (``*`` within one name, ``**`` across any
number of them), a matched prefix giving its ``*.parquet`` keys; names starting with '.' or '_'
below the fixed prefix are skipped unless the pattern asks for them; natural name order. In a
URI, ``?`` starts the query (``s3://b/k?endpoint_override=host:9000&scheme=http``, as
``FileSystem.from_uri`` reads it), so ``*`` and ``[...]`` are the glob characters; the query is
kept on every file the URI gives, so each process opens it on the same store.

Credentials, region and endpoint come from the environment as pyarrow reads them
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL for an
S3-compatible store). One FileSystem per scheme, authority and query is kept per process
(decode and fit workers build their own from the URI strings they are given).
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from data.errors import DataError, one_line
from data.names import PRIVATE as _PRIVATE
from data.names import glob_takes, natural_key

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = re.compile(r"[*\[]")


def is_uri(path: object) -> bool:
    """Whether ``path`` is a URI (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URI.match(path) is not None


class _Store:
    """One file system and the mapping between its paths and URIs.

    ``FileSystem.from_uri`` gives S3's paths as ``bucket/key`` and local or HDFS paths as
    ``/key``: ``root`` is that path of the URI ``scheme://authority/``, so a URI's path is
    ``root + key`` and a listed path's URI is ``scheme://authority/ + key + ?query``."""

    def __init__(self, scheme: str, authority: str, query: str) -> None:
        import pyarrow.fs as pafs

        self.prefix = f"{scheme}://{authority}/"
        self.query = f"?{query}" if query else ""
        self.fs, probe = pafs.FileSystem.from_uri(f"{self.prefix}x{self.query}")
        self.root = probe[:-1]

    def path(self, key: str) -> str:
        return self.root + key.lstrip("/")

    def uri(self, path: str) -> str:
        return self.prefix + path[len(self.root):] + self.query


@cache
def _store(scheme: str, authority: str, query: str) -> _Store:
    return _Store(scheme, authority, query)


def forget_file_systems() -> None:
    """Drop this process's file systems, so the next URI reads the environment again
    (credentials, endpoint): a test's store on another port."""
    _store.cache_clear()


def _split(uri: str) -> tuple[_Store, str]:
    """``uri``'s store and its key (the path below the authority, no leading '/')."""
    parts = urlsplit(uri)
    try:
        store = _store(parts.scheme.lower(), parts.netloc, parts.query)
    except (OSError, ValueError) as e:  # unknown scheme, bad query, no such bucket's region
        raise DataError(f"{uri}: cannot open its file system ({one_line(e)})") from None
    return store, parts.path.lstrip("/")


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The FileSystem holding ``uri`` and the path to give it."""
    store, key = _split(uri)
    return store.fs, store.path(key)


def file_name(path: str) -> str:
    """The last part of a URI's path (no query); a local path's own name."""
    name = urlsplit(path).path if is_uri(path) else path
    return name.rstrip("/").rsplit("/", 1)[-1]


def normalized(uri: str) -> str:
    """``uri`` as the store names it (no doubled '/', scheme in lower case): the same object
    reached by two spellings is one file."""
    store, key = _split(uri)
    return store.uri(store.path("/".join(p for p in key.split("/") if p)))


def expand_uri(item: str) -> list[str]:
    """The files one URI names (module docstring), in natural name order; [] if none."""
    store, key = _split(item)
    parts = [p for p in key.split("/") if p]
    first = next((i for i, p in enumerate(parts) if _GLOB_CHARS.search(p)), None)
    fixed = parts if first is None else parts[:first]
    base = store.path("/".join(fixed)).rstrip("/") or "/"
    listed = _list(store, base, item)
    if first is None:
        if base in listed:
            return [store.uri(base)]  # an object named whole
        below = [p for p in listed if _below(p, base) and _usable(_rel(p, base))]
        return [store.uri(p) for p in sorted(below, key=natural_key)]
    pattern = parts[first:]
    hits: list[tuple[Any, Any, str]] = []
    for path in listed:
        rel = _rel(path, base)
        for n in range(1, len(rel) + 1):  # the shortest prefix matched: a directory glob.glob matches
            if glob_takes(rel[:n], pattern) and (n == len(rel) or _usable(rel[n:])):
                hits.append((natural_key("/".join(rel[:n])), natural_key(path), path))
                break
    return [store.uri(p) for _, _, p in sorted(hits)]


def other_files(item: str) -> list[str]:
    """Keys below a URI prefix that are not ``*.parquet`` (for the hint of an empty match)."""
    store, key = _split(item)
    if _GLOB_CHARS.search(key):
        return []
    base = store.path("/".join(p for p in key.split("/") if p)).rstrip("/") or "/"
    return sorted("/".join(_rel(p, base)) for p in _list(store, base, item)
                  if _below(p, base) and not any(r.startswith(_PRIVATE) for r in _rel(p, base)))


def _list(store: _Store, base: str, item: str) -> set[str]:
    """Paths of the files at or below ``base``; a DataError naming ``item`` if the store
    cannot be listed (unreachable, access denied, no such bucket)."""
    import pyarrow.fs as pafs

    try:
        info = store.fs.get_file_info(base)
        if info.type == pafs.FileType.File:
            return {base}
        if info.type == pafs.FileType.NotFound:
            return set()
        listing = store.fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise DataError(f"{item}: cannot be listed ({one_line(e)})") from None
    return {i.path for i in listing if i.type == pafs.FileType.File}


def _below(path: str, base: str) -> bool:
    return path.startswith(base.rstrip("/") + "/") if base else True


def _rel(path: str, base: str) -> list[str]:
    return [p for p in path[len(base):].split("/") if p]


def _usable(rel: list[str]) -> bool:
    """A key found below a prefix the spec named: a ``*.parquet``, no private part."""
    return rel[-1].endswith(".parquet") and not any(r.startswith(_PRIVATE) for r in rel)
