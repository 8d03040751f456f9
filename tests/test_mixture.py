"""Data mixtures and named val sets (data/mixture.py, evals/val_loss.py).

The loader: each step's composition is exact (the largest remainder of weight * rows), the
source of every row a pure function of (seed, step, row) on any world size, each source read
in its own order and epochs, wrapping when it runs out. The trainer: a mixture resumes on another
world size, logs tokens per source, and every val set is the same figure on 1 and 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from conftest import base_args, make_shards, run_trainer
from data.mixture import MixtureLoader, Source, parse_sources, parse_val_sets, step_composition
from data.shards import shard_name, write_shard
from training.observe.logger import read_log
from training.train.config import TrainConfig, parse_args

T = 8


def numbered_source(folder: Path, first_token: int, shard_sizes: list[int]) -> Path:
    """Train shards whose tokens count up from first_token, so a row's first token says where it came from."""
    folder.mkdir(parents=True)
    start = first_token
    write_shard(folder / shard_name("src", "val", 0), np.arange(first_token, first_token + 4 * T + 1, dtype=np.uint16))
    for index, size in enumerate(shard_sizes, start=1):
        write_shard(folder / shard_name("src", "train", index), np.arange(start, start + size, dtype=np.uint16))
        start += size
    return folder


@pytest.fixture
def two_sources(tmp_path) -> list[Source]:
    edu = numbered_source(tmp_path / "edu", 0, [8 * T + 1, 12 * T + 1])  # 20 rows in 2 shards
    code = numbered_source(tmp_path / "code", 30000, [7 * T + 1])  # 7 rows: it wraps often
    return parse_sources(f"{edu}:0.7,{code}:0.3")


def loader(sources, world_size=1, rank=0, micro=2, rows=10, **kw) -> MixtureLoader:
    return MixtureLoader(sources, T, micro, rows * T, rank, world_size, seed=5, **kw)


def read_step(sources, step: int, world_size: int, micro: int = 1) -> list[int]:
    """The first tokens of every row of a step, in the step's slot order, gathered over the ranks."""
    loaders = [loader(sources, world_size, r, micro) for r in range(world_size)]
    firsts = {}
    for r, ld in enumerate(loaders):
        for k in range(ld.grad_accum_steps):
            x, _ = ld.micro_batch(step, k)
            for i, row in enumerate(x[:, 0].tolist()):
                firsts[(k * world_size + r) * micro + i] = row
    return [firsts[j] for j in range(len(firsts))]


def test_the_composition_is_the_largest_remainder_of_the_weights():
    assert step_composition([0.7, 0.3], 512) == [358, 154]
    assert step_composition([1, 1, 1], 10) == [4, 3, 3]  # a tie goes to the earlier source
    assert step_composition([2.0, 1.0], 3) == [2, 1]


def test_every_step_reads_each_source_in_its_share_and_in_its_own_order_wrapping_when_it_runs_out(two_sources):
    ld = loader(two_sources)
    assert ld.counts == [7, 3]
    seen = {0: [], 1: []}
    for step in range(14):
        rows = read_step(two_sources, step, 1)
        edu = [r for r in rows if r < 30000]
        code = [r for r in rows if r >= 30000]
        assert (len(edu), len(code)) == (7, 3)  # exactly the step's composition, every step
        seen[0] += edu
        seen[1] += code
    # edu: 98 rows = 4 whole epochs of its 20 rows and 18 of the fifth; each epoch holds every row once
    edu_rows = {r * T for r in range(8)} | {8 * T + 1 + r * T for r in range(12)}
    for epoch in range(4):
        assert set(seen[0][20 * epoch: 20 * epoch + 20]) == edu_rows
    assert seen[0][:20] == sorted(edu_rows)  # epoch 0 in shard order
    code_rows = {30000 + r * T for r in range(7)}
    for epoch in range(6):  # 42 rows: 6 whole epochs of 7
        assert set(seen[1][7 * epoch: 7 * epoch + 7]) == code_rows


def test_the_source_of_each_row_is_a_function_of_the_step_alone_on_any_world_size(two_sources):
    for step in (0, 3, 11):
        one = read_step(two_sources, step, 1, micro=1)
        assert read_step(two_sources, step, 2, micro=1) == one  # the ranks' shares put together
        assert read_step(two_sources, step, 5, micro=2) == one
    fresh = loader(two_sources)
    assert torch.equal(fresh.micro_batch(7, 1)[0], loader(two_sources).micro_batch(7, 1)[0])
    other_seed = MixtureLoader(two_sources, T, 2, 10 * T, seed=6)
    assert [int(v) for v in other_seed.slots(3)[0]] != [int(v) for v in fresh.slots(3)[0]]  # the seed mixes


def test_shuffled_sources_read_every_row_once_per_epoch(two_sources):
    rows = [r for step in range(2) for r in read_step(two_sources, step, 1) if r < 30000]
    ld = loader(two_sources, shuffle=True)
    shuffled = []
    for step in range(4):
        for k in range(ld.grad_accum_steps):
            shuffled += [r for r in ld.micro_batch(step, k)[0][:, 0].tolist() if r < 30000]
    assert sorted(shuffled[:20]) == sorted(set(rows) | set(shuffled[:20])) and len(set(shuffled[:20])) == 20
    assert shuffled[:14] != rows


