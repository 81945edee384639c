"""Input pipeline: schema, streaming Parquet reader, synthetic generator, converters.

Kept import-light on purpose: importing ``data`` loads neither torch nor torchrec;
each module imports what it needs.
"""
