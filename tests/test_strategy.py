"""A strategy is one Strategy subclass in STRATEGIES, described in STRATEGY_INFO: the config, the loaders and the
evaluations take it from there."""

from __future__ import annotations

import ast

import pytest

from conftest import GPT2_VOCAB, REPO, build_tiny_run
from data.tokenizer import get_tokenizer
from common.errors import ConfigError
from test_hellaswag import write_fixture
from test_layout import project_modules
from launch.config import TrainConfig
from runtime.settings import STRATEGY_INFO, RuntimeSettings, StrategyInfo, strategies_help
from training.distributed.strategies import DDP, STRATEGIES
from launch.components import make_evaluation


class SecondReplica(DDP):
    """A strategy whose data-parallel view differs from its process's (as tensor parallel's would):
    this one process is replica 1 of 2. Its description differs from DDP's too."""

    name = "second_replica"

    @property
    def dp_rank(self) -> int:
        return 1

    @property
    def dp_size(self) -> int:
        return 2


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(STRATEGIES, SecondReplica.name, SecondReplica)
    monkeypatch.setitem(STRATEGY_INFO, SecondReplica.name, StrategyInfo("a test strategy: replica 1 of 2", "sharded"))


def test_a_registered_strategy_is_accepted_by_the_config_from_its_description(registered, tmp_path):
    cfg = TrainConfig(strategy="second_replica", checkpoint_dir=str(tmp_path / "checkpoints"))
    assert cfg.resolved_checkpoint_format() == "sharded"  # its default_checkpoint_format, not a name test
    assert "second_replica (a test strategy: replica 1 of 2)" in strategies_help()
    with pytest.raises(ConfigError, match="choose ddp, fsdp, fsdp_zero2, second_replica"):
        TrainConfig(strategy="nope")


def test_its_dp_view_is_what_the_loaders_and_evaluations_get(registered, shards, tmp_path):
    """Rank 0 of one process reads replica 1's share of every batch: the loaders, grad_accum_steps and
    HellaSwag's examples follow strategy.dp_rank / dp_size, not env.rank / world_size."""
    hellaswag = dict(hellaswag_interval=1, hellaswag_path=str(write_fixture(tmp_path / "hs.jsonl")), hellaswag_limit=0,
                     eval_interval=1, sample_interval=0, vocab_size=GPT2_VOCAB)  # HellaSwag reads GPT-2 token ids
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "out", strategy="second_replica", **hellaswag)
    env = ctx.env
    assert (env.rank, env.world_size) == (0, 1)  # one process, but the data sees replica 1 of 2
    assert isinstance(run.strategy, SecondReplica)
    for loader in (run.train_loader, run.val_loader):
        assert (loader.rank, loader.world_size) == (1, 2)
    assert run.grad_accum_steps == cfg.data.grad_accum_steps(2) == 2  # 512 tokens / (4 rows x 32 x 2 replicas)
    assert run.strategy.mesh is None

    evaluation = make_evaluation(cfg, ctx, run.strategy, get_tokenizer())
    (evaluator,) = [e for e in evaluation.evaluators if e.kind == "hellaswag"]
    scored = sorted(i for batch in evaluator.batches(cfg.model.block_size) for i in batch.indices)
    assert scored == [1, 3, 5, 7, 9, 11]  # the odd examples of 13: replica 1's share
    assert evaluator.batches_per_rank == 1  # replica 0's 7 examples, in batches of 16


def test_the_strategy_key_lists_every_registered_strategy():
    """The configuration's descriptions (torch-free) name the strategies' classes, one each."""
    assert list(STRATEGY_INFO) == list(STRATEGIES)
    assert all(name == cls.name and STRATEGY_INFO[name].help for name, cls in STRATEGIES.items())
    help_text = RuntimeSettings.__dataclass_fields__["strategy"].metadata["help"]
    assert help_text == f"data parallelism: {strategies_help()}"
    assert {name: info.default_checkpoint_format for name, info in STRATEGY_INFO.items()} == \
        {"ddp": "file", "fsdp": "sharded", "fsdp_zero2": "sharded"}


def test_no_code_outside_strategies_py_compares_strategy_names():
    """Strategy differences are class attributes: `strategy == "ddp"` elsewhere is what a new strategy would miss."""
    found = []
    for module, path in project_modules().items():
        if path == REPO / "training" / "distributed" / "strategies.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [c.value for operand in (node.left, *node.comparators) for c in ast.walk(operand)
                         if isinstance(c, ast.Constant) and c.value in STRATEGIES]
                if names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} compares with {names}")
    assert not found, "\n".join(found)
