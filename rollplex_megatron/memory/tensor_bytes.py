"""Bytes of the model's tensors on one GPU, from its shape alone: parameters (by part, on the fullest GPU), K/V
per token, and what a forward saves for backward, per token and per patch (docs/design.md §1).

Activations are what megatron-core's local layers save for backward in bf16, counted tensor by tensor (the count
is tested exactly against autograd's saved tensors), with the RMSNorm that runs (`norm`: torch | triton) and the
RoPE that runs (`rope`: torch | triton). The per-phase plan that adds these up is memory/planner.py.
"""
from __future__ import annotations

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.registry import model_spec


def param_counts(cfg: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Parameters of the whole model by part, with the vocabulary and vision MLP padded for `tp`; the family's
    layer make-up (`ModelSpec.layers`: QKV bias, q/k norms, the vision norm and MLP) from the model seam.
    `patch_embed`: what every TP rank holds whole (the patch embedding and a learned position table)."""
    lay = model_spec(cfg).layers
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kvd = cfg.num_attention_heads * d, cfg.num_query_groups * d
    v = cfg.vision
    vh, vf, fold = v.hidden_size, cfg.padded_vision_ffn(tp), v.spatial_merge_size**2 * v.hidden_size
    vocab = cfg.padded_vocab_size(tp)
    layer = h * (q + 2 * kvd) + lay.qkv_bias * (q + 2 * kvd) + q * h + 3 * f * h + 2 * h + lay.qk_norm * 2 * d
    norm = lambda width: width * (2 if lay.vision_norm == "LayerNorm" else 1)  # noqa: E731 (LayerNorm's bias)
    mlp = 2 * vf * vh + 2 * vf + vf * vh + vh if lay.vision_gated_mlp else 2 * vf * vh + vf + vh
    block = 3 * vh * vh + 3 * vh + vh * vh + vh + mlp + 2 * norm(vh)
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh + lay.vision_patch_bias * vh
    fold_mlp = fold * fold + fold + fold * v.out_hidden_size + v.out_hidden_size
    # DeepStack's mergers normalise the folded width (after the fold), the main merger each patch (before it)
    mergers = norm(vh) + fold_mlp + len(v.deepstack_visual_indexes) * (norm(fold) + fold_mlp)
    return {"patch_embed": patch + v.num_position_embeddings * vh, "vision": v.depth * block + mergers,
            "embedding": vocab * h, "layer": layer, "final_norm": h,
            "output": 0 if cfg.tie_word_embeddings else vocab * h}


def params_per_gpu(cfg: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on the fullest GPU: the first stage (vision, embedding) or the last (output).

    Exact at TP=1. At TP>1 the patch embedding counts whole on every rank (it is replicated); the
    norms and row-parallel biases, also replicated, count as split (under 1% of the tiny model)."""
    c = param_counts(cfg, tp)
    layers = c["layer"] * (cfg.num_layers // pp)
    first = (c["vision"] + c["embedding"] + layers) // tp + c["patch_embed"]
    if pp == 1:
        return first + (c["final_norm"] + c["output"]) // tp
    out = c["embedding"] if cfg.tie_word_embeddings else c["output"]  # tied: the last stage's own copy
    return max(first, (layers + c["final_norm"] + out) // tp)


def kv_bytes_per_token(cfg: ModelConfig, tp: int, layers: int, elem: int = 2) -> int:
    """K and V of one token over `layers` layers, on one GPU (KV heads replicate past TP)."""
    heads = max(cfg.num_query_groups // tp, 1)
    return 2 * layers * heads * cfg.head_dim * elem

def rope_bytes(head_dim: int, rope: str) -> tuple[int, int]:
    """What RoPE saves per token: (per layer, once per forward). megatron's rotary saves the cos and sin it
    casts in every layer, for q and for k (8 D in bf16); the fused kernel (models/triton_rope.py) one cos
    and one sin table per forward that every layer's q and k share (4 D)."""
    return (8 * head_dim, 0) if rope == "torch" else (0, 4 * head_dim)


def norm_bytes(width: int, norm: str) -> int:
    """What one RMSNorm saves per row in bf16: torch's composite an fp32 input, its fp32 normalised output
    and an fp32 rsqrt (8 width + 4); the fused kernel (models/triton_norm.py) the bf16 input and the fp32
    rsqrt (2 width + 4)."""
    return (8 if norm == "torch" else 2) * width + 4


def layer_activation_bytes(cfg: ModelConfig, tp: int, sp: bool, norm: str = "torch", rope: str = "torch") -> int:
    """Bytes one decoder layer saves for backward per token in bf16 (megatron-core's local spec).

    Counted from the tensors autograd saves (tests/test_memory_plan.py checks the count exactly, and
    tests/test_memory_runtime.py against autograd): each RMSNorm's saved tensors (`norm_bytes`, twice);
    QKV and fc1 keep their bf16 inputs (2h each); a family with q/k norms (Qwen3-VL) saves theirs
    (`qk_norm_bytes`); rotary keeps cos/sin of q and k (`rope_bytes`); attention keeps
    q and k after rotary, the fused QKV buffer (v is a view of it), its output and an fp32 log-sum-exp per
    head; linear_proj's input is that output; fc1's output (2f wide), the SwiGLU halves and fc2's input
    cost 10f. Sequence parallelism splits the h-wide terms over TP."""
    h, d = cfg.hidden_size, cfg.head_dim
    q = cfg.num_attention_heads * d // tp
    kv_heads = max(cfg.num_query_groups // tp, 1)
    kv = kv_heads * d
    heads = cfg.num_attention_heads // tp
    replicated = (2 * norm_bytes(h, norm) + 4 * h) // (tp if sp else 1)
    qk_norm = qk_norm_bytes(heads, kv_heads, d, norm) if model_spec(cfg).layers.qk_norm else 0
    return (replicated + qk_norm + rope_bytes(d, rope)[0] + 2 * q + 2 * kv + 2 * (q + 2 * kv) + 4 * heads + 2 * q
            + 10 * cfg.ffn_hidden_size // tp)


def qk_norm_bytes(heads: int, kv_heads: int, head_dim: int, norm: str) -> int:
    """What the per-head q and k RMSNorms save per token (`heads`, `kv_heads` on this TP rank): torch's composite
    its fp32 input and output and rsqrt per head (`norm_bytes`); the fused kernel its bf16 input and an fp32 rsqrt,
    where k's input is a view of the QKV buffer the attention keeps anyway, and so is q's when each KV group has one
    query head (with more, megatron's reshape of the grouped q copies it: 2 D per head)."""
    if norm == "torch":
        return (heads + kv_heads) * norm_bytes(head_dim, norm)
    return (2 * head_dim * heads if heads != kv_heads else 0) + 4 * (heads + kv_heads)


def vision_norm_bytes(cfg: ModelConfig, width: int, norm: str) -> int:
    """What one vision norm saves per row: an RMSNorm's (`norm_bytes`), or a LayerNorm's bf16 input and its fp32
    mean and rstd (no kernel of ours replaces a LayerNorm)."""
    return norm_bytes(width, norm) if model_spec(cfg).layers.vision_norm == "RMSNorm" else 2 * width + 8


def block_activation_bytes(cfg: ModelConfig, tp: int, norm: str = "torch", rope: str = "torch") -> int:
    """The same for one vision block, per patch: norms and QKV/fc1 inputs replicated, the attention's q/k/v and
    output in its own layout (windowed: gathered and scattered back) and linear_proj's input (10 vh), and the MLP:
    SwiGLU's 10 f, or fc1's biased output and fc2's input (4 f) for a GELU MLP."""
    v = cfg.vision
    vh, vf = v.hidden_size, cfg.padded_vision_ffn(tp)
    d, heads = vh // v.num_heads, v.num_heads // tp
    mlp = (10 if model_spec(cfg).layers.vision_gated_mlp else 4) * vf // tp
    return 2 * vision_norm_bytes(cfg, vh, norm) + 4 * vh + rope_bytes(d, rope)[0] + (10 * vh) // tp + 4 * heads + mlp


def vision_base_bytes(cfg: ModelConfig, tp: int, norm: str = "torch") -> int:
    """Per patch outside the blocks: the patch embedding's input, a learned position table's blend (4 int64 rows
    and 4 bf16 weights), the merger (norm, MLP) and each DeepStack merger (the norm over the folded width: its
    input is a block's output, saved already, so only its statistics; the MLP as the merger's)."""
    v = cfg.vision
    vh, m2 = v.hidden_size, v.spatial_merge_size**2
    pixels = 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2
    table = 4 * (8 + 2) if v.num_position_embeddings else 0
    stats = vision_norm_bytes(cfg, m2 * vh, norm) - 2 * m2 * vh  # per merge unit, less the input it shares
    deepstack = len(v.deepstack_visual_indexes) * (-(-stats // m2) + 2 * vh + 4 * vh // tp)
    return pixels + table + vision_norm_bytes(cfg, vh, norm) + 2 * vh + 4 * vh // tp + deepstack


def prefix_graph_bytes(cfg: ModelConfig, tp: int, pp: int, sp: bool, tokens: int, patches: int,
                       norm: str = "torch", rope: str = "torch") -> int:
    """What one prefix forward with a graph saves on the fullest stage (vision on the first); `norm` and
    `rope`: the RMSNorm and the RoPE that run (torch | triton)."""
    h = cfg.hidden_size
    llm = tokens * ((cfg.num_layers // pp) * layer_activation_bytes(cfg, tp, sp, norm, rope)
                    + rope_bytes(cfg.head_dim, rope)[1])
    final_norm = tokens * norm_bytes(h, norm) // (tp if sp else 1) if pp == 1 else 0
    vd = cfg.vision.hidden_size // cfg.vision.num_heads
    vis = patches * (cfg.vision.depth * block_activation_bytes(cfg, tp, norm, rope) + vision_base_bytes(cfg, tp, norm)
                     + rope_bytes(vd, rope)[1])
    return llm + final_norm + vis

def vocab_slice(cfg: ModelConfig, tp: int) -> int:
    """The output layer's width on one TP rank: its slice of the vocabulary padded as megatron pads it."""
    return cfg.padded_vocab_size(tp) // tp


def logits_bytes(cfg: ModelConfig, tp: int, tokens: int) -> int:
    """Loss workspace at the end of a forward: bf16 logits, their fp32 copy and the max-shifted fp32
    logits of megatron's vocab-parallel cross entropy (10 bytes per token and vocabulary entry)."""
    return tokens * vocab_slice(cfg, tp) * 10


def score_logits_bytes(cfg: ModelConfig, tp: int, tokens: int, kernel: str, elem: int = 2) -> int:
    """Loss workspace of a forward-only scoring pass: with the fused log-prob kernel (`kernel="triton"`) the
    output layer's logits and their [B, S, V] contiguous copy in the compute dtype (`elem` bytes), both live while
    the copy is made (the kernel keeps per-row numbers only); with torch's path `logits_bytes`."""
    if kernel != "triton":
        return logits_bytes(cfg, tp, tokens)
    return tokens * vocab_slice(cfg, tp) * 2 * elem


def training_forward_bytes(cfg: ModelConfig, tp: int, pp: int, sp: bool, tokens: int, patches: int,
                           norm: str = "torch", rope: str = "torch", logprob: str = "torch", elem: int = 2) -> int:
    """A micro-batch's saved activations plus the loss workspace (the update's peak moment: the backward's first
    op). `logprob`: the log-prob kernel counted for the loss, "triton" over one packed row (`score_logits_bytes`:
    the logits the fused kernel saves and their gradient, `elem` bytes each), else torch's fp32 copies
    (`logits_bytes`; serial's whole sequences are counted so, their measured peaks lying above the kernel's count)."""
    out_in = tokens * 2 * cfg.hidden_size // (tp if sp else 1)  # the output layer's input
    return (prefix_graph_bytes(cfg, tp, pp, sp, tokens, patches, norm, rope) + out_in
            + score_logits_bytes(cfg, tp, tokens, logprob, elem))
