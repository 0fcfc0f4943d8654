"""Training state (atomic checkpoints: train_state.py), run directories (run_dir.py) and conversion
between HF, megatron per-rank shards and training runs (convert.py), over the file primitives of files.py.
Each model family's HF adapter lives with the model and is reached through models/registry.py."""
