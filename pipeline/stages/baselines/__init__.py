"""Baseline label sources for training: the oracle tables (ground-truth clean pairs) and the
cosine filter (`train.mode` oracle and the filter modes; docs/methods.md)."""
