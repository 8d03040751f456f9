"""GPT-2 model: sizes, init, loss at init, KV-cache generation, FLOPs, optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch

from model import GPT, PRESETS, GPTConfig


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, **kw))


def test_gpt2_124m_parameter_counts():
    with torch.device("meta"):  # shapes only: no memory, no init time
        assert GPT(GPTConfig()).num_params() == 124_475_904
        assert GPT(GPTConfig(vocab_size=50257)).num_params() == 124_439_808


@pytest.mark.parametrize("name,millions", [("gpt2-medium", 354.8), ("gpt2-large", 774.0), ("gpt2-xl", 1557.6)])
def test_larger_presets_have_the_published_sizes(name, millions):
    with torch.device("meta"):
        n = GPT(GPTConfig(vocab_size=50257, **PRESETS[name])).num_params()
    assert abs(n / 1e6 - millions) < 0.5


def test_loss_at_init_is_close_to_uniform():
    model = tiny()
    idx = torch.randint(0, 50257, (4, 32))
    logits, loss = model(idx, torch.randint(0, 50257, (4, 32)))
    assert logits.shape == (4, 32, 50304)
    assert abs(loss.item() - math.log(50304)) < 0.1


def test_weights_are_tied_and_residual_projections_scaled():
    model = GPT(GPTConfig(block_size=32, n_layer=8, n_head=2, n_embd=256))
    assert model.lm_head.weight is model.transformer.wte.weight
    proj_std = model.transformer.h[0].attn.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(fc_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / math.sqrt(16)) < 0.001


def test_same_seed_same_weights():
    a, b = tiny(), tiny()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_attention_is_causal():
    model = tiny().eval()
    idx = torch.randint(0, 50257, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 50257
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_kv_cache_generation_equals_full_recompute():
    model = tiny().eval()
    idx = torch.randint(0, 50257, (3, 5))
    out = model.generate(idx, 20, temperature=0)
    ctx = idx
    for _ in range(20):
        logits, _ = model(ctx)
        logits[:, :, 50257:] = float("-inf")
        ctx = torch.cat([ctx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (3, 25) and torch.equal(out, ctx)


def test_generation_past_block_size_and_sampling_is_seeded():
    model = tiny().eval()
    idx = torch.randint(0, 50257, (2, 4))
    a = model.generate(idx, 60, top_k=20, generator=torch.Generator().manual_seed(1), valid_vocab=50257)
    b = model.generate(idx, 60, top_k=20, generator=torch.Generator().manual_seed(1), valid_vocab=50257)
    assert a.shape == (2, 64) and torch.equal(a, b)
    assert a.max() < 50257


def test_flops_per_token_formula():
    model = tiny()
    N = model.num_params() - 32 * 64
    assert model.estimate_flops_per_token(32) == 6 * N + 12 * 2 * 2 * 32 * 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_chunked_loss_matches_plain_cross_entropy(dtype):
    model = tiny()
    idx, targets = torch.randint(0, 50257, (3, 32)), torch.randint(0, 50257, (3, 32))
    results = []
    for chunk in (0, 40, 1000):  # 0 = plain path; 40 does not divide 96 tokens
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits, loss = model(idx, targets, loss_chunk_size=chunk)
        assert (logits is None) == (chunk > 0)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    tol = 1e-5 if dtype == "float32" else 2e-2
    plain_loss, plain_grads = results[0]
    for loss, grads in results[1:]:
        assert abs(loss - plain_loss) <= tol * plain_loss
        for name, g in grads.items():
            ref = plain_grads[name]
            assert torch.linalg.norm(g - ref) <= tol * torch.linalg.norm(ref) + 1e-12, name
