"""The loader's row semantics (world-size independent data order) and the val window reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_shards
from data.loader import Prefetcher, RowStream, TrainLoader, ValLoader, validate_shards
from data.shards import DataError, find_shards, open_shard, shard_name, write_shard

T = 16


def expected_row(paths, global_row: int, seq_len: int = T) -> np.ndarray:
    """Reference: walk the shards, row j of a shard = tokens [j*T, j*T+T] (T+1 tokens)."""
    for p in paths:
        tokens = np.load(p)
        rows = (len(tokens) - 1) // seq_len
        if global_row < rows:
            return tokens[global_row * seq_len : global_row * seq_len + seq_len + 1].astype(np.int64)
        global_row -= rows
    raise IndexError


def gather_step(data_dir, step, world_size, B, total_batch_size=T * 24, seed=0):
    """All rows of one step as a (R, T+1) array, ordered by global row, over `world_size` loaders."""
    rows = {}
    for rank in range(world_size):
        loader = TrainLoader(data_dir, T, B, total_batch_size, rank, world_size, seed)
        for k in range(loader.grad_accum_steps):
            x, y = loader.micro_batch(step, k)
            assert x.shape == y.shape == (B, T)
            assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())  # targets are inputs shifted by one
            _, first = loader.first_row(step, k)
            assert first == (step % loader.steps_per_epoch) * loader.rows_per_step + (k * world_size + rank) * B
            for i in range(B):
                assert first + i not in rows, "a row was read twice in one step"
                rows[first + i] = np.concatenate([x[i].numpy(), y[i, -1:].numpy()])
    return np.stack([rows[r] for r in sorted(rows)])


@pytest.mark.parametrize("world_size,B", [(1, 24), (1, 3), (2, 4), (2, 12), (4, 2), (4, 6), (3, 8)])
def test_every_world_size_and_micro_batch_reads_the_same_rows_per_step(tmp_path, world_size, B):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500, 64))
    reference = [gather_step(data, step, 1, 24) for step in range(4)]
    for step in range(4):
        assert np.array_equal(gather_step(data, step, world_size, B), reference[step])


def test_rows_follow_the_shard_layout_and_skip_only_each_final_partial_row(tmp_path):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500, 64))
    paths = find_shards(data, "train")
    stream = RowStream(paths, T)
    assert stream.rows_per_shard == [(1000 - 1) // T, (777 - 1) // T, (1500 - 1) // T, (64 - 1) // T]
    x, y = stream.read(0, stream.num_rows)
    for g in range(stream.num_rows):
        row = expected_row(paths, g)
        assert np.array_equal(x[g], row[:-1]) and np.array_equal(y[g], row[1:])


def test_an_epoch_reads_no_row_twice_and_rows_never_straddle_shards(tmp_path):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500, 64))
    loader = TrainLoader(data, T, 4, T * 8, rank=0, world_size=1)
    seen = set()
    for step in range(loader.steps_per_epoch):
        for k in range(loader.grad_accum_steps):
            _, first = loader.first_row(step, k)
            batch = set(range(first, first + 4))
            assert not batch & seen
            seen |= batch
    assert len(seen) == loader.steps_per_epoch * loader.rows_per_step <= loader.stream.num_rows
    # a micro-batch crossing a shard boundary takes whole rows from each side
    boundary = loader.stream.rows_per_shard[0]
    x, _ = loader.stream.read(boundary - 2, 4)
    assert np.array_equal(x[1], expected_row(loader.paths, boundary - 1)[:-1])
    assert np.array_equal(x[2], np.load(loader.paths[1])[:T])


def test_later_epochs_shuffle_shards_with_the_seed_and_are_deterministic(tmp_path):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500, 640))
    a = TrainLoader(data, T, 4, T * 8, seed=7)
    b = TrainLoader(data, T, 4, T * 8, seed=7)
    epoch1 = a.steps_per_epoch
    assert np.array_equal(a.micro_batch(0, 0)[0], a.stream.read(0, 4)[0])  # epoch 0: shards in order
    orders = {tuple(str(p) for p in a.epoch_stream(e).paths) for e in range(1, 6)}
    assert len(orders) > 1  # the order changes between epochs
    for step in (epoch1, epoch1 + 3, 3 * epoch1 + 1):
        assert np.array_equal(a.micro_batch(step, 1)[0], b.micro_batch(step, 1)[0])


def test_shuffle_reads_every_row_once_per_epoch_in_a_seeded_order_the_same_for_any_world_size(tmp_path):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500, 640))
    one = TrainLoader(data, T, 8, T * 8, seed=7, shuffle=True)
    stream, steps = one.stream, one.steps_per_epoch
    whole = stream.read(0, stream.num_rows)[0]
    for epoch in (0, 1):
        read = np.concatenate([one.micro_batch(epoch * steps + s, 0)[0].numpy() for s in range(steps)])
        order = one.row_order(epoch)[: steps * one.rows_per_step]
        assert np.array_equal(read, whole[order])  # row j of the epoch is row order[j]
        assert len(set(order.tolist())) == len(order)  # no row twice
    assert not np.array_equal(one.row_order(0), one.row_order(1))
    assert not np.array_equal(one.row_order(0), np.arange(stream.num_rows))
    assert not np.array_equal(one.row_order(0), TrainLoader(data, T, 8, T * 8, seed=8, shuffle=True).row_order(0))
    # 2 ranks x 2 micro-steps of 2 rows read the same rows of a step as one process
    ranks = [TrainLoader(data, T, 2, T * 8, rank=r, world_size=2, seed=7, shuffle=True) for r in range(2)]
    for step in (0, 3, steps + 1):
        by_rank = [ranks[r].micro_batch(step, k)[0] for k in range(2) for r in range(2)]  # k-major, as first_row
        assert torch.equal(torch.cat(by_rank), one.micro_batch(step, 0)[0])


def test_doc_aligned_rows_start_at_documents_and_pass_over_the_rest_of_a_long_one(tmp_path):
    from data.tokenizer import EOT_TOKEN

    rng = np.random.default_rng(3)
    lengths = [5, 40, 9, 16, 3, 70, 12, 30, 8, 17, 25, 6] * 4  # with its EOT: shorter and longer than a row
    docs = [np.concatenate([[EOT_TOKEN], rng.integers(0, 500, n - 1)]).astype(np.uint16) for n in lengths]
    (tmp_path / "d").mkdir()
    for i, part in enumerate((docs[:20], docs[20:])):
        write_shard(tmp_path / "d" / shard_name("doc", "train", i), np.concatenate(part))
    loader = TrainLoader(tmp_path / "d", T, 2, T * 4, doc_aligned=True)
    stream = loader.stream
    for shard, starts in zip(stream.shards, stream.row_starts):
        doc_starts = set(np.flatnonzero(np.asarray(shard) == EOT_TOKEN).tolist())
        assert set(starts.tolist()) <= doc_starts  # every row begins at a document
        assert np.all(np.diff(starts) >= T)  # rows share at most their boundary token
        for a, b in zip(starts[:-1], starts[1:]):  # the next row: the first document after the row's end
            assert b == min(d for d in doc_starts if d >= a + T)
        assert starts[-1] + T + 1 <= len(shard)
    x, y = loader.micro_batch(0, 1)
    assert (x[:, 0] == EOT_TOKEN).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert 0.3 < stream.coverage < 1.0
    # the same rows on 2 ranks, and shuffled rows are whole document-aligned rows too
    ranks = [TrainLoader(tmp_path / "d", T, 1, T * 4, rank=r, world_size=2, doc_aligned=True) for r in range(2)]
    both = torch.cat([ranks[r].micro_batch(1, k)[0] for k in range(2) for r in range(2)])
    assert torch.equal(both, torch.cat([loader.micro_batch(1, k)[0] for k in range(2)]))
    shuffled = TrainLoader(tmp_path / "d", T, 2, T * 4, seed=1, shuffle=True, doc_aligned=True)
    assert (shuffled.micro_batch(0, 0)[0][:, 0] == EOT_TOKEN).all()


def test_too_little_data_for_one_step_is_a_clear_error(tmp_path):
    data = make_shards(tmp_path, train_sizes=(100,))
    with pytest.raises(DataError, match="fewer than one step"):
        TrainLoader(data, T, 4, T * 64)


def test_val_loader_covers_the_same_fixed_rows_for_any_world_size(tmp_path):
    data = make_shards(tmp_path, val_size=5000)
    for world_size in (1, 2, 3, 4):
        batches = {}
        for rank in range(world_size):
            val = ValLoader(data, T, val_tokens=T * 37, batch_size=5, rank=rank, world_size=world_size)
            for index, x, y in val.batches():
                assert x.shape[0] <= 5 and index not in batches
                batches[index] = np.concatenate([x.numpy(), y[:, -1:].numpy()], axis=1)
        rows = [row for index in sorted(batches) for row in batches[index]]
        assert sorted(batches) == list(range(8)) and len(rows) == 37
        assert np.array_equal(np.stack(rows), np.stack([expected_row(find_shards(data, "val"), g) for g in range(37)]))


def test_val_window_larger_than_val_split_is_rejected(tmp_path):
    data = make_shards(tmp_path, val_size=100)
    with pytest.raises(DataError, match="val_tokens"):
        ValLoader(data, T, val_tokens=T * 100, batch_size=4)


def test_shard_validation_names_the_bad_file(tmp_path):
    data = make_shards(tmp_path)
    bad = data / shard_name("tiny", "train", 9)
    write_shard(bad, np.array([1, 2, 60000, 3], dtype=np.uint16))
    paths = find_shards(data, "train")
    with pytest.raises(DataError) as raised:
        validate_shards(paths, 50304, rank=0, world_size=1)
    assert str(raised.value) == f"{bad}: token id 60000 at position 2 is out of range for vocab_size 50304"
    # the shard is in rank 1's share of a 2-rank world ([1::2] of 4 shards), not rank 0's
    validate_shards(paths, 50304, rank=0, world_size=2)
    np.save(data / "wrong_train_000010.npy", np.zeros(10, dtype=np.int32))
    with pytest.raises(DataError, match="wrong_train_000010.npy: token shards must be uint16"):
        open_shard(data / "wrong_train_000010.npy")
    (data / "junk_train_000011.npy").write_bytes(b"not numpy at all")
    with pytest.raises(DataError, match="junk_train_000011.npy: not a readable"):
        open_shard(data / "junk_train_000011.npy")
    np.save(data / "twod_train_000012.npy", np.zeros((3, 3), dtype=np.uint16))
    with pytest.raises(DataError, match="must be 1-D"):
        open_shard(data / "twod_train_000012.npy")


def test_missing_data_dir_and_missing_split_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        find_shards(tmp_path / "nope", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no val shards \(\*_val_\*.npy\)"):
        find_shards(tmp_path / "empty", "val")


def test_prefetcher_yields_exactly_the_loader_batches_in_order(tmp_path):
    data = make_shards(tmp_path, train_sizes=(1000, 777, 1500))
    loader = TrainLoader(data, T, 2, T * 8, rank=1, world_size=2)
    prefetch = Prefetcher(loader, start_step=3, end_step=7, device=torch.device("cpu"), depth=2)
    try:
        for step in range(3, 7):
            for k in range(loader.grad_accum_steps):
                x, y = prefetch.get(step, k)
                ex, ey = loader.micro_batch(step, k)
                assert torch.equal(x, ex) and torch.equal(y, ey)
        with pytest.raises(RuntimeError, match="out of order"):
            Prefetcher(loader, 0, 2, torch.device("cpu")).get(1, 0)
    finally:
        prefetch.close()


def test_prefetcher_never_waits_forever(tmp_path):
    loader = TrainLoader(make_shards(tmp_path), T, 4, T * 8)
    done = Prefetcher(loader, start_step=2, end_step=2, device=torch.device("cpu"))  # nothing to read
    with pytest.raises(RuntimeError, match="the prefetcher's steps are done"):
        done.get(2, 0)
    done.close()

    def broken(step, micro_step):
        raise DataError("shard vanished")

    loader.micro_batch = broken
    failing = Prefetcher(loader, start_step=0, end_step=3, device=torch.device("cpu"))
    with pytest.raises(DataError, match="shard vanished"):
        failing.get(0, 0)
    with pytest.raises(RuntimeError, match="prefetch thread ended"):  # and it stays an error, not a wait
        failing.get(0, 1)
    failing.close()
