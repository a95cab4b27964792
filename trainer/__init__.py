"""Training: config tree, data pipeline, train/eval loop, metrics and logging."""
