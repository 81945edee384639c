"""The sparse features of a batch, jagged: our own light stand-in for TorchRec's
``KeyedJaggedTensor`` (KJT), so the native engine needs neither torchrec nor fbgemm.

Every sparse feature of every sample is a bag of ids (empty, one, or many). The bags
are laid out feature-major, exactly as in a KJT:

    keys ["a", "b"], stride B = 3 samples

                  sample 0    sample 1    sample 2
        a         [x0 x1]     []          [x2]
        b         [y0]        [y1 y2]     [y3]

    values   [x0 x1 x2 | y0 y1 y2 y3]       [N] int64: every bag of a, then of b
    lengths  [2  0  1  | 1  2  1 ]          [F * B]: bag f * B + b = (feature f, sample b)
    offsets  [0  2  2  3  4  6  7]          [F * B + 1]: bag i = values[offsets[i]:offsets[i + 1]]

The accessors carry KJT's names (``keys()``, ``values()``, ``lengths()``,
``offsets()``, ``stride()``, ``length_per_key()``, ``batch[key]``, ``to_dict()``,
``to(device)``, ``pin_memory()``, ``record_stream()``), so code that reads a batch
through them takes either type. The collections (``embeddings/``) read only
``keys()``, ``values()``, ``lengths()`` and ``stride()`` (the ``KeyedJagged``
protocol): TorchRec users may pass a KJT in as it is.

    JaggedFeatures ──to_kjt()──► KeyedJaggedTensor     (imports torchrec then, only then)
    KeyedJaggedTensor ──JaggedFeatures.from_kjt()──► JaggedFeatures
Both share the tensors (no copy). Per-id weights and a variable batch per feature (KJT
features our engine does not use) are not carried.

Importing this module imports torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class KeyedJagged(Protocol):
    """What a collection reads of a sparse batch: ``JaggedFeatures`` or a KJT."""

    def keys(self) -> list[str]: ...

    def values(self) -> torch.Tensor: ...

    def lengths(self) -> torch.Tensor: ...

    def stride(self) -> int: ...


class Jagged:
    """One feature's bags over the batch: values [n], lengths [B] (KJT's ``JaggedTensor``)."""

    __slots__ = ("_lengths", "_values")

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._values, self._lengths = values, lengths

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """[B + 1]: bag b = values[offsets[b]:offsets[b + 1]]."""
        return _offsets(self._lengths)

    def to_dense(self) -> list[torch.Tensor]:
        """One tensor of ids per sample."""
        return list(self._values.split(self._lengths.tolist()))


class JaggedFeatures:
    """Sparse features of B samples, feature-major (see the module docstring).

    ``stride`` (B) may be left out when there are features: ``lengths.numel() / F``.
    ``offsets`` [F*B + 1], if the caller has it, saves computing it.
    """

    __slots__ = ("_keys", "_lengths", "_offsets", "_stride", "_values")

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        stride: int | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if stride is None:
            stride = int(lengths.numel()) // len(keys) if keys else 0
        if lengths.numel() != len(keys) * stride:
            raise ValueError(f"lengths has {lengths.numel()} bags, not {len(keys)} features "
                             f"x {stride} samples")
        self._keys = list(keys)
        self._values, self._lengths, self._stride = values, lengths, int(stride)
        self._offsets = offsets

    # ------------------------------------------------------------------ accessors
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        """[N] ids, feature-major."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """[F * B] bag sizes."""
        return self._lengths

    def stride(self) -> int:
        """B, the samples."""
        return self._stride

    def offsets(self) -> torch.Tensor:
        """[F * B + 1] where each bag starts in ``values()``, then N (computed once)."""
        if self._offsets is None:
            self._offsets = _offsets(self._lengths)
        return self._offsets

    def length_per_key(self) -> list[int]:
        """Ids per feature (one host sync)."""
        return self._lengths.view(len(self._keys), self._stride).sum(dim=1).tolist()

    def to_dict(self) -> dict[str, Jagged]:
        """Feature → its bags (views of ``values()`` and ``lengths()``)."""
        values = self._values.split(self.length_per_key())
        lengths = self._lengths.view(len(self._keys), self._stride).unbind(0)
        return {k: Jagged(v, n) for k, v, n in zip(self._keys, values, lengths)}

    def __getitem__(self, key: str) -> Jagged:
        return self.to_dict()[key]

    def __repr__(self) -> str:
        return (f"JaggedFeatures(keys={self._keys}, stride={self._stride}, "
                f"values={self._values}, lengths={self._lengths})")

    # ------------------------------------------------------------------ samples
    def select(self, index: torch.Tensor) -> JaggedFeatures:
        """The samples at ``index`` (int64 [k]), in that order, every feature:

            [a: s0 s1 s2 | b: s0 s1 s2], index [2, 0]  →  [a: s2 s0 | b: s2 s0]
        """
        batch, lengths = self._stride, self._lengths
        features = torch.arange(len(self._keys), device=lengths.device)
        bags = (features.unsqueeze(1) * batch + index.unsqueeze(0)).flatten()
        new_lengths = lengths.index_select(0, bags)
        starts = torch.cumsum(lengths, 0) - lengths
        total = int(new_lengths.sum())
        new_starts = torch.cumsum(new_lengths, 0) - new_lengths
        shift = torch.repeat_interleave(starts[bags] - new_starts, new_lengths, output_size=total)
        values = self._values.index_select(0, torch.arange(total, device=shift.device) + shift)
        return JaggedFeatures(self._keys, values, new_lengths, int(index.numel()))

    @staticmethod
    def cat(parts: list[JaggedFeatures]) -> JaggedFeatures:
        """The samples of ``parts`` one after another (same keys), feature-major still:

            [a: p0 | b: p0] + [a: q0 q1 | b: q0 q1]  →  [a: p0 q0 q1 | b: p0 q0 q1]
        """
        keys = parts[0].keys()
        per_part = []
        for p in parts:
            lens = p.lengths().view(len(keys), p.stride())
            per_part.append((lens, p.values().split(lens.sum(dim=1).tolist())))
        values, lengths = [], []
        for f in range(len(keys)):
            for lens, vals in per_part:
                lengths.append(lens[f])
                values.append(vals[f])
        empty = torch.zeros(0, dtype=torch.int64)
        return JaggedFeatures(keys, torch.cat(values) if values else empty,
                              torch.cat(lengths) if lengths else empty,
                              sum(p.stride() for p in parts))

    # ------------------------------------------------------------------ devices
    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedFeatures:
        offsets = self._offsets
        return JaggedFeatures(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            self._stride,
            None if offsets is None else offsets.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> JaggedFeatures:
        """The tensors copied into one page-locked block (data/pinned.py: numpy's copies,
        not torch's intra-op threads)."""
        from data.pinned import pinned_copies

        offsets = self._offsets
        values, lengths, *cached = pinned_copies([self._values, self._lengths]
                                                 + ([] if offsets is None else [offsets]))
        return JaggedFeatures(self._keys, values, lengths, self._stride, cached[0] if cached else None)

    def tensors(self) -> list[torch.Tensor]:
        """Values, lengths, and the offsets where made already (``offsets()`` makes
        them): the tensors it holds."""
        return [t for t in (self._values, self._lengths, self._offsets) if t is not None]

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Keep the tensors' memory alive until ``stream``'s queued work is done (once
        per storage: data/pinned.py)."""
        from data.pinned import record_once

        record_once(self.tensors(), stream)

    # ------------------------------------------------------------------ TorchRec
    def to_kjt(self) -> KeyedJaggedTensor:
        """The same tensors as a ``KeyedJaggedTensor`` (imports torchrec)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=self._keys, values=self._values, lengths=self._lengths,
                                 offsets=self._offsets, stride=self._stride)

    @staticmethod
    def from_kjt(kjt: KeyedJagged) -> JaggedFeatures:
        """A KJT's (or any ``KeyedJagged``'s) tensors, shared."""
        return JaggedFeatures(kjt.keys(), kjt.values(), kjt.lengths(), kjt.stride())


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Inclusive offsets [S + 1] of bags ``lengths`` [S]."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0).to(lengths.dtype)])
