"""Offline tools that write Parquet: the synthetic generators and the converters of raw logs (csv, Criteo,
MovieLens)."""
