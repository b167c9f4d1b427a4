"""Per-sample losses (per_sample), fixed-size seeded batches (batching) and the training losses
(training): pure torch/numpy."""
