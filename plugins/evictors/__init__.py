"""Evictors: which tokens leaving the exact window are stored at all (docs/baselines.md)."""
