"""Checkpoints: HF layouts (layout.py), HF import/export (hf.py), per-rank conversion (convert.py)."""
