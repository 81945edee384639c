"""Data in object storage (s3:// through pyarrow's S3FileSystem, data/remote.py), against
an S3 server emulated by moto on this machine, not a real S3.

References are the same data on the local disk: the files a spec names (the local rules of
data/files.py on the same tree), the reader's batches (one thread and 2 decode workers), the
vocabulary fit, a short ``dlrm train`` on 1 and 2 ranks (parameters bit-equal), ``dlrm eval``
and ``dlrm predict``. Errors (a missing bucket, key or match, a store that does not answer, access
denied by moto's IAM check) are one line naming the URI.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from data import remote
from data.errors import DataError, UserError
from data.files import expand_paths, open_parquet
from data.preprocess import Options, fit
from data.schema import infer_schema
from dlrm.cli import main
from dlrm.config import load_config
from tests.conftest import TINY, tiny_overrides
from tests.data_helpers import within
from tests.run_state import run_state
from tests.test_preprocess_train import string_dataset
from tests.test_reader_workers import assert_same, batches

BUCKET = "criteo-test"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    return _layout(tmp_path_factory.mktemp("layout"))


@pytest.fixture(scope="module")
def store(tiny_data, layout, tmp_path_factory) -> Iterator[dict[str, object]]:
    """A moto S3 server holding tiny_data (criteo/train/, criteo/eval/), a string data set
    (strings/) and a layout of odd names (layout/, mirrored locally), with the environment
    set as a user would set it (AWS_ENDPOINT_URL and keys)."""
    import logging

    import pyarrow.fs as pafs

    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (test extras)")

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs each request
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in [*KEYS, "AWS_ENDPOINT_URL"]}
    os.environ.update(KEYS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    remote.forget_file_systems()
    s3 = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="testing",
                           secret_key="testing", region="us-east-1", allow_bucket_creation=True)
    s3.create_dir(BUCKET)
    root = tmp_path_factory.mktemp("store")
    local = {"train": tiny_data["train"], "eval": tiny_data["eval"],
             "strings": string_dataset(root / "strings", 3000, 5), "layout": layout}
    for name, path in local.items():
        pafs.copy_files(str(path), f"{BUCKET}/{name}", destination_filesystem=s3)
    yield {"local": local, "port": port, "uri": {n: f"s3://{BUCKET}/{n}/" for n in local}}
    server.stop()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    remote.forget_file_systems()


def _layout(root: Path) -> Path:
    """Names the listing rules care about: numbers compared as numbers, Spark's _SUCCESS and
    _temporary, a .crc, a Hive partition, files not named *.parquet."""
    import pyarrow as pa

    table = pa.table({"x": [1, 2]})
    for name in ["day_2/part-0.parquet", "day_10/part-0.parquet", "day_10/part-1.parquet",
                 "day_2/_SUCCESS", "day_2/.part-0.parquet.crc", "_temporary/0/part-9.parquet",
                 "k=1/part-3.parquet", "k=1/notes.txt", "hive/000000_0", "part-100.parquet", "part-99.parquet"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / name)
    return root


def _rel(files: list[str], prefix: str) -> list[str]:
    assert all(f.startswith(prefix) for f in files), files
    return [f[len(prefix):].lstrip("/") for f in files]


SPECS = ["", "day_10", "*", "*/*.parquet", "**/*.parquet", "day_*", "day_2/part-0.parquet",
         "_temporary/*/*", "k=1/*", "part-*.parquet", "day_10/*,day_10/,day_2//part-0.parquet",
         "**/*", "_*/*/*"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_uri_names_the_files_a_local_path_names(store, spec: str) -> None:
    local = str(store["local"]["layout"])
    want = _rel(expand_paths(_under(local, spec)), local)
    got = _rel(expand_paths(_under(store["uri"]["layout"], spec)), f"s3://{BUCKET}/layout/")
    assert got == want and want


@pytest.mark.parametrize("spec", SPECS)
def test_a_file_uri_names_the_files_a_local_path_names(layout: Path, spec: str) -> None:
    want = _rel(expand_paths(_under(str(layout), spec)), str(layout))
    got = _rel(expand_paths(_under(f"file://{layout}/", spec)), f"file://{layout}/")
    assert got == want and want


def _under(root: str, spec: str) -> str:
    """``spec``'s comma-separated parts below ``root``."""
    return ",".join(root.rstrip("/") + "/" + part if part else root for part in spec.split(","))


