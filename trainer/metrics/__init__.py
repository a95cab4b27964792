"""Metrics: ranking formulas, streaming split and window metrics, evaluation, progressive metrics, logging."""
