"""Ranks and parallelism, applied from outside the model: process setup and collectives,
the sharding plan of a config, and the one place that turns a plain DLRM into a
sharded or Hotline model with its MLPs under DDP."""
