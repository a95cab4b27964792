"""Checkpointing: DCP saves and loads, the run's Stateful parts, safe loading, model selection, run-folder locks,
atomic files."""
