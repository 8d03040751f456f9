"""Activation checkpointing (`activation_checkpointing`): the same losses and gradients, less memory.

Non-reentrant torch.utils.checkpoint restores the RNG state before it recomputes a block, so the
dropout masks of the recomputed forward are the forward's own: on the CPU in float32 a run with
recomputation is bitwise the run without it, in one process and under ddp and fsdp on 2 ranks.
That it really recomputes is checked by what autograd keeps: fewer tensors saved for backward.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import REPO, base_args, build_tiny_run, load_weights, make_shards, run_trainer, train_losses
from model import GPT, GPTConfig
from launch.config import parse_args
from common.errors import ConfigError

DROPOUT = dict(dropout=0.1)  # masks drawn in every block: a recomputation with other masks would show
SETTINGS = {"none": 0, "full": 1, "selective": 2}


def tiny_model(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.2))


def step(model: GPT, every: int, loss_chunk_size: int, autocast: torch.dtype | None = None
         ) -> tuple[torch.Tensor, dict, int]:
    """One training forward and backward of a copy of model with recompute_every `every`: the loss,
    the gradients, and how many tensors autograd saved for backward."""
    model = copy.deepcopy(model)
    model.recompute_blocks(every)
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    saved = []
    torch.manual_seed(7)  # the dropout masks
    with (torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
          torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)):
        _, loss = model(idx, idx, loss_chunk_size=loss_chunk_size)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, len(saved)


@pytest.mark.parametrize("loss_chunk_size", [0, 16], ids=["plain-loss", "fused-chunked-loss"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_recomputed_blocks_give_bitwise_the_same_loss_and_gradients_with_dropout(loss_chunk_size, autocast):
    model = tiny_model()
    loss, grads, _ = step(model, 0, loss_chunk_size, autocast)
    for every in (1, 2, 3):
        loss_r, grads_r, _ = step(model, every, loss_chunk_size, autocast)
        assert torch.equal(loss_r, loss), every
        for name in grads:
            assert torch.equal(grads_r[name], grads[name]), (every, name)


def test_full_recomputation_keeps_fewer_tensors_for_backward_and_selective_between():
    model = tiny_model(n_layer=4)
    counts = {every: step(model, every, 16)[2] for every in (0, 1, 2)}
    # none keeps every block's activations; full keeps each block's input alone; selective (blocks 0 and 2)
    # keeps half the blocks' activations. A silent no-op would leave the counts equal.
    assert counts[1] < counts[2] < counts[0], counts
    per_block = (counts[0] - counts[1]) / 4  # what one block keeps beyond its input
    assert per_block >= 10, counts
    assert counts[2] == counts[1] + 2 * per_block, counts


def test_evaluation_and_generation_do_not_recompute():
    model = tiny_model()
    model.recompute_blocks(1)
    with torch.no_grad():
        plain = copy.deepcopy(model)
        plain.recompute_blocks(0)
        idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
        model.eval(), plain.eval()
        assert torch.equal(model(idx)[0], plain(idx)[0])
        assert torch.equal(model.generate(idx, 4, temperature=0), plain.generate(idx, 4, temperature=0))


@pytest.mark.parametrize("setting,every", [("none", 0), ("full", 1), ("selective", 2)])
def test_the_config_key_names_the_blocks_recomputed(setting, every, tmp_path):
    cfg = parse_args(base_args(tmp_path, tmp_path / "out", activation_checkpointing=setting))
    assert cfg.runtime.recompute_every() == every
    cfg = parse_args(base_args(tmp_path, tmp_path / "out", activation_checkpointing="selective",
                               activation_checkpointing_every=3))
    assert cfg.runtime.recompute_every() == 3 and cfg.runtime.activation_checkpointing_label() == "selective (1 block in 3)"


@pytest.mark.parametrize("key,value", [("activation_checkpointing", "some"), ("activation_checkpointing", "true"),
                                       ("activation_checkpointing_every", "0"),
                                       ("activation_checkpointing_every", "two")])
def test_a_bad_value_is_one_error_naming_the_key(key, value, tmp_path):
    with pytest.raises(ConfigError) as error:
        parse_args(base_args(tmp_path, tmp_path / "out", **{key: value}))
    message = str(error.value)
    assert message.startswith(f"{key}: ") and "\n" not in message, message


@pytest.mark.parametrize("setting,recomputed", [("none", []), ("full", [0, 1]), ("selective", [0])])
def test_the_training_model_recomputes_the_blocks_the_config_names(shards, tmp_path, setting, recomputed):
    from runtime.runtime import resolve_runtime

    cfg, ctx, run = build_tiny_run(shards, tmp_path / "out", activation_checkpointing=setting)
    runtime = resolve_runtime(cfg.runtime.device, cfg.runtime.dtype, cfg.runtime.compile, cfg.runtime.loss_chunk_size,
                              recompute_every=cfg.runtime.recompute_every())
    assert run.model.transformer.h[0].recompute is False  # built plain: only the training forward recomputes
    type(run.strategy)(run.strategy.env, runtime).training_model(run.model)
    assert [i for i, block in enumerate(run.model.transformer.h) if block.recompute] == recomputed


def assert_same_run(a, b) -> None:
    """Bitwise: the same losses (float equality) and the same final weights."""
    assert train_losses(a) == train_losses(b)
    wa, wb = load_weights(a, 6), load_weights(b, 6)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.slow  # starts the trainer
def test_training_with_full_recomputation_is_bitwise_the_plain_run(shards, tmp_path):
    run_trainer(base_args(shards, tmp_path / "none", **DROPOUT))
    proc = run_trainer(base_args(shards, tmp_path / "full", activation_checkpointing="full", **DROPOUT))
    assert "activation checkpointing full |" in proc.stdout
    assert_same_run(tmp_path / "full", tmp_path / "none")


@pytest.mark.slow  # two 2-rank launches per strategy
@pytest.mark.parametrize("strategy,setting", [("ddp", "full"), ("fsdp", "full"), ("fsdp_zero2", "selective")])
def test_two_ranks_with_recomputation_are_bitwise_the_plain_run(shards, tmp_path, strategy, setting):
    common = dict(strategy=strategy, **DROPOUT)
    run_trainer(base_args(shards, tmp_path / "none", **common), nproc=2)
    run_trainer(base_args(shards, tmp_path / setting, activation_checkpointing=setting, **common), nproc=2)
    assert_same_run(tmp_path / setting, tmp_path / "none")


# --- the recipes for the GPUs people own -----------------------------------------------------------

RECIPES = {  # recipe -> (the preset it changes, ranks of the shortened launch)
    "gpt2_124m_24gb.yaml": ("gpt2_124m.yaml", None),
    "gpt2_350m_24gb.yaml": ("gpt2_350m.yaml", None),
    "gpt2_1558m_8x24gb.yaml": ("gpt2_1558m.yaml", 2),
}
MEMORY_KEYS = {"out_dir", "micro_batch_size", "strategy", "loss_chunk_size", "activation_checkpointing",
               "activation_checkpointing_every"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_is_its_preset_with_only_memory_keys_changed(recipe):
    config = lambda name: parse_args(["--config", str(REPO / "configs" / name)]).to_dict()  # noqa: E731
    ours, preset = config(recipe), config(RECIPES[recipe][0])
    assert {key for key in ours if ours[key] != preset[key]} <= MEMORY_KEYS
    assert ours["micro_batch_size"] != preset["micro_batch_size"] or ours["strategy"] != preset["strategy"]
    text = (REPO / "configs" / recipe).read_text()
    assert "Expected memory" in text and "Smaller card" in text  # what it needs, and what to change


@pytest.mark.slow  # starts the trainer
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_launches(recipe, tmp_path):
    """The recipe's own file, shortened for the CPU: the tiny model and data, 2 steps of 2 micro-steps at
    the recipe's micro-batch, on 2 ranks where it is a multi-GPU recipe, float32; its strategy, activation
    checkpointing and loss settings as they are."""
    cfg = parse_args(["--config", str(REPO / "configs" / recipe)])
    nproc = RECIPES[recipe][1]
    shards = make_shards(tmp_path / "shards")
    short = base_args(shards, tmp_path / "out", total_batch_size=cfg.data.micro_batch_size * 32 * (nproc or 1) * 2,
                      micro_batch_size=cfg.data.micro_batch_size, max_steps=2, warmup_steps=1, eval_interval=0,
                      checkpoint_interval=0)
    proc = run_trainer(["--config", str(REPO / "configs" / recipe), *short], nproc=nproc)
    assert "grad_accum_steps 2 |" in proc.stdout
    if cfg.runtime.activation_checkpointing != "none":
        assert f"activation checkpointing {cfg.runtime.activation_checkpointing}" in proc.stdout
    assert sorted(train_losses(tmp_path / "out")) == [0, 1]
