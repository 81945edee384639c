"""What an embedding table is: its size and the features it serves."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Pooling(str, Enum):
    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TableSpec:
    """An embedding table of ``rows`` x ``dim`` serving ``features`` (sparse columns).

    Several features may share one table; each feature gets its own pooled vector.
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: Pooling = Pooling.SUM
    # Storage type of the weights (fbgemm's weights_precision / TorchRec's data_type):
    # fp32, fp16 or bf16. Lookups accumulate and updates compute in fp32 either way.
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: rows and dim must be positive")
        if not self.features:
            raise ValueError(f"table {self.name!r}: serves no feature")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"table {self.name!r}: dtype {self.dtype!r} is not fp32, fp16 or bf16")

    @property
    def bytes(self) -> int:
        return self.rows * self.dim * self.itemsize

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "fp32" else 2
