"""Data pipeline: Parquet streaming, feature encoding, batches and dataset converters."""
