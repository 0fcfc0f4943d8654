"""Workers for tests/test_qwen3vl_verl.py (importable for spawn): the rollplex verl engine on a Qwen3-VL checkpoint,
driven with tests/verl_workers.py's batches plus the `position_ids` verl's agent loop writes for them.

verl 0.9.1's agent loop computes each sample's position ids (`AgentLoopWorker._compute_position_ids`) with the
processor's `get_rope_index`, which verl binds from transformers' `Qwen3VLModel` for a `Qwen3VLProcessor`
(verl/utils/tokenizer/tokenizer.py): a text row and the three M-RoPE rows, [4, S] per sample, kept through
`left_right_2_no_padding` as a jagged nested tensor. The processor here is that binding on the checkpoint's config.
"""
from __future__ import annotations

import dataclasses
import os
import types

import torch
from transformers import AutoConfig
from transformers.models.qwen3_vl import Qwen3VLModel

from tests import verl_workers as W


def verl_processor(hf_dir: str, cfg):
    """What verl's `hf_processor` binds onto a Qwen3VLProcessor for its agent loop's positions (config, token
    ids, `get_rope_index`, `get_vision_position_ids`)."""
    proc = types.SimpleNamespace(config=AutoConfig.from_pretrained(hf_dir), image_token_id=cfg.image_token_id,
                                 video_token_id=cfg.video_token_id)
    proc.get_rope_index = types.MethodType(Qwen3VLModel.get_rope_index, proc)
    proc.get_vision_position_ids = types.MethodType(Qwen3VLModel.get_vision_position_ids, proc)
    return proc


def verl_positions(proc, row: dict) -> torch.Tensor:
    """One sample's position ids [4, S] as verl's agent loop computes them (its own code, on its processor)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    ids = row["input_ids"][None]
    mm = {k: row["multi_modal_inputs"][k] for k in ("image_grid_thw", "video_grid_thw")}
    mm["mm_token_type_ids"] = torch.zeros_like(ids)  # transformers >= 5.3: verl recomputes it from the ids
    worker = types.SimpleNamespace(processor=proc)
    return AgentLoopWorker._compute_position_ids(worker, ids, torch.ones_like(ids), mm)[0]


def with_verl_positions(hf_dir: str, cfg):
    """`verl_workers.verl_batch` whose batches also hold verl's `position_ids` (a nested [4, S] per sample)."""
    proc, plain = verl_processor(hf_dir, cfg), W.verl_batch

    def batch(model_cfg, seed, *args, rows_out=None, **kwargs):
        rows: list = []
        data = plain(model_cfg, seed, *args, rows_out=rows, **kwargs)
        data["position_ids"] = torch.nested.as_nested_tensor([verl_positions(proc, r) for r in rows],
                                                             layout=torch.jagged)
        if rows_out is not None:
            rows_out.extend(rows)
        return data

    return batch


def drop_prefix_deepstack():
    """Mutation: the prefix stage (the shared engine's only vision pass, the rollout's prefill, rollplex's actor
    prefix) drops the last DeepStack level's injection; full sequences keep it. Returns the forward it replaced."""
    from rollplex_megatron.models.qwen3vl import model as M

    saved = M.Qwen3VLModel.forward_prefix

    def forward_prefix(self, *a, **k):
        self.embed_deepstack = lambda *x, f=self.embed_deepstack, **y: (lambda e, d: (e, d and d[:-1]))(*f(*x, **y))
        try:
            return saved(self, *a, **k)
        finally:
            del self.embed_deepstack

    M.Qwen3VLModel.forward_prefix = forward_prefix
    return saved


def late_positions(cfg):
    """Mutation: the family's prompt positions one late (the engine's prefix and response positions move, full and
    shared alike; only verl's position ids can tell). Returns the spec it replaced."""
    from rollplex_megatron.models import registry

    spec = registry.FAMILIES[cfg.family]
    late = lambda c, p, extra=0, f=spec.positions.prompt: f(c, p, extra) + 1  # noqa: E731
    registry.FAMILIES[cfg.family] = dataclasses.replace(spec, positions=dataclasses.replace(spec.positions,
                                                                                             prompt=late))
    return spec


def shared_vs_full(hf_dir: str, tp: int, mutation: str = "") -> dict:
    """`verl_workers.shared_vs_full` on the Qwen3-VL checkpoint with verl's position ids in every batch; the
    vision token ids the engine bans (the checkpoint's) and, for `late_positions`, the engine's refusal."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    from rollplex_megatron.models import registry

    cfg = registry.open_hf(hf_dir).model_config()
    W.verl_batch = with_verl_positions(hf_dir, cfg)
    if mutation == "drop_deepstack":
        drop_prefix_deepstack()
    if mutation == "late_positions":
        spec = late_positions(cfg)
        try:
            W.shared_vs_full(hf_dir, tp)
            return {"error": None}
        except ValueError as e:
            return {"error": str(e)}
        finally:
            registry.FAMILIES[cfg.family] = spec
    return {**W.shared_vs_full(hf_dir, tp), "banned": list(cfg.vision_token_ids), "family": cfg.family}


def tp1_cases(hf_dir: str) -> dict:
    """The TP 1 runs in one process: the plain comparison, then the two mutations (each patches this process, so
    they come last, the refusal before the DeepStack drop)."""
    return {"plain": shared_vs_full(hf_dir, 1), "late_positions": shared_vs_full(hf_dir, 1, "late_positions"),
            "drop_deepstack": shared_vs_full(hf_dir, 1, "drop_deepstack")}
