"""A mini-batch classified once, on the device, and cut into micro-batches of static sizes.

    lookups (feature-major, classified: is_hot, slot)   N ids, F*B bags
        │ one pass, every output of a size known before it runs (no boolean-mask
        │ indexing, no nonzero, no unique: on CUDA none of it waits for the device)
        ▼
    group [B]      0: popular sample (every lookup hot), 1: the others
                   (``by_popularity=False``: every sample in group 0)
    perm  [N]      lookups stably sorted by segment = 2*group + cold:
                   [ group 0 hot | group 0 cold | group 1 hot | group 1 cold ]
                   each segment feature-major, samples and ids in their batch order
    unique_cold [N]  the cold stacked ids, unique ascending, first U valid
    cold_local  [N]  a cold lookup's place in unique_cold
    header [7]     group-0 samples, the four segments' sizes, U, popular samples

The header is the only thing the host must read before it can cut (the micro-batches'
shapes depend on it): 56 bytes, copied on the side stream that classified. Then every
micro-batch is static slices and ``index_select``s of these tensors
(``micro_lookups``), and only the U cold ids go to the host for its gather.

Tables of several dtypes (hotline/mixed.py: a collection per dtype): ``split_jointly``
splits each group's lookups with one popular mask, the AND of the groups' (a sample
is popular only if every lookup of it, in every group, is hot); the groups' headers
are one tensor [7 * groups], read once (``JointSplit.read_sizes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from embeddings.hotline.lookups import Lookups
from embeddings.jagged import bag_offsets

HEADER = ("group0", "hot0", "cold0", "hot1", "cold1", "unique_cold", "popular")


@dataclass
class DeviceSplit:
    """The classified mini-batch, on the device; see the module docstring."""

    lookups: Lookups
    group: torch.Tensor  # [B] int64
    sample_order: torch.Tensor  # [B] group-0 samples first, each group in batch order
    perm: torch.Tensor  # [N]
    hot_lengths: torch.Tensor  # [F*B]
    cold_lengths: torch.Tensor  # [F*B]
    scale: torch.Tensor | None  # [N] mean pooling: 1 / the whole bag's length
    unique_cold: torch.Tensor  # [N], first U valid
    cold_local: torch.Tensor  # [N], meaningful where cold
    header: torch.Tensor  # [7] int64, see HEADER
    # What the micro-batches slice, gathered once here rather than once per micro-batch:
    slot_local: torch.Tensor  # [2, N] slot and cold_local, in ``perm`` order
    values_sorted: torch.Tensor  # [N] table-local ids, in ``perm`` order
    scale_sorted: torch.Tensor | None  # [N] ``scale`` in ``perm`` order
    bag_lengths: torch.Tensor  # [3, F, B] whole, hot and cold lookups of each bag
    _hot_in_order: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def read_sizes(self, header: torch.Tensor) -> Sizes:
        """``header`` (the host's copy of ``self.header``) read."""
        return Sizes.read(header)

    def reset(self) -> None:
        """Forget what was derived from the tensors lazily (a graph replay rewrote them:
        dlrm/train/split_graphs.py)."""
        self._hot_in_order = None

    def hot_in_batch_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hot lookups' slots in the mini-batch's own order, feature-major and sample
        by sample [N], the first hot0 + hot1 valid; offsets [F*B + 1] of the bags' hot
        lookups): both micro-batches' hot lookups as one batch, what the Triton update
        reads (hot_tier.py). Made once, by the first to ask: a stable sort, no data size."""
        if self._hot_in_order is None:
            # as uint8: CUDA's sort took no bool before torch 2.6 (pytorch#139409)
            hot = self.lookups.is_hot.to(torch.uint8)
            order = torch.sort(hot, stable=True, descending=True).indices
            self._hot_in_order = (self.lookups.slot.index_select(0, order), bag_offsets(self.hot_lengths))
        return self._hot_in_order


@dataclass
class Sizes:
    """The header, read by the host."""

    group0: int
    hot0: int
    cold0: int
    hot1: int
    cold1: int
    unique_cold: int
    popular: int

    @classmethod
    def read(cls, header: torch.Tensor) -> Sizes:
        """The host reads ``header`` (host memory: on CUDA the pinned copy, after its
        event). The one read of a step's device results the trainer makes: the
        micro-batches' shapes depend on it."""
        return cls(*header.tolist())


