"""The contract between megatron's core attention and this project's attention contexts."""
from __future__ import annotations

from megatron.core.packed_seq_params import PackedSeqParams


class AttentionContext(PackedSeqParams):
    """Contract for attention contexts: megatron's core attention calls `attend` for every layer.

    `attend(layer_number, query [S,B,Nq,D], key/value [S,B,Ng,D], scale) -> [S,B,Nq*D]`, with
    post-RoPE inputs and GQA not expanded. Contexts reach core attention as `packed_seq_params`.
    """

    def attend(self, layer: int, query, key, value, scale):  # pragma: no cover - contract
        """Attention output for one layer."""
        raise NotImplementedError
