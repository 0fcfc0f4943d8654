"""Parallelism-aware weight sharing between the training layout and rollout layouts."""
