"""Trainer: Hydra entry point, step loop, actor worker, config, data, metrics."""
