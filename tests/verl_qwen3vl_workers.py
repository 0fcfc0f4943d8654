"""Workers for tests/test_qwen3vl_verl.py (importable for spawn): the rollplex verl engine on a Qwen3-VL checkpoint,
driven with tests/verl_workers.py's batches plus the `position_ids` verl's agent loop writes for them.

verl 0.9.1's agent loop computes each sample's position ids (`AgentLoopWorker._compute_position_ids`) with the
processor's `get_rope_index`, which verl binds from transformers' `Qwen3VLModel` for a `Qwen3VLProcessor`
(verl/utils/tokenizer/tokenizer.py): a text row and the three M-RoPE rows, [4, S] per sample, kept through
`left_right_2_no_padding` as a jagged nested tensor. The processor here is that binding on the checkpoint's config.

The `rollplex` rollout backend's case (`rollout_case`, tests/test_qwen3vl_verl_rollout.py) drives verl's side with
verl's own code too: transformers' Qwen3VLProcessor with verl's bindings (`qwen3_processor`), the agent loop's
multi-modal inputs and position ids per sample (`verl_row`).
"""
from __future__ import annotations

import dataclasses
import os
import types
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.qwen3_vl import Qwen3VLModel

from tests import verl_workers as W
from tests.numerics import rel_err


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


# -- the `rollplex` rollout backend on Qwen3-VL ----------------------------------------------------------------------
def write_verl_processor(hf_dir: str) -> str:
    """The processor files verl's agent loop reads next to the checkpoint (`make-example`'s Qwen3-VL processor,
    images up to 4x4 merge units), with test_verl_e2e_step's tokenizer changes for verl 0.9.1: a one-token
    newline and plain vision tokens (the agent loop decodes a prompt dropping special tokens, then re-expands it)."""
    from tokenizers import pre_tokenizers

    from rollplex_megatron.data.example import TIMESTAMP_WORDS, WORDS, write_qwen3_processor
    from rollplex_megatron.data.example_files import tiny_tokenizer
    from rollplex_megatron.models import registry

    cfg = registry.open_hf(hf_dir).model_config()
    unit = cfg.vision.patch_size * cfg.vision.spatial_merge_size
    write_qwen3_processor(Path(hf_dir), cfg, unit * unit, 16 * unit * unit)
    tok = tiny_tokenizer(WORDS + TIMESTAMP_WORDS, cfg, newline=True, vision_special=False)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(  # timestamps' digits one token each
        [tok.backend_tokenizer.pre_tokenizer, pre_tokenizers.Digits(individual_digits=True)])
    tok.save_pretrained(hf_dir)
    return hf_dir


def stand_in_torchvision() -> None:
    """transformers' torchvision video kernels in torch / PIL (tests/test_qwen3vl_data.py's stand-ins, frames
    RGB already), in this process: verl's `hf_processor` cannot build a Qwen3VLProcessor without torchvision."""
    from transformers import processing_utils
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

    from tests.test_qwen3vl_data import _normalize, _pil_resize

    BaseVideoProcessor.resize, BaseVideoProcessor.normalize = _pil_resize, _normalize
    BaseVideoProcessor.convert_to_rgb = lambda self, video, **kwargs: video
    processing_utils.transformers_module.VideoProcessorMixin = VideoProcessorMixin


def qwen3_processor(hf_dir: str):
    """transformers' Qwen3VLProcessor of the checkpoint with what verl's `hf_processor` binds onto it (its config,
    `get_rope_index`, `get_vision_position_ids`)."""
    from tests.test_qwen3vl_data import hf_qwen3_processor

    stand_in_torchvision()
    proc = hf_qwen3_processor(hf_dir)
    proc.config = AutoConfig.from_pretrained(hf_dir)
    proc.get_rope_index = types.MethodType(Qwen3VLModel.get_rope_index, proc)
    proc.get_vision_position_ids = types.MethodType(Qwen3VLModel.get_vision_position_ids, proc)
    return proc


