"""Rollplex for your own megatron-core GPTModel and training loop ("import as a Megatron extension").

What it gives a Megatron user with GRPO-style batches (G responses per prompt):
- `with_prefix_attention(spec)`: a copy of a GPT layer spec whose core attention reads the
  shared-prefix context (`AttentionContext`, passed by megatron as `packed_seq_params`);
- `PrefixGPT(gpt)`: the GPTModel of one pipeline stage with RoPE at explicit positions, so packed
  responses continue after their prompt (megatron's GPTModel derives RoPE from the length alone);
- `text_groups` + `response_micro_batches`: a batch as groups (prompt + responses + advantages),
  packed into response-stage micro-batches (`full_micro_batches` for the plain path);
- `actor_prefix_step`: the prefix stage once per group, the response micro-batches through
  `get_forward_backward_func()`, the prefix backward once per group, then `finalize_model_grads`;
  `reference_prefix_logprobs` is its forward-only variant and `full_sequence_step` the plain path.
The prefix gradient is exact (docs/design.md §3): gK/gV of every response accumulate on the prefix
K/V leaves and go once through the prefix graph. The loss contract is megatron's per-token one
(`calculate_per_token_loss=True`: a micro-batch's loss arrives summed, pre-scaled by the caller).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from rollplex_megatron.attention.core import SDPACoreAttention
from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.attention.prefix import PrefixContext
from rollplex_megatron.prefix.batch import Group, Prompt, full_micro_batches, response_micro_batches
from rollplex_megatron.runtime import device
from rollplex_megatron.prefix.execution import (actor_prefix_step, finalize, full_sequence_step, prefix_backward,
                                                prefix_forward, reference_prefix_logprobs, run_schedule)

__all__ = ["with_prefix_attention", "PrefixGPT", "TEXT_POSITIONS", "text_groups", "Group", "Prompt",
           "response_micro_batches", "full_micro_batches", "actor_prefix_step", "reference_prefix_logprobs",
           "full_sequence_step", "prefix_forward", "run_schedule", "prefix_backward", "finalize", "KVStore",
           "PrefixContext"]


def with_prefix_attention(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT layer spec (e.g. `get_gpt_layer_local_spec()`) with the shared-prefix core
    attention: causal SDPA by default, the prefix/response rule when a context is passed."""
    spec = copy.deepcopy(spec)
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = SDPACoreAttention
    attn.params = {**(attn.params or {}), "attn_mask_type": AttnMaskType.causal}
    return spec


@dataclass(frozen=True)
class _Vision:
    spatial_merge_size: int = 1
    tokens_per_second: int = 1


@dataclass(frozen=True)
class TextPositions:
    """The position rule of text-only prompts for the batch builders (no vision placeholders, so
    every position is the token index; the builders' M-RoPE rows are then all equal)."""

    image_token_id: int = -1
    video_token_id: int = -1
    vision: _Vision = _Vision()
    # the family whose position rule the builders ask (models/registry.py): on text alone every family's M-RoPE
    # positions are the token index
    family: str = "qwen2_5_vl"


TEXT_POSITIONS = TextPositions()


def text_groups(prompts: list[torch.Tensor], responses: list[list[torch.Tensor]],
                advantages: list[torch.Tensor]) -> list[Group]:
    """Groups of text prompts ([P] long, P >= 2) with their G responses ([R] long, R >= 1) and advantages [G]
    (finite); each refusal names the group, the response and the fix."""
    if not len(prompts) == len(responses) == len(advantages):
        raise ValueError(f"text_groups: {len(prompts)} prompts, {len(responses)} response lists and "
                         f"{len(advantages)} advantage tensors; give one of each per group")

    def ids(t, what: str, least: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            got = f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"text_groups: {what} must be a 1-D tensor of token ids (int64), got {got}")
        if t.numel() < least:
            raise ValueError(f"text_groups: {what} has {t.numel()} tokens; it needs at least {least}")
        return t

    out = []
    for gi, (p, rs, a) in enumerate(zip(prompts, responses, advantages)):
        ids(p, f"prompt {gi}", 2)  # the prefix stage runs prompt[:-1]; its last token starts the responses
        rs = [ids(r, f"group {gi} response {ri}", 1) for ri, r in enumerate(rs)]
        adv = torch.as_tensor(a, dtype=torch.float32).reshape(-1)
        if adv.numel() != len(rs):
            raise ValueError(f"text_groups: group {gi} has {len(rs)} responses but {adv.numel()} advantages; give one "
                             f"advantage per response")
        if not torch.isfinite(adv).all():
            raise ValueError(f"text_groups: group {gi}'s advantages are not all finite ({adv.tolist()})")
        out.append(Group(Prompt(p), rs, adv))
    return out


