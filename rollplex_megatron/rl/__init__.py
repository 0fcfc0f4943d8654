"""GRPO pieces: group advantages, clipped ratio loss, KL to the reference, entropy."""
