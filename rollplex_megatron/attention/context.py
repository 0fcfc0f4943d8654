"""The contract between megatron's core attention and this project's attention contexts."""
from __future__ import annotations

from megatron.core.packed_seq_params import PackedSeqParams


class AttentionContext(PackedSeqParams):
    """Contract for attention contexts: megatron's core attention calls `attend` for every layer.

    `attend(layer_number, query [S,B,Nq,D], key/value [S,B,Ng,D], scale) -> [S,B,Nq*D]`, with
    post-RoPE inputs and GQA not expanded. Contexts reach core attention as `packed_seq_params`.
    Under `train.rope_kernel=triton` the model gives the layers no rotary embedding and sets `rotary` (the
    forward's cos/sin tables, models/triton_rope.py): `attend` then rotates its inputs first (`rotate`).
    """

    rotary = None  # RopeTables (cos, sin [S,B,1,D]; called on q or k it rotates them), or None: megatron did
    part = "attention"  # the phase part (`spans`) core attention records its calls under; None: none

    def rotate(self, query, key):
        """query and key after RoPE: unchanged unless the context carries the rotary tables."""
        if self.rotary is None:
            return query, key
        return self.rotary(query), self.rotary(key)

    def attend(self, layer: int, query, key, value, scale):  # pragma: no cover - contract
        """Attention output for one layer."""
        raise NotImplementedError
