"""The one attention abstraction (issue: prefix stage extends it with shared-prefix K/V)."""
from rollplex_megatron.attention.core import SDPACoreAttention, causal_allowed, sdpa_attention

__all__ = ["SDPACoreAttention", "causal_allowed", "sdpa_attention"]
