"""Memory a run holds that it need not: an fp32 CPU table imported numba (and scipy)
for rounding kernels only fp16/bf16 tables call."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

_BUILD = """
import sys, torch
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec
dtype = sys.argv[1]
LocalEmbeddingCollection([TableSpec("A", 64, 8, ("a",), dtype=dtype)],
                         make_sparse_optimizer("rowwise_adagrad"), seed=0, device=torch.device("cpu"))
print("numba" in sys.modules)
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype, imports_numba", [("fp32", False), ("bf16", True)])
def test_only_half_tables_on_the_cpu_import_numba(dtype: str, imports_numba: bool) -> None:
    """An fp32 table compiles no CPU rounding kernel; importing numba for it held about
    50 MiB (numba and scipy) of every fp32 CPU rank for nothing."""
    proc = subprocess.run([sys.executable, "-c", _BUILD, dtype], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=True)
    assert proc.stdout.split()[-1] == str(imports_numba)