@pytest.mark.distributed
@pytest.mark.slow
def test_reader_batches_equal_the_local_files(store) -> None:
    schema = infer_schema(expand_paths(str(store["local"]["train"])))
    local = expand_paths(str(store["local"]["train"]))
    uris = expand_paths(store["uri"]["train"])
    assert [remote.file_name(u) for u in uris] == [Path(f).name for f in local]
    want = batches(local, schema, 0, shuffle_buffer=8192)
    assert_same(batches(uris, schema, 0, shuffle_buffer=8192), want)
    # decode workers are forked from a forkserver that may have started before this module set
    # the environment: the URI itself names the endpoint and the keys (from_uri's own form)
    port = store["port"]
    spelled = f"s3://testing:testing@{BUCKET}/train/?endpoint_override=127.0.0.1:{port}&scheme=http"
    assert_same(batches(expand_paths(spelled), schema, 2, shuffle_buffer=8192), want)


@pytest.mark.distributed
@pytest.mark.slow
def test_vocabulary_fit_equals_the_local_fit(store) -> None:
    local = expand_paths(str(store["local"]["strings"]))
    schema = infer_schema(local, label="click")
    for workers in (0, 2):
        opts = Options(encoding="vocabulary", workers=workers)
        want = fit(local, schema, opts)
        got = fit(expand_paths(store["uri"]["strings"]), schema, opts)
        assert got.vocabularies.keys() == want.vocabularies.keys() and want.vocabularies
        for name, vocab in want.vocabularies.items():
            assert got.vocabularies[name].values.equals(vocab.values), name
            assert (got.vocabularies[name].counts == vocab.counts).all(), name
        assert got.data == want.data  # footer sha256 by file name: the reuse check's record


def _train(out: Path, train: str, eval_: str, steps: int = 12) -> None:
    # data.workers=0: "auto" starts decode workers on a CUDA machine, from a forkserver that an
    # earlier test may have started before this module set AWS_ENDPOINT_URL (workers on a
    # store: test_reader_batches_equal_the_local_files)
    assert main(["train", "--config", str(TINY), "--out", str(out),
                 *tiny_overrides(**{"data.train": train, "data.eval": eval_, "train.max_steps": steps,
                                    "train.eval_every": 12, "data.workers": 0})]) == 0


@pytest.mark.slow
def test_train_eval_predict_equal_the_local_runs(store, tmp_path: Path, capsys) -> None:
    local, uri = store["local"], store["uri"]
    _train(tmp_path / "local", str(local["train"]), str(local["eval"]))
    _train(tmp_path / "s3", uri["train"], uri["eval"] + "part-*.parquet")
    _train(tmp_path / "resumed", uri["train"], "", steps=5)  # a resume checks the store's files
    _train(tmp_path / "resumed", uri["train"], "", steps=12)  # (footers, dlrm/train/same_data.py)
    want = run_state(tmp_path / "local")
    for run in ("s3", "resumed"):
        got = run_state(tmp_path / run)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (run, key)
    for where, data in [("local", str(local["eval"])), ("s3", uri["eval"])]:
        assert main(["eval", "--checkpoint", str(tmp_path / "local"), "--data", data,
                     "--scores", str(tmp_path / f"eval-{where}.parquet"), "--keep", "C1"]) == 0
        assert main(["predict", "--checkpoint", str(tmp_path / "local"), "--data", data,
                     "--out", str(tmp_path / f"predict-{where}.parquet"), "--keep", "I3"]) == 0
    capsys.readouterr()
    for kind in ("eval", "predict"):
        want_t, got_t = (pq.read_table(tmp_path / f"{kind}-{w}.parquet") for w in ("local", "s3"))
        assert got_t.equals(want_t) and want_t.num_rows == 10_000, kind


