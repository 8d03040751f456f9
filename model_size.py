"""GPT-2's size by arithmetic: the presets, the parameter count of a shape and the training FLOPs per token.

Imports nothing, torch included, so that what a run costs can be worked out where torch is not loaded (the
trainer's --estimate, ladder.py's --dry_run); model.py counts its FLOPs with the same function, so the MFU a run
logs and the estimate made before it use one formula.
"""

from __future__ import annotations

# The four sizes OpenAI released (GPT-2 paper, table 2).
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


def parameter_count(n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool = True) -> int:
    """Parameters of model.py's GPT of this shape, the tied token embedding and lm_head counted once.

    With C = n_embd, a block holds its two LayerNorms (C weights each, and C biases), the attention's q, k, v
    projection (C x 3C, bias 3C) and output projection (C x C, bias C), and the MLP's C x 4C and 4C x C (biases 4C
    and C): 12 C^2 weights in matrices, 4C in LayerNorms when they have biases (2C without) and 9C of Linear
    biases. Around the blocks: the token table (vocab_size x C, also the lm_head), the position table
    (block_size x C) and the final LayerNorm.
    """
    C = n_embd
    layer_norm = 2 * C if bias else C
    block = 12 * C * C + 2 * layer_norm + (9 * C if bias else 0)
    return vocab_size * C + block_size * C + n_layer * block + layer_norm


def flops_per_token(non_embedding_params: int, n_layer: int, n_head: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matmuls forward and backward, plus attention.

    N counts the parameters but the position table (a lookup, not a matmul; the tied token table is the lm_head's
    matmul, so it stays in); attention scores and the weighted sum add 12 * L * H * Q * T (PaLM paper, appendix
    B) with L layers of H heads of size Q over a context of T. A forward alone is a third of it (2N + 4 L H Q T):
    the backward computes two products for each of the forward's.
    """
    L, H, Q, T = n_layer, n_head, n_embd // n_head, seq_len
    return 6 * non_embedding_params + 12 * L * H * Q * T
