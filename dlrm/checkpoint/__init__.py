"""Checkpoints: when and where they are written, the manifest that verifies them, and
the sharded part that holds the embedding tables, streamed as raw pieces."""