def test_fit_on_a_uri_equals_the_local_fit(store, tmp_path: Path) -> None:
    for where in ("local", "uri"):
        data = str(store[where]["strings"])
        assert main(["fit", "--config", str(TINY), "--data", data, "--out", str(tmp_path / where),
                     "data.label=click", "data.encoding=vocabulary"]) == 0
    want = sorted(str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*"))
    assert sorted(str(p.relative_to(tmp_path / "uri")) for p in (tmp_path / "uri").rglob("*")) == want
    for name in [n for n in want if (tmp_path / "local" / n).is_file()]:
        assert (tmp_path / "uri" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    # data.preprocessing=DIR reuse checks the files' footers: the s3 copy passes as itself
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"),
                 *tiny_overrides(**{"data.train": store["uri"]["strings"], "data.eval": "",
                                    "data.label": "click", "data.preprocessing": tmp_path / "local",
                                    "train.max_steps": 2, "data.batch_size": 256,
                                    "data.workers": 0})]) == 0


@pytest.mark.parametrize("spec, says", [
    # a bucket no test makes (named at run time: the same test id in every pytest-xdist worker)
    ("s3://no-such-bucket-{pid}/train/", "no Parquet files found for 's3://no-such-bucket"),
    (f"s3://{BUCKET}/no/such/key/", f"no Parquet files found for 's3://{BUCKET}/no/such/key/'"),
    (f"s3://{BUCKET}/eval/day-*.parquet", f"no Parquet files found for 's3://{BUCKET}/eval/day-*.parquet'"),
    (f"s3://{BUCKET}/layout/hive", ("holds 1 other file(s), e.g. 000000_0; name them with a "
                                     f"glob, e.g. s3://{BUCKET}/layout/hive/*")),
])
def test_a_missing_bucket_key_or_match_is_one_line(store, spec: str, says: str) -> None:
    with pytest.raises(DataError) as e:
        expand_paths(spec.format(pid=os.getpid()))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_missing_file_and_an_unreachable_store_are_one_line(store) -> None:
    gone = f"s3://{BUCKET}/train/part-99999.parquet"
    with pytest.raises(DataError, match=f"^file {gone}: does not exist$"):
        open_parquet(gone)
    closed = f"s3://{BUCKET}/train/?endpoint_override=127.0.0.1:{_free_port()}&scheme=http"
    with pytest.raises(DataError) as e:
        within(120, lambda: expand_paths(closed))
    assert str(e.value).startswith(f"{closed}: cannot be listed (") and "\n" not in str(e.value)


def test_denied_access_is_one_line_naming_the_uri(store) -> None:
    from moto.core.authorization import enable_iam_authentication

    spec, file = store["uri"]["eval"], expand_paths(store["uri"]["eval"])[0]
    remote.forget_file_systems()  # a fresh connection, refused: the keys are no IAM user's
    with enable_iam_authentication():
        with pytest.raises(DataError) as listing:
            expand_paths(spec)
        with pytest.raises(DataError) as opening:
            open_parquet(file)
    assert str(listing.value).startswith(f"{spec}: cannot be listed (") and "\n" not in str(listing.value)
    assert str(opening.value).startswith(f"file {file}: cannot be read (") and "\n" not in str(opening.value)


