"""Worker functions for the prefix-equivalence tests (importable for spawn), including mutants."""
from __future__ import annotations

from rollplex_megatron.verify.equivalence import run_rank


def exact(cfg, hf_dir):
    """The real mechanism."""
    return run_rank(cfg, hf_dir)


def wrong_position_offset(cfg, hf_dir):
    """Mutation: response positions one step past where the full sequence has them."""
    return run_rank(cfg, hf_dir, position_offset=1)


def dropped_gkv(cfg, hf_dir):
    """Mutation: the prefix backward ignores the gK/gV accumulated on the K/V leaves."""
    from rollplex_megatron.attention.kv_store import KVStore

    KVStore.backward_pairs = lambda self, group, graph=None: ([], [])
    return run_rank(cfg, hf_dir)


def shared_kv_per_response(cfg, hf_dir):
    """Mutation: every response sees the prefix of group 0 (wrong group routing in the mask)."""
    from rollplex_megatron.attention import prefix as P

    orig = P.PackedLayout.allowed

    def allowed(self):
        if self.prefix_groups:
            self.group_T = self.group_T.clone().fill_(self.prefix_groups[0])
        return orig(self)

    P.PackedLayout.allowed = allowed
    return run_rank(cfg, hf_dir)


def packs_attend_across_groups(cfg, hf_dir):
    """Mutation: a packed prefix forward whose attention is causal over the whole pack (each group also sees
    the groups packed before it)."""
    from rollplex_megatron.attention import prefix as P

    orig = P.segment_attention  # the vision tower's segments (non-causal) stay as they are

    def one_segment(q, k, v, index, scale, causal):
        return orig(q, k, v, P.pack_index((q.shape[0],), q.device) if causal else index, scale, causal)

    P.segment_attention = one_segment
    return run_rank(cfg, hf_dir)
