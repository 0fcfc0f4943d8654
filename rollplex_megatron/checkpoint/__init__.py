"""Training state (atomic checkpoints: train_state.py), run directories (run_dir.py) and conversion
between HF, megatron per-rank shards and training runs (convert.py). The Qwen2.5-VL HF adapter lives
with the model (models/qwen25vl/hf.py, hf_layout.py)."""
