"""Checkpoints: when and where they are written, the manifest that verifies them, and
the sharded (torch.distributed.checkpoint) part that holds the embedding tables."""
