"""GPT-2: the model, its size presets, initialisation, optimizer groups and FLOPs.

Pure: no file or network I/O and no distributed code. Shapes in comments use
B = batch, T = sequence length, C = n_embd, nh = n_head, hs = C // nh, V = vocab_size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# the presets and the FLOPs formula live in model_size.py, which needs no torch (an estimate before a run reads them);
# PRESETS is read from here by the rest of the code, as before
from model_size import PRESETS, flops_per_token  # noqa: F401


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the position table covers
    vocab_size: int = 50304  # 50257 padded up to a multiple of 128 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in every Linear and LayerNorm

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # scaled at init, see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            # generation: attend over everything cached so far plus the new positions
            k, v = kv_cache.append(layer, k, v)  # (B, nh, T_past + T, hs)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask_with_past(T, k.size(2), x.device))
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.recompute = False  # activation checkpointing (GPT.recompute_blocks): keep only x for backward
        self.add_norm: AddNorm | None = None  # a fused residual add + layer norm (GPT.fuse_residual_norms)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        if self.recompute and kv_cache is None and torch.is_grad_enabled():
            # Save only the input; backward runs the block's forward again to get what it needs.
            # Non-reentrant: the recomputation restores the RNG state (the same dropout masks) and
            # the autocast state, so the gradients are those of the plain forward, bit for bit.
            return checkpoint(self.residual_branches, x, use_reentrant=False)
        return self.residual_branches(x, kv_cache, layer)

    def residual_branches(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x, h = add_then_norm(x, self.attn(self.ln_1(x), kv_cache, layer), self.ln_2, self.add_norm)
        x = x + self.mlp(h)
        return x


# (x, branch, weight, bias, eps) -> (x + branch, layer_norm(x + branch)): GPT.fuse_residual_norms' argument
AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
                   tuple[torch.Tensor, torch.Tensor]]


def add_then_norm(x: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm,
                  fused: AddNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding a branch (B, T, C), and norm of it: by the two ops, or by `fused`."""
    if fused is None:
        x = x + branch
        return x, norm(x)
    return fused(x, branch, norm.weight, norm.bias, norm.eps)


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `x @ weight.T` against targets, never holding all the logits.

    The (N, V) logits of a GPT-2 batch are the largest tensors of a step (B=64, T=1024:
    3.3 billion entries, 13 GB in fp32, plus as much again for their gradient). Here they are
    made `chunk_size` rows at a time, and because the loss is the last op of the graph, the
    gradients with respect to x and weight are computed in the same pass (softmax minus
    one-hot, times the inputs): forward keeps only grad_x (N, C) and grad_weight (V, C), and
    backward just scales them. Same FLOPs as the plain path, a fraction of its memory.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
        # x (N, C) and weight (V, C) in the compute dtype; targets (N,)
        N = x.size(0)
        grad_x = torch.empty_like(x)  # (N, C)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, C)
        loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, N, chunk_size):
            xc, tc = x[start : start + chunk_size], targets[start : start + chunk_size]  # (n, C), (n,)
            logits = upcast(xc @ weight.t())  # (n, V), fp32 for the softmax
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            loss_sum += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            dlogits = logits.sub_(lse[:, None]).exp_()  # softmax, in place: (n, V)
            dlogits[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0  # d(sum of losses)/d(logits)
            dlogits = dlogits.to(x.dtype)
            grad_x[start : start + chunk_size] = dlogits @ weight  # (n, C)
            grad_weight += upcast(dlogits.t() @ xc)  # (V, C)
        ctx.save_for_backward(grad_x, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss_sum / N

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_weight = ctx.saved_tensors
        scale = grad_loss / grad_x.size(0)  # d(mean)/d(sum) times the incoming gradient
        return grad_x * scale.to(grad_x.dtype), (grad_weight * scale).to(ctx.weight_dtype), None, None


def autocast_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and weight as autocast runs a Linear: both in its dtype where it is on (cast back in the backward), else
    x in weight's dtype. For a custom autograd Function, which autocast does not cast for."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), weight.to(dtype)
    return (x.to(weight.dtype) if x.dtype != weight.dtype else x), weight


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Chunked, fused `F.cross_entropy(x @ weight.T, targets)` (mean), autocast-aware."""
    x, weight = autocast_operands(x, weight)
    return LinearCrossEntropy.apply(x, weight, targets, chunk_size)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 -> fp32; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def causal_mask_with_past(T_new: int, T_total: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (T_new, T_total) mask: new position i sees all past positions and new ones <= i."""
    if T_new == 1:
        return None  # a single new token sees everything
    return torch.ones(T_new, T_total, dtype=torch.bool, device=device).tril(diagonal=T_total - T_new)


class KVCache:
    """Keys and values of past positions for incremental decoding, one pair per layer."""

    def __init__(self, n_layer: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].size(2)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v



class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (GPT-2, Press & Wolf 2017)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                # GPT-2 paper: scale residual-path weights by 1/sqrt(N), N = 2 residual adds per layer,
                # so the residual stream's variance does not grow with depth
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def recompute_blocks(self, every: int) -> None:
        """Activation checkpointing: one block in every `every` (blocks 0, every, 2 * every, ...) keeps only
        its input for backward and recomputes the rest there; 1 is every block, 0 none (the default).

        A block's activations are most of a training step's memory (benchmarks/activations.py);
        recomputing them costs about one more forward of those blocks. The math is unchanged.
        """
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        for i, block in enumerate(self.transformer.h):
            block.recompute = every > 0 and i % every == 0

    def fuse_residual_norms(self, add_norm: AddNorm | None) -> None:
        """Each block's attention residual add and the layer norm after it (ln_2) by one function, `add_norm`
        (the training runtime's kernel), or by the two ops (None, the default). The same math.

        Only the pair inside a block: the MLP's add is read by the next block's ln_1, whose parameters belong
        to that block (under FSDP, gathered only for its own forward), so it stays two ops.
        """
        for block in self.transformer.h:
            block.add_norm = add_norm

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied wte/lm_head counted once); non_embedding drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def hidden_states(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Final-LayerNorm activations (B, T, C) for token ids idx (B, T)."""
        B, T = idx.size()
        start = 0 if kv_cache is None else kv_cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of length {start + T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, kv_cache, layer)
        return self.transformer.ln_f(x)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk_size: int = 0,
        loss_head: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits (B, T, V) and, given targets (B, T), the mean cross-entropy over all B*T tokens.

        With targets and loss_chunk_size > 0, the loss comes from the fused chunked
        LinearCrossEntropy and no logits are made (None is returned in their place). With targets and a
        loss_head (the training runtime's choice of lm_head and loss kernels), the loss is
        loss_head(x (B*T, C), lm_head weight (V, C), targets (B*T,)), and no logits are returned either.
        """
        x = self.hidden_states(idx)
        if targets is not None and (loss_chunk_size > 0 or loss_head is not None):
            B, T, C = x.size()
            if loss_head is not None:
                return None, loss_head(x.view(B * T, C), self.lm_head.weight, targets.view(B * T))
            loss = linear_cross_entropy(x.view(B * T, C), self.lm_head.weight, targets.view(B * T), loss_chunk_size)
            return None, loss
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # bf16 logits are upcast: the softmax over 50K classes needs fp32 precision
            loss = F.cross_entropy(upcast(logits).view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def logits_and_losses(self, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 8192) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """lm_head and the cross-entropy of each position's next token, `chunk_size` positions at a time.

        hidden (N, C) final-LayerNorm activations, targets (N,). Yields (logits (n, V), losses (n,))
        per chunk, both at least float32, so the whole (N, V) logits never exist at once: for a
        val batch of 64 x 1024 positions they would take 13 GB in fp32. lm_head runs in the
        caller's autocast; the softmax over the 50K classes runs in float32 (float64 weights:
        float64). For evaluations (no fused backward, unlike LinearCrossEntropy).
        """
        for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size)):
            logits = upcast(self.lm_head(h))  # (n, V)
            yield logits, F.cross_entropy(logits, t, reduction="none")

    def estimate_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token over a context of seq_len (model_size.flops_per_token: 6N plus attention)."""
        cfg = self.config
        return flops_per_token(self.num_params(non_embedding=True), cfg.n_layer, cfg.n_head, cfg.n_embd, seq_len)

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        generator: torch.Generator | None = None, valid_vocab: int | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens, with a KV cache.

        temperature 0 picks the most likely token (greedy). valid_vocab masks the padding rows
        of the embedding (ids >= 50257 are never real tokens). When the context fills the
        position table, the cache is rebuilt from the newest half of the context.
        """
        cache = KVCache(self.config.n_layer)
        context = idx
        fresh = idx  # tokens not yet in the cache
        for _ in range(max_new_tokens):
            if cache.length + fresh.size(1) > self.config.block_size:
                cache = KVCache(self.config.n_layer)
                fresh = context[:, -(self.config.block_size // 2):]
            logits = upcast(self.lm_head(self.hidden_states(fresh, cache)[:, -1, :]))  # (B, V)
            if valid_vocab is not None:
                logits[:, valid_vocab:] = float("-inf")
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = float("-inf")
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            context = torch.cat([context, next_id], dim=1)
            fresh = next_id
        return context
