"""What a Hotline run says. At its start, the line that says what the profile chose, at a budget that holds no row, some
rows, and more than every row the profile saw. Before: ``hotline: 0 hot rows within 50
from 4 profiled batches`` (a run with no hot row, said as a choice) and ``13,136 hot
rows within 256MB`` for 26,000 rows that all fit (why not all was not said). At its end,
the hit rate beside samples/s (it was in the summary's JSON only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm.cli import main
from dlrm.train.hotline import PROFILE_FILE
from embeddings.hotline.profile import HotProfile
from tests.conftest import TINY, tiny_overrides

ROW = 16 * 4 + 4  # configs/tiny.yaml: dim 16 fp32 + row-wise Adagrad's one fp32 a row


def started(tiny_data, out: Path, budget: str, capsys) -> tuple[str, HotProfile]:
    argv = ["train", "--config", str(TINY), "--out", str(out),
            *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""}),
            "embeddings.placement=hotline", "train.max_steps=2", f"hotline.budget={budget}"]
    assert main(argv) == 0
    return capsys.readouterr().out, HotProfile.load(out / PROFILE_FILE)


def test_a_budget_that_holds_no_row_is_a_warning(tiny_data, tmp_path: Path, capsys) -> None:
    out, profile = started(tiny_data, tmp_path / "run", str(ROW - 1), capsys)
    assert sum(ids.numel() for ids in profile.hot.values()) == 0
    assert (f"warning: hotline.budget={ROW - 1} holds no hot row (the smallest takes {ROW} B: weights and "
            f"optimizer state): every lookup goes to the host") in out, out


@pytest.mark.parametrize("budget, rows", [("1000", 1000 // ROW), ("256MB", None)])
def test_the_line_says_rows_bytes_and_what_they_hit(tiny_data, tmp_path: Path, capsys, budget: str,
                                                    rows: int | None) -> None:
    out, profile = started(tiny_data, tmp_path / "run", budget, capsys)
    hot = sum(int(ids.numel()) for ids in profile.hot.values())
    line = next(x for x in out.splitlines() if x.startswith("hotline: "))
    assert line.startswith(f"hotline: {hot:,} hot rows (") and f"of hotline.budget={budget}) hit " in line, line
    if rows is not None:  # the budget binds: as many rows as fit
        assert hot == rows and "did not see" not in line, line
        return
    total = 26 * 1000  # configs/tiny.yaml: 26 tables of 1,000 rows
    assert " hit 100.0% of the " in line, line  # every profiled lookup is hot
    # the room past the rows the profile saw takes the others (once: 13,136 of the
    # 26,000 hot, the rest on the host for a budget of 256MB)
    assert hot == total and line.endswith("; the budget holds every row of every table"), line


def test_the_last_line_gives_the_hit_rate_of_the_summary(tiny_data, tmp_path: Path, capsys) -> None:
    out, _ = started(tiny_data, tmp_path / "run", "1000", capsys)
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    last = out.strip().splitlines()[-1]
    h = summary["hotline"]
    assert 0.0 < h["hot_hit_rate"] < 1.0
    assert (f"; hotline hit rate {h['hot_hit_rate']:.1%}, cold gather {h['gather_hidden']:.0%} hidden"
            in last), last
    capsys.readouterr()
    assert main(["train", "--config", str(TINY), "--out", str(tmp_path / "run"),  # nothing trained: no rate
                 *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""}),
                 "embeddings.placement=hotline", "train.max_steps=2", "hotline.budget=1000"]) == 0
    assert "hit rate" not in capsys.readouterr().out.strip().splitlines()[-1]
    again = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert again["trained_steps"] == 0 and "hotline" not in again  # it said a 0.0 hit rate


def test_the_line_counts_the_unseen_rows_a_budget_took_and_left() -> None:
    """Every seen row hot and room for some unseen ones: how many it took (the smallest
    tables' first) and how many stay on the host; no room for one: they all stay."""
    import torch

    from dlrm.config import load_config
    from dlrm.train.hotline import profile_lines
    from embeddings.hotline.profile import row_bytes
    from embeddings.optim import make_sparse_optimizer
    from embeddings.table import TableSpec

    tables = [TableSpec("a", rows=10, dim=4, features=("f0",)), TableSpec("b", rows=6, dim=4, features=("f1",))]
    opt = make_sparse_optimizer("sgd")
    per_row = row_bytes(tables[0], opt)
    counts = {"a": torch.zeros(10, dtype=torch.int64), "b": torch.zeros(6, dtype=torch.int64)}
    counts["a"][[1, 2]] = torch.tensor([3, 1])
    for budget, says in ((2 * per_row + 1, "the 14 it did not see stay on the host"),
                         (5 * per_row, ("every row the profile saw and 3 it did not see (the smallest tables' "
                                        "first), 11 stay on the host")),
                         (16 * per_row, "every row of every table")):
        cfg = load_config(TINY, ["embeddings.placement=hotline", f"hotline.budget={budget}",
                                 "hotline.refresh_every=0"])
        profile = HotProfile.build(counts, tables, opt, budget)
        line = profile_lines(cfg, profile, counts, tables, opt)[0]
        assert line.endswith(says) or says + " (hotline.refresh_every" in line, (budget, line)