@dataclass
class MicroLookups:
    """One micro-batch's lookups, hot ones and cold ones apart, each bag after bag.

    hot_slots [Nh] hot-tier slots, bags ``hot_lengths`` [F*b]; cold_local [Nc] rows of
    the mini-batch's unique cold ids (``cold_ids`` [U], on the device), cold_values
    [Nc] table-local ids, bags ``cold_lengths``; lengths [F*b] whole bags; scales
    (mean pooling) 1 / whole bag length per lookup. ``ready``: CUDA, the event after
    which the split stream's tensors may be read. ``cold_host_ids``: ``cold_ids``
    already copied to the host (the trainer's split made a step ahead, ``unique_cold_ids``),
    complete after ``cold_host_ready`` (CUDA); None: the gather copies them itself.
    """

    hot_slots: torch.Tensor
    hot_lengths: torch.Tensor
    hot_scale: torch.Tensor | None
    cold_local: torch.Tensor
    cold_values: torch.Tensor
    cold_lengths: torch.Tensor
    cold_scale: torch.Tensor | None
    lengths: torch.Tensor
    batch: int
    num_features: int
    cold_ids: torch.Tensor
    popular: int  # samples of this micro-batch whose every lookup is hot
    ready: torch.cuda.Event | None = None
    cold_host_ids: torch.Tensor | None = None
    cold_host_ready: torch.cuda.Event | None = None
    # (the split it was cut from, its group): the Triton update joins a split's two
    # micro-batches back into the split's order (``DeviceSplit.hot_in_batch_order``)
    source: tuple[DeviceSplit, int] | None = None
    whole: bool = False  # every sample of the mini-batch, in its own order (one pass)

    @property
    def lookups(self) -> int:
        return self.hot_slots.numel() + self.cold_local.numel()


