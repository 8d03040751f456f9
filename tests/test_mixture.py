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
from common.log_fields import RECORD_FIELDS, TRAIN_METRICS
from conftest import base_args, make_shards, run_trainer
from data.mixture import MixtureLoader, step_composition
from data.settings import Source, parse_sources, parse_val_sets
from data.shards import shard_name, write_shard
from runtime.logger import read_log
from launch.config import TrainConfig, parse_args
import training.run.step_records  # noqa: F401 - declares the train record's fields (TRAIN_METRICS), the step's too

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
    ("loss=data/a", "val_sets: the name 'loss' cannot name a val set: 'loss' is a field of the val record itself"),
    ("bpb=data/a", "val_sets: the name 'bpb' cannot name a val set: 'bpb' is a field of the val record itself"),
    ("bpb_edu=data/a", "val_sets: the name 'bpb_edu' cannot name a val set: 'bpb_edu' starts with 'bpb_', the prefix "
                       "of each set's bits per byte"),
    ("a=x,a=y", "val_sets: the name 'a' is used twice"),
])
def test_bad_val_sets_are_one_line_naming_the_key(value, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(val_sets=value)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("data_dir,val_sets,message", [
    # a mixture's val sets are named by the source folders by default: the val record's own fields
    ("web/tokens:0.5,web/edu:0.5", "", "data_dir: source web/tokens names its val set 'tokens' by default, and "
                                       "'tokens' is a field of the val record itself"),
    ("runs/step:0.5,web/edu:0.5", "", "data_dir: source runs/step names its val set 'step' by default, and 'step' "
                                      "is a field of the val record itself"),
    # ema_<set> is set <set>'s EMA figure
    ("a/ema_edu:1,b/edu:1", "", "data_dir: source a/ema_edu names its val set 'ema_edu' by default, and 'ema_edu' "
                                "starts with 'ema_'"),
    ("data/edu", "edu=x,ema_edu=y", "val_sets: the name 'ema_edu' cannot name a val set: 'ema_edu' starts with "
                                    "'ema_'"),
    ("data/edu", "tokens=x", "val_sets: the name 'tokens' cannot name a val set: 'tokens' is a field of the val "
                             "record itself"),
    # a source's tokens_<name> in the train record, whatever names the val sets
    ("a/per_sec:1,b/edu:1", "edu=b/edu,web=a/per_sec", "data_dir: source a/per_sec is named 'per_sec' (its folder's "
                                                       "last part), and its tokens field 'tokens_per_sec' is a field "
                                                       "of the train record itself"),
])
def test_a_name_that_would_make_another_field_of_its_record_is_refused_naming_its_key(data_dir, val_sets, message):
    """Val set names (explicit, or a mixture's folder names) and source names become log fields
    (common/log_fields.py): one that is a field already, or that another figure's field is made as, is refused."""
    with pytest.raises(ConfigError) as caught:
        TrainConfig(data_dir=data_dir, val_sets=val_sets)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_the_trainer_refuses_a_source_named_like_a_field_of_the_train_record(tmp_path):
    """A source's tokens_<name> is checked against every field of the train record, each declared beside the code
    that writes it: in the trainer, once its modules are imported (the check before them knows none), before any
    data is read."""
    for name in ("per_sec", "edu"):
        make_shards(tmp_path / name)
    mixture = f"{tmp_path / 'per_sec'}:1,{tmp_path / 'edu'}:1"
    proc = run_trainer(base_args(mixture, tmp_path / "out"), check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: data_dir: source {tmp_path / 'per_sec'} is named "
                                                           f"'per_sec' (its folder's last part), and its tokens field "
                                                           f"'tokens_per_sec' is a field of the train record itself")


def test_val_sets_name_the_sets_of_a_mixture_whose_folders_are_named_like_fields():
    cfg = TrainConfig(data_dir="web/tokens:0.5,web/edu:0.5", val_sets="web=web/tokens,edu=web/edu")
    assert parse_val_sets(cfg.evaluation.val_sets, cfg.data.data_dir) == {"web": "web/tokens", "edu": "web/edu"}


def test_yaml_mappings_are_the_command_lines_text(tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("data_dir: {data/edu: 0.7, data/code: 0.3}\nevaluation: {val_sets: {edu: data/edu, wiki: w.npy}}\n")
    cfg = parse_args(["--config", str(config)])
    assert cfg.data.data_dir == "data/edu:0.7,data/code:0.3" and cfg.evaluation.val_sets == "edu=data/edu,wiki=w.npy"
    assert parse_args(["--data_dir", "data/edu:0.7,data/code:0.3"]).data.data_dir == cfg.data.data_dir
    assert parse_val_sets("", cfg.data.data_dir) == {"edu": "data/edu", "code": "data/code"}  # a mixture's default
    assert parse_val_sets("", "data/edu") == {"val": "data/edu"}  # one folder: today's single set
    config.write_text("data_dir: {data/edu: [1]}\n")
    with pytest.raises(ConfigError, match="^data_dir: expected a mapping of names to values"):
        parse_args(["--config", str(config)])


def test_weights_whose_sum_overflows_are_one_line_naming_data_dir():
    with pytest.raises(ConfigError) as caught:
        TrainConfig(data_dir="a:1e308,b:1e308")
    assert str(caught.value) == ("data_dir: the weights (1e+308, 1e+308) sum to more than a float holds; they are "
                                 "relative: give them a usual size (0.7,0.3 or 7,3)")


def test_a_source_with_fewer_rows_than_its_share_of_one_step_is_refused_as_one_folder_is(two_sources, tmp_path):
    from common.errors import DataError

    small = numbered_source(tmp_path / "small", 40000, [2 * T + 1])  # 2 rows; its share of a 10-row step is 5
    with pytest.raises(DataError) as caught:
        loader(parse_sources(f"{two_sources[0].path}:0.5,{small}:0.5"))
    assert str(caught.value) == (f"data_dir {small}: its train shards hold 2 rows of {T + 1} tokens, fewer than its "
                                 f"share of one step (5 of 10 rows): every step would read some rows twice; lower "
                                 f"its weight or total_batch_size, or add data")
    assert loader(parse_sources(f"{two_sources[0].path}:0.8,{small}:0.2")).counts == [8, 2]  # 2 rows: enough


@pytest.mark.parametrize("missing", ["folder", "file", "val split"])
def test_a_missing_val_set_is_an_error_naming_val_sets(two_sources, tmp_path, missing):
    from common.errors import DataError
    from conftest import build_tiny_run, make_shards

    data = make_shards(tmp_path / "data")
    where = {"folder": tmp_path / "nope", "file": tmp_path / "wiki_val_000000.npy", "val split": two_sources[0].path}
    if missing == "val split":  # a folder without val shards
        for shard in Path(where[missing]).glob("*_val_*.npy"):
            shard.unlink()
    with pytest.raises(DataError) as caught:
        build_tiny_run(data, tmp_path / "out", val_sets=f"main={data},wiki={where[missing]}")
    assert str(caught.value).startswith({"folder": f"val_sets {where['folder']}: no such folder or val shard file",
                                         "file": f"val_sets {where['file']}: no such folder or val shard file",
                                         "val split": f"val_sets {where['val split']}: no val shards"}[missing])


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
        # what names are checked by: the record's own fields and the metrics the step declares (none tokens_*)
        assert record.keys() - {"tokens_edu", "tokens_code"} <= {*RECORD_FIELDS, *TRAIN_METRICS}
    vals = {name: [r for r in log if r["kind"] == "val"] for name, log in logs.items()}
    assert [sorted(r) for r in vals["straight"]][0] == ["bpb", "bpb_code", "bpb_edu", "code", "edu", "kind", "loss",
                                                        "step", "time", "tokens"]
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


@pytest.mark.slow
def test_a_resume_with_other_weights_goes_on_from_the_rows_each_source_had_read(folders, tmp_path):
    """Where each source stands is checkpointed state: with other weights, each source reads on from the rows it
    had read (none skipped, none twice), its tokens_<source> counter counts on, and the warning says the
    composition changed (not the shards). A checkpoint without that state (older code) gets it from its config."""
    import shutil

    from conftest import build_tiny_run

    edu, code = folders
    out, old = tmp_path / "run", tmp_path / "older"
    run_trainer(base_args(f"{edu}:0.5,{code}:0.5", out, max_steps=3))  # 8 + 8 of a step's 16 rows; checkpoint 3
    shutil.copytree(out, old)
    state = torch.load(old / "checkpoints" / "step_00000003.pt", weights_only=True)
    assert state.pop("mixture")["sources"]["code"] == {"rows_read": 24, "tokens": 24 * 32, "rows_per_step": 8}
    torch.save(state, old / "checkpoints" / "step_00000003.pt")
    new = f"{edu}:0.75,{code}:0.25"  # 12 + 4
    for folder in (out, old):
        *_, run = build_tiny_run(new, folder)  # resumes step 3, as the launch below does
        source, within = run.train_loader.slots(3)
        assert sorted(within[source == 0]) == list(range(24, 36)), folder  # edu's rows 24-35
        assert sorted(within[source == 1]) == list(range(24, 28)), folder  # code's rows 24-27
    proc = run_trainer(base_args(new, out))
    (warning,) = [line for line in proc.stderr.splitlines() if "composition changed" in line]
    assert "rows per step edu 8 -> 12, code 8 -> 4 (of 16)" in warning and "edu at row 24, code at row 24" in warning
    assert "shards" not in proc.stderr
    train = {r["step"]: r for r in read_log(out / "log.jsonl") if r["kind"] == "train"}
    assert [train[s]["tokens_edu"] // 32 for s in range(6)] == [8, 16, 24, 36, 48, 60]
    assert [train[s]["tokens_code"] // 32 for s in range(6)] == [8, 16, 24, 28, 32, 36]
