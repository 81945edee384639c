"""One file per sharding strategy: where a table's shards go, how a feature's ids
are routed to them and how their pooled pieces are put back together, what they
cost, and how they are checkpointed.

    base.py           the Strategy interface, and what model-parallel ones share
    table_wise.py     ┌────────┐      one rank holds the whole table
    column_wise.py    ┌──┬──┬──┐      the dim split over ranks, pieces side by side
    row_wise.py       ├────────┤      the rows split over ranks, pieces added
    data_parallel.py  a full copy on every rank, KV gradients all-gathered
    registry.py       strategy(ShardingType) → its Strategy

    route(ids, lengths)  → per shard (lengths [B], ids rebased to the shard)
    combine(pieces)      → pooled [B, D] from per-shard pooled pieces, shard order
"""