def _cold_lengths(lookups: Lookups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each lookup's bag [N], whether cold [N] int64, each bag's cold lookups [F*B])."""
    lengths, n = lookups.lengths, lookups.ids.numel()
    bag = lookups.bag
    if bag is None:
        bag = torch.repeat_interleave(lengths, output_size=n)
    cold = (~lookups.is_hot).to(torch.int64)
    return bag, cold, torch.zeros_like(lengths).index_add_(0, bag, cold.to(lengths.dtype))


def _popular(cold_lengths: torch.Tensor, lookups: Lookups) -> torch.Tensor:
    """[B] bool: samples none of whose lookups is cold."""
    return cold_lengths.view(lookups.num_features, lookups.batch).sum(dim=0) == 0


def split_on_device(lookups: Lookups, mean: bool, by_popularity: bool = True,
                    popular: torch.Tensor | None = None,
                    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> DeviceSplit:
    """Classify ``lookups`` (already located in the hot tier) into groups and segments,
    and compact the unique cold ids; every size static (see the module docstring).
    ``popular`` [B]: the popular samples, where other lookups than these decide too
    (``split_jointly``, which passes its ``_cold_lengths`` as ``counted``); by default
    those of ``lookups``."""
    ids, lengths, is_hot = lookups.ids, lookups.lengths, lookups.is_hot
    batch = lookups.batch
    device = ids.device
    bag, cold, cold_lengths = counted if counted is not None else _cold_lengths(lookups)
    if popular is None:
        popular = _popular(cold_lengths, lookups)
    if by_popularity:
        group = (~popular).to(torch.int64)
        sample = bag % batch if batch else bag
        segment = 2 * group.index_select(0, sample) + cold
        sample_order = torch.sort(group.to(torch.uint8), stable=True).indices
    else:  # one group: the segments are hot and cold (the trainer's one pass), samples as they are
        group = torch.zeros(batch, dtype=torch.int64, device=device)
        segment = cold
        sample_order = torch.arange(batch, device=device)
    # Stable: the lookups are feature-major already, so each segment stays feature-major.
    # Keyed as uint8 (segments 0..3): CUDA's sort is a radix sort over every bit of its
    # key's type (cub, bits 0..8*size), so an int64 key took 8 passes over the N
    # lookups where one byte takes 1, for the same stable order.
    perm = torch.sort(segment.to(torch.uint8), stable=True).indices
    sizes = torch.zeros(4, dtype=torch.int64, device=device).index_add_(0, segment, torch.ones_like(segment))
    unique_cold, cold_local, unique_count = compact_cold(ids, is_hot)
    scale = scale_sorted = None
    if mean:
        inv = 1.0 / lengths.clamp(min=1).to(torch.float32)  # pooled in fp32 whatever the tables
        scale = inv.index_select(0, bag)
        scale_sorted = scale.index_select(0, perm)
    header = torch.cat([(batch - group.sum()).view(1), sizes, unique_count.view(1),
                        popular.sum().view(1)])
    hot_lengths = lengths - cold_lengths
    slot_local = torch.stack([lookups.slot, cold_local]).index_select(1, perm)
    bag_lengths = torch.stack([lengths, hot_lengths, cold_lengths]).view(3, lookups.num_features, batch)
    return DeviceSplit(lookups, group, sample_order, perm, hot_lengths, cold_lengths, scale,
                       unique_cold, cold_local, header, slot_local, lookups.values.index_select(0, perm),
                       scale_sorted, bag_lengths)


@dataclass
class JointSizes(Sizes):
    """A joint split's header read: the parts' sizes summed (``group0`` and ``popular``
    are every part's), and each part's own (``parts``)."""

    parts: list[Sizes] = field(default_factory=list)


@dataclass
class JointSplit:
    """Lookups of several collections (one per table dtype) split with one popular
    mask: a sample is popular only if every lookup of it, in every part, is hot. Each
    part is a ``DeviceSplit`` of its own lookups; the header is theirs end to end."""

    parts: list[DeviceSplit]
    sample_order: torch.Tensor  # [B] every part's (same groups, so the same order)
    header: torch.Tensor  # [7 * parts] int64

    def reset(self) -> None:
        """Every part's ``DeviceSplit.reset`` (a graph replay rewrote their tensors)."""
        for part in self.parts:
            part.reset()

    def read_sizes(self, header: torch.Tensor) -> JointSizes:
        """``header`` (the host's copy of ``self.header``) read: one ``tolist``."""
        width = len(HEADER)
        values = header.tolist()
        parts = [Sizes(*values[i:i + width]) for i in range(0, len(values), width)]
        summed = [sum(getattr(p, name) for p in parts) for name in HEADER]
        summed[0], summed[-1] = parts[0].group0, parts[0].popular
        return JointSizes(*summed, parts=parts)


def split_jointly(parts: list[Lookups], mean: bool, by_popularity: bool = True) -> JointSplit:
    """Each part classified on its own, then split by the popular mask they make
    together (the AND of theirs): no size read, no wait, as ``split_on_device``."""
    counted = [_cold_lengths(lookups) for lookups in parts]
    popular = _popular(counted[0][2], parts[0])
    for lookups, (_, _, cold_lengths) in zip(parts[1:], counted[1:]):
        popular = popular & _popular(cold_lengths, lookups)
    splits = [split_on_device(lookups, mean, by_popularity, popular, c) for lookups, c in zip(parts, counted)]
    return JointSplit(splits, splits[0].sample_order, torch.cat([s.header for s in splits]))


def compact_cold(ids: torch.Tensor, is_hot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique cold ids [N] ascending, first U valid; each lookup's place among them
    [N], meaningful where cold; U as a device scalar): a sort, a cumsum and a
    scatter into a buffer of the input's size, where ``unique`` would size its
    output by the data."""
    n = ids.numel()
    if n == 0:
        return ids.new_zeros(0), ids.new_zeros(0), ids.new_zeros(())
    last = torch.iinfo(torch.int64).max  # hot ids sort after every cold one
    key, order = torch.sort(ids.masked_fill(is_hot, last))
    # Each sorted key's place among the distinct keys (the hot ones, all ``last``, one
    # more after the cold ones): equal keys share a place, so scattering every key to
    # its place writes each distinct key once (its copies write the same value).
    first = torch.empty(n, dtype=torch.bool, device=ids.device)
    first[:1].fill_(True)
    torch.ne(key[1:], key[:-1], out=first[1:])
    place = torch.cumsum(first, 0).sub_(1)
    unique = torch.zeros(n, dtype=ids.dtype, device=ids.device).scatter_(0, place, key)
    local = torch.empty(n, dtype=place.dtype, device=place.device).scatter_(0, order, place)
    # U: the last key's place + 1, less one where that key is the hot ones' ``last``
    return unique, local, place[-1] + (key[-1] != last)


def micro_lookups(split: DeviceSplit, sizes: Sizes, group: int) -> MicroLookups:
    """The lookups of ``group``'s samples (0: popular, or all without the popularity
    split; 1: the rest), from the split and the header the host read: static slices."""
    start = 0 if group == 0 else sizes.hot0 + sizes.cold0
    hot_n, cold_n = (sizes.hot0, sizes.cold0) if group == 0 else (sizes.hot1, sizes.cold1)
    hot, cold = slice(start, start + hot_n), slice(start + hot_n, start + hot_n + cold_n)
    samples = samples_of(split, sizes, group)
    bags = split.lookups.num_features * samples.numel()
    whole_batch = group == 0 and sizes.group0 == split.lookups.batch
    if whole_batch:
        # every sample (a split not by popularity: the trainer's one pass over the
        # mini-batch): the bags in batch order already, no gather
        whole, hot_lengths, cold_lengths = split.bag_lengths.view(3, bags)
    else:
        whole, hot_lengths, cold_lengths = split.bag_lengths.index_select(2, samples).view(3, bags)
    scale = split.scale_sorted
    return MicroLookups(
        hot_slots=split.slot_local[0, hot], hot_lengths=hot_lengths,
        hot_scale=None if scale is None else scale[hot], cold_local=split.slot_local[1, cold],
        cold_values=split.values_sorted[cold], cold_lengths=cold_lengths,
        cold_scale=None if scale is None else scale[cold], lengths=whole, batch=samples.numel(),
        num_features=split.lookups.num_features, cold_ids=split.unique_cold[:sizes.unique_cold],
        popular=sizes.popular if group == 0 else 0, source=(split, group), whole=whole_batch,
    )


def unique_cold_ids(split: DeviceSplit | JointSplit, sizes: Sizes) -> list[torch.Tensor]:
    """Each part's U unique cold ids (a joint split: one per part, in part order), where
    the split is: static slices, given the header the host read."""
    if isinstance(split, JointSplit):
        assert isinstance(sizes, JointSizes)
        return [part.unique_cold[:z.unique_cold] for part, z in zip(split.parts, sizes.parts, strict=True)]
    return [split.unique_cold[:sizes.unique_cold]]


def split_tensors(split: DeviceSplit | JointSplit) -> list[torch.Tensor]:
    """Every tensor of ``split`` (with its lookups'): what another stream must
    ``record_stream`` when it reads them."""
    if isinstance(split, JointSplit):  # the parts', and the header made of theirs
        return [t for part in split.parts for t in split_tensors(part)] + [split.header]
    found = [split.lookups.ids, split.lookups.values, split.lookups.lengths, split.lookups.is_hot,
             split.lookups.slot]
    for f in fields(split):
        value = getattr(split, f.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def samples_of(split: DeviceSplit | JointSplit, sizes: Sizes, group: int) -> torch.Tensor:
    """``group``'s samples [b], in batch order (rows of the mini-batch's dense and labels;
    a joint split's parts share them)."""
    return split.sample_order[:sizes.group0] if group == 0 else split.sample_order[sizes.group0:]


def all_hot(lookups: Lookups, mean: bool) -> MicroLookups:
    """A micro-batch known to be popular (every lookup hot): no split at all, its
    lookups as they are (an asynchronous device assert checks the claim)."""
    lookups.check_hot_only()
    lengths, n = lookups.lengths, lookups.ids.numel()
    scale = None
    if mean:
        inv = 1.0 / lengths.clamp(min=1).to(torch.float32)
        scale = torch.repeat_interleave(inv, lengths, output_size=n)
    empty = lookups.ids[:0]
    return MicroLookups(lookups.slot, lengths, scale, empty, empty, torch.zeros_like(lengths), None,
                        lengths, lookups.batch, lookups.num_features, empty, lookups.batch)