@pytest.mark.parametrize("value,message", [
    ("a:0.7,b", "data_dir: 'b' is not folder:weight"),
    ("a:x", "data_dir: the weight of a is 'x', not a number"),
    ("a:0.5,b:-1", "data_dir: the weight of b must be a positive number, got -1"),
    ("x/a:1,y/a:1", "data_dir: two sources are named 'a'"),
])
def test_a_bad_mixture_is_one_line_naming_data_dir(value, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(data_dir=value)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("value,message", [
    ("edu", "val_sets: 'edu' is not name=folder"),
    ("loss=data/a", "val_sets: the name 'loss' is taken by the val record's own fields"),
    ("bpb=data/a", "val_sets: the name 'bpb' is taken by the val record's own fields"),
    ("a=x,a=y", "val_sets: the name 'a' is used twice"),
])
def test_bad_val_sets_are_one_line_naming_the_key(value, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(val_sets=value)
    assert str(caught.value).startswith(message)


def test_yaml_mappings_are_the_command_lines_text(tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("data_dir: {data/edu: 0.7, data/code: 0.3}\nevaluation: {val_sets: {edu: data/edu, wiki: w.npy}}\n")
    cfg = parse_args(["--config", str(config)])
    assert cfg.data_dir == "data/edu:0.7,data/code:0.3" and cfg.val_sets == "edu=data/edu,wiki=w.npy"
    assert parse_args(["--data_dir", "data/edu:0.7,data/code:0.3"]).data_dir == cfg.data_dir
    assert parse_val_sets("", cfg.data_dir) == {"edu": "data/edu", "code": "data/code"}  # a mixture's default
    assert parse_val_sets("", "data/edu") == {"val": "data/edu"}  # one folder: today's single set
    config.write_text("data_dir: {data/edu: [1]}\n")
    with pytest.raises(ConfigError, match="^data_dir: expected a mapping of names to values"):
        parse_args(["--config", str(config)])


def test_a_weight_too_small_for_one_row_a_step_is_refused(two_sources):
    tiny = [two_sources[0], Source("code", two_sources[1].path, 0.001)]
    with pytest.raises(ConfigError, match="^data_dir: source code's weight 0.001 gives it none of the 10 rows"):
        loader(tiny)


# --- the trainer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return make_shards(root / "edu", seed=1), make_shards(root / "code", seed=2, train_sizes=(2100,), prefix="code")


@pytest.mark.slow
def test_a_mixture_trains_resumes_on_another_world_size_and_logs_each_source_and_val_set(folders, tmp_path):
    edu, code = folders
    mixture, mix = f"{edu}:0.75,{code}:0.25", dict(dtype="float64", eval_interval=3)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_trainer(base_args(mixture, straight, **mix), nproc=2)
    assert "mixture: edu 12 rows/step (75.0%" in proc.stdout and "code 4 rows/step (25.0%" in proc.stdout
    run_trainer(base_args(mixture, resumed, **mix, max_steps=3))  # one process to step 3
    run_trainer(base_args(mixture, resumed, **mix), nproc=2)  # then 2 ranks
    logs = {name: read_log(out / "log.jsonl") for name, out in (("straight", straight), ("resumed", resumed))}
    train = {name: {r["step"]: r for r in log if r["kind"] == "train"} for name, log in logs.items()}
    assert sorted(train["resumed"]) == list(range(6))
    for step, record in train["straight"].items():
        assert abs(record["loss"] - train["resumed"][step]["loss"]) <= 1e-12 * record["loss"], step
        # 16 rows a step: 12 edu, 4 code, of 32 tokens
        assert (record["tokens_edu"], record["tokens_code"]) == (12 * 32 * (step + 1), 4 * 32 * (step + 1))
    vals = {name: [r for r in log if r["kind"] == "val"] for name, log in logs.items()}
    assert [sorted(r) for r in vals["straight"]][0] == ["bpb", "bpb_code", "bpb_edu", "code", "edu", "kind", "loss",
                                                        "step", "tokens"]
    for a, b in zip(vals["straight"], vals["resumed"]):  # step 3 on 1 process and on 2 ranks: the same figures
        assert a["step"] == b["step"] and a["loss"] == a["edu"] and abs(a["code"] - b["code"]) <= 1e-12 * a["code"]
    run = (resumed / "run.json").read_text()
    assert "edu:0.75=" in run and "code:0.25=" in run  # the data fingerprint names every source


@pytest.mark.slow
def test_each_val_set_is_the_same_figure_on_one_and_two_ranks(folders, tmp_path):
    edu, code = folders
    sets = dict(val_sets=f"edu={edu},code={code / 'code_val_000000.npy'}", max_steps=2, eval_interval=1)
    figures = {}
    for nproc in (None, 2):
        out = tmp_path / f"n{nproc}"
        run_trainer(base_args(edu, out, **sets), nproc=nproc)
        figures[nproc] = [(r["edu"], r["code"], r["bpb_edu"], r["bpb_code"]) for r in read_log(out / "log.jsonl")
                          if r["kind"] == "val"]
    assert len(figures[None]) == 3 and figures[None][0] == figures[2][0]  # step 0: the same weights, bitwise
    assert all(edu != code and bpb_edu != bpb_code for edu, code, bpb_edu, bpb_code in figures[None])  # each set its own window