@pytest.mark.parametrize("argv, flag", [
    (["train", "--out", "s3://b/run"], "--out"),
    (["fit", "--data", "x/", "--out", "s3://b/prep"], "--out"),
    (["eval", "--checkpoint", "s3://b/run", "--data", "x/"], "--checkpoint"),
    (["eval", "--checkpoint", "run", "--data", "x/", "--scores", "s3://b/s.parquet"], "--scores"),
    (["predict", "--checkpoint", "run", "--data", "x/", "--out", "gs://b/p.parquet"], "--out"),
])
def test_a_uri_for_a_run_directory_or_an_output_is_one_line(argv: list[str], flag: str, capsys,
                                                            tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # were it taken as a path, it would be made here
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "only data may be a URI" in err and f" {flag} " in err and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_data_preprocessing_as_a_uri_is_one_line(tiny_data, tmp_path: Path) -> None:
    from dlrm.config import load_config
    from dlrm.train.inputs import resolve_data

    cfg = load_config(TINY, [f"data.train={tiny_data['train']}", "data.preprocessing=s3://b/prep"])
    with pytest.raises(UserError, match="^data.preprocessing s3://b/prep: run directories .* only data may be a URI$"):
        resolve_data(cfg)


def test_a_row_group_is_read_in_one_ranged_get(store) -> None:
    """pre_buffer: a row group's column chunks coalesced into one request (without it, one
    GET per column: 40 here, ten times the requests of a whole run)."""
    import logging

    file = expand_paths(store["uri"]["train"])[0]
    gets: list[str] = []

    class Requests(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if f"GET /{BUCKET}/train/part-00000.parquet " in record.getMessage():
                gets.append(record.getMessage())

    log, handler = logging.getLogger("werkzeug"), Requests()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        pf = open_parquet(file)
        opened = len(gets)
        table = pf.read_row_group(1)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert table.num_columns == 40 and opened <= 1 and len(gets) - opened == 1, gets


def test_a_query_is_no_hive_partition() -> None:
    from data.files import hive_partitions

    files = ["s3://b/date=1/part-0.parquet?endpoint_override=http://h:9000&scheme=http",
             "file:///data/x/part-1.parquet"]
    assert hive_partitions(files) == {"date": "date=1"}


def test_an_object_replaced_after_its_footer_was_read_is_caught_by_the_reader(store) -> None:
    """footer() keeps a URI's footer for the process; the reader opens the object afresh,
    so a smaller object put in its place is one line, not rows read with old offsets."""
    from data.files import footer
    from data.reader import ParquetReader

    src = expand_paths(str(store["local"]["eval"]))[0]
    fs, key = remote.resolve(f"s3://{BUCKET}/replaced/part-0.parquet")
    table = pq.read_table(src)
    pq.write_table(table, key, filesystem=fs, row_group_size=4000)
    files = expand_paths(f"s3://{BUCKET}/replaced/")
    schema = infer_schema(files)
    assert footer(files[0]).metadata.num_rows == table.num_rows
    pq.write_table(table.slice(0, 3000), key, filesystem=fs, row_group_size=1000)
    assert footer(files[0]).metadata.num_rows == table.num_rows  # kept: the run's view
    reader = ParquetReader(files, schema, 512, shuffle=False)
    with pytest.raises(DataError, match=f"^file {files[0]}, row group 0: holds 1000 rows, 4000 when"):
        list(reader.epoch(0))


def _train_rank(rank: int, world_size: int, train_spec: str, out: Path) -> str:
    from dlrm.train.trainer import train

    cfg = load_config(TINY, tiny_overrides(**{"data.train": train_spec, "data.eval": "",
                                             "data.label": "click", "data.batch_size": 256,
                                             "train.max_steps": 6, "data.workers": 0}))
    train(cfg, out, echo=lambda s: None)
    return (out / "preprocessing.json").read_text()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_on_a_uri_fit_and_train_as_on_the_local_files(store, tmp_path: Path) -> None:
    """Each rank lists the store itself and counts its share of the fit (spawned ranks take
    the environment this module set)."""
    from tests.multiprocess import run_ranks

    local = run_ranks(2, _train_rank, str(store["local"]["strings"]), tmp_path / "local")
    remote_ = run_ranks(2, _train_rank, store["uri"]["strings"], tmp_path / "s3")
    assert remote_ == local and local[0] == local[1]
    want, got = run_state(tmp_path / "local"), run_state(tmp_path / "s3")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