def media(seed: int) -> dict:
    """One prompt's images and videos as verl's agent loop hands them to `generate`: a 32x48 picture and a
    2-frame 32x48 video (one temporal patch: one timestamped run) with its metadata. (verl 0.9.1's agent loop
    cannot hold a longer one: `_compute_multi_modal_inputs` collapses each placeholder run and re-expands,
    and a video of n runs leaves n placeholders for one video, which the processor refuses.)"""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    frames = torch.from_numpy(rng.integers(0, 256, (2, 3, 32, 48), dtype=np.uint8))
    meta = {"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1]}
    return {"images": [image], "videos": [(frames, meta)]}


def agent_prompt(proc, mm: dict) -> list[int]:
    """The prompt ids verl's single-turn agent loop sends: the chat template, expanded by the processor."""
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                         {"type": "text", "text": "which colour is the square ?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    (frames, meta), = mm["videos"]
    out = proc(text=[text], images=mm["images"], videos=[frames], video_metadata=[meta], do_sample_frames=False,
               return_tensors="pt")
    return out["input_ids"][0].tolist()


def verl_row(proc, prompt: list[int], response: list[int], mm: dict, uid: str) -> dict:
    """One sample as verl's agent loop stores it: its multi-modal inputs (`_compute_multi_modal_inputs`, the
    processor on the collapsed, decoded prompt) and position ids (`_compute_position_ids`), verl's own code."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = types.SimpleNamespace(processor=proc, tokenizer=proc.tokenizer, _get_mm_processor_kwargs=lambda a: {})
    p, r = torch.tensor(prompt), torch.tensor(response)
    ids = torch.cat([p, r])
    out = types.SimpleNamespace(multi_modal_data=mm, mm_processor_kwargs=None)
    mm_inputs = AgentLoopWorker._compute_multi_modal_inputs(worker, out, p[None])
    pos = AgentLoopWorker._compute_position_ids(worker, ids[None], torch.ones_like(ids)[None], mm_inputs)[0]
    ones = lambda n: torch.ones(n, dtype=torch.int64)  # noqa: E731
    return {"prompts": p, "responses": r, "input_ids": ids, "attention_mask": ones(ids.numel()),
            "response_mask": ones(r.numel()), "loss_mask": ones(r.numel()), "position_ids": pos,
            "multi_modal_inputs": mm_inputs, "uid": uid}


def score(engine, rows: list[dict], temperature: float) -> list[torch.Tensor]:
    """The engine's log-probs of each sample's response tokens (verl's compute_log_prob on one batch)."""
    from verl.utils import tensordict_utils as tu

    from rollplex_megatron.integrations.verl.batch import as_nested

    data = tu.list_of_dict_to_tensordict(rows)
    for k in ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "loss_mask", "position_ids"):
        data[k] = as_nested([r[k] for r in rows])  # verl's jagged layout
    tu.assign_non_tensor(data, temperature=temperature, micro_batch_size_per_gpu=4)
    with engine.eval_mode():
        out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
    lp = out["model_output"]["log_probs"].unbind()
    return [x[len(r["prompts"]) - 1:len(r["input_ids"]) - 1] for x, r in zip(lp, rows)]


def plain(engine, rows: list[dict], temperature: float) -> list[torch.Tensor]:
    """`score` computing every prefix (nothing held is read)."""
    held, engine.window = engine.window, None
    try:
        return score(engine, rows, temperature)
    finally:
        engine.window = held


def rotated(entries: dict) -> dict:
    """Mutation: each held prompt answered with the next held prompt's K/V (prompts of one length)."""
    flat = [(k, e) for k, es in entries.items() for e in es]
    out: dict = {}
    for i, (k, (prompt, _, version)) in enumerate(flat):
        out.setdefault(k, []).append((prompt, flat[(i + 1) % len(flat)][1][1], version))
    return out


def rollout_case(hf_dir: str) -> dict:
    """Two prompts (a picture and a 2-frame video each; equal ids, other pixels) x 3 samples through the `rollplex`
    server, the rollout on the actor engine's modules with the reference prefix stage in its decode window, then
    verl's scoring phases on verl's rows of the samples (`verl_row`). Returns norm-relative differences: the
    rollout's log-probs vs the actor's scoring; each engine's scoring from the held K/V vs computing every prefix;
    mutations: held K/V rotated between the two prompts; a second round whose rollout prefill (and reference
    prefix stage) drops one DeepStack injection (`drop_prefix_deepstack`), scored by the intact model."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import asyncio

    import verl  # noqa: F401  (the plugin registers the backend)
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from rollplex_megatron.integrations.verl import rollout as R
    from rollplex_megatron.models.qwen3vl import model as M
    from tests.test_verl_e2e_rollout import _Worker

    proc = qwen3_processor(hf_dir)
    engine = W.new_engine(hf_dir, 1, share_prefix=True)
    ref = W.new_engine(hf_dir, 1, share_prefix=True, forward_only=True)
    cfg = RolloutConfig(name="rollplex", tensor_model_parallel_size=1, prompt_length=96, response_length=6,
                        free_cache_engine=True)
    rollout = get_rollout_class("rollplex", "async")(config=cfg, model_config=HFModelConfig(
        path=hf_dir, load_tokenizer=False), device_mesh=None)
    server = R.RollplexServer(cfg, None, [_Worker(rollout, engine, ref)], 0,
                              tools=(proc, proc.tokenizer, tuple(range(150, 200))))  # stops: ragged samples
    mms = [media(1), media(2)]
    prompts = [agent_prompt(proc, m) for m in mms]
    params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def calls():
        return await asyncio.gather(*[server.generate(prompts[i % 2], dict(params), f"r{i}",
                                                      image_data=mms[i % 2]["images"],
                                                      video_data=mms[i % 2]["videos"]) for i in range(6)])

    def rollout_round():
        outs = asyncio.run(calls())
        rows = [verl_row(proc, prompts[i % 2], o.token_ids, mms[i % 2], f"u{i % 2}") for i, o in enumerate(outs)]
        return [o.log_probs for o in outs], rows, dict(engine.window.entries), dict(ref.window.entries)

    def phases(rows: list) -> dict:
        """Each engine's scoring from what the rollout held (first: reading it drops it), then computing all."""
        out = {}
        for role, e in (("actor", engine), ("ref", ref)):
            out[role] = score(e, rows, 0.7)
            out[role + "_window"] = dict(e.last_window)
            out[role + "_plain"] = plain(e, rows, 0.7)
        return out

    r = {"same_ids": prompts[0] == prompts[1], "prompt_len": len(prompts[0])}
    lps, rows, actor_held, ref_held = rollout_round()
    s = phases(rows)
    r["stats"] = asyncio.run(server.get_stats())
    r["lens"] = [len(x) for x in lps]
    r["rollout_vs_actor"] = rel_err(lps, s["actor"])
    r["rollout_vs_actor_plain"] = rel_err(lps, s["actor_plain"])
    for role, e, held in (("actor", engine, actor_held), ("ref", ref, ref_held)):
        r[role + "_window"] = s[role + "_window"]
        r[role + "_held_vs_plain"] = rel_err(s[role], s[role + "_plain"])
        e.window.entries = rotated(held)  # mutation: the other prompt's K/V
        r[role + "_rotated_vs_plain"] = rel_err(score(e, rows, 0.7), s[role + "_plain"])
    asyncio.run(server.sleep())
    saved = drop_prefix_deepstack()  # mutation: the second rollout's prefixes (actor's and reference's) lack one
    try:
        lps, rows, _, _ = rollout_round()
    finally:
        M.Qwen3VLModel.forward_prefix = saved
    s = phases(rows)
    r["dropped_window"] = [s["actor_window"], s["ref_window"]]
    r["dropped_rollout_vs_actor_plain"] = rel_err(lps, s["actor_plain"])
    r["dropped_actor_held_vs_plain"] = rel_err(s["actor"], s["actor_plain"])
    r["dropped_ref_held_vs_plain"] = rel_err(s["ref"], s["ref_plain"])
    return r
