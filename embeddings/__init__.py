"""Embedding tables: specs, single-process collection, KV gradients, sparse optimizers.

Nothing here imports ``dlrm``. Import the submodules you need.
"""