class PrefixGPT(MegatronModule):
    """One pipeline stage of a megatron-core GPTModel (`position_embedding_type="rope"`, layer spec
    from `with_prefix_attention`) with RoPE at the positions it is given.

    `forward` is what megatron's schedule calls: vocab-parallel logits [B,T,V/TP] on the last stage,
    hidden states [T,B,H] elsewhere. `prefix_stage` is the prefix forward of a list of prompts, packed.
    """

    def __init__(self, gpt: GPTModel):
        super().__init__(config=gpt.config)
        if gpt.position_embedding_type != "rope":
            raise ValueError(f"PrefixGPT needs position_embedding_type='rope', got {gpt.position_embedding_type!r}")
        c = gpt.config
        if gpt.post_process and not gpt.parallel_output:
            raise ValueError("PrefixGPT needs GPTModel(parallel_output=True): the loss reads vocab-parallel logits")
        if c.sequence_parallel or c.context_parallel_size > 1:
            raise ValueError("PrefixGPT runs without sequence parallelism and context parallelism (packed "
                             "responses attend to their own group's prefix); set sequence_parallel=False and "
                             "context_parallel_size=1")
        self.gpt, self.pre_process, self.post_process = gpt, gpt.pre_process, gpt.post_process
        self.model_type = gpt.model_type  # read by megatron's schedules

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Read by megatron's finalize_model_grads (tied-embedding gradient sync over PP)."""
        return self.gpt.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        """The tied weight on this stage."""
        return self.gpt.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: the activation received from the previous stage."""
        self.gpt.set_input_tensor(input_tensor)

    def _rope(self, pos_T: torch.Tensor) -> torch.Tensor:
        table = self.gpt.rotary_pos_emb(int(pos_T.max()) + 1)  # [L,1,1,D] for positions 0..L-1
        return table[pos_T.to(table.device)]

    def _decode(self, input_ids, pos_T, ctx, input_tensor=None) -> torch.Tensor:
        if self.pre_process:
            hidden = self.gpt.embedding(input_ids=input_ids, position_ids=None)
        else:
            if input_tensor is not None:
                self.gpt.decoder.set_input_tensor(input_tensor)
            hidden = None
        return self.gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=self._rope(pos_T),
                                packed_seq_params=ctx)

    def forward(self, input_ids=None, position_ids=None, attention_context=None, **_vision):
        """Per-stage forward over packed tokens; `position_ids` [1,T] or the builders' [3,1,T]."""
        pos_T = position_ids.reshape(-1, position_ids.shape[-1])[0]
        hidden = self._decode(input_ids, pos_T, attention_context)
        if not self.post_process:
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(hidden, weight=weight)
        return logits.transpose(0, 1).contiguous()

    def prefix_stage(self, prompts: list[Prompt], ctx, input_tensor=None) -> torch.Tensor:
        """The prefixes (prompt[:-1]) of `prompts`, packed, on this stage; returns [sum(P-1),1,H]."""
        ids = torch.cat([p.input_ids[:-1] for p in prompts])[None].to(device())
        pos = torch.cat([torch.arange(p.input_ids.numel() - 1) for p in prompts])
        return self._decode(ids, pos, ctx, input_tensor)
