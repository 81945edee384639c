"""Hotline: hot rows on the accelerator, cold rows in host memory.

``profile``: which rows are hot (access counts, byte budget, HotProfile).
``tiers``: HotlineEmbeddingCollection, the two-tier collection, built from
``hot_tier`` (the hot rows on the device) and a host tier (``host_tier``: the
interface; ``host_local``: one process; ``host_sharded``: several ranks, with
``sharded_rows`` moving hot rows in and out of the shards).
``lookups``: one batch's lookups split hot/cold; ColdRows, ColdPooled, HOT_ONLY.
"""
