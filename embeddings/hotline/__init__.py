"""Hotline: hot rows on the accelerator, cold rows in host memory.

``profile``: which rows are hot (access counts, byte budget, HotProfile).
``tiers``: HotlineEmbeddingCollection, the two-tier collection.
"""
