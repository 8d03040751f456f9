"""Val bits per byte (evals/val_loss.py): the window's summed loss over the bytes of text its targets stand for.

In this process, on the tiny model; the same figure on 1 and 2 ranks is checked beside the val loss in
test_train_distributed.py (one default set) and test_mixture.py (named sets).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from conftest import build_tiny_run, make_shards
from launch.components import make_evaluation
from data.loader import ValLoader
from data.shards import shard_name, write_shard
from data.tokenizer import EOT_TOKEN, get_tokenizer, token_byte_lengths
from common.log_fields import val_set_names as set_names
from evals.val_loss import ValLoss


def test_token_bytes_add_up_to_the_utf8_length_of_the_text_and_eot_counts_none():
    tokenizer, lengths = get_tokenizer(), token_byte_lengths()
    text = "Grüße, naïve café — 東京 ✓ 🙂\n\tend"
    ids = tokenizer.encode_ordinary(text)
    assert sum(lengths[i] for i in ids) == len(text.encode("utf-8")) == 46  # 22 ASCII, 4 x 2, 4 x 3, 1 x 4
    assert lengths[EOT_TOKEN] == 0 and lengths[tokenizer.n_vocab:].sum() == 0


def test_a_windows_target_bytes_are_those_of_its_decoded_targets(tmp_path):
    """Two documents, each after <|endoftext|>, as prep writes them; rows of 8 targets, the last partial row left out."""
    tokenizer = get_tokenizer()
    docs = ["Über den Wolken muss die Freiheit wohl grenzenlos sein.", "naïve — 東京 ✓"]
    tokens = np.array([t for doc in docs for t in [EOT_TOKEN, *tokenizer.encode_ordinary(doc)]], dtype=np.uint16)
    write_shard(tmp_path / shard_name("text", "val", 0), tokens)
    loader = ValLoader(tmp_path, seq_len=8, val_tokens=16, batch_size=1)
    targets = tokens[1:17].tolist()  # rows 0 and 1: the 16 tokens after the first
    expected = len(tokenizer.decode_bytes([t for t in targets if t != EOT_TOKEN]))
    assert loader.target_bytes(token_byte_lengths()) == expected
    assert loader.target_bytes(token_byte_lengths(), rows_at_once=1) == expected  # read in pieces: the same


def test_val_bpb_is_the_windows_summed_loss_over_its_bytes_times_ln2_counted_once(tmp_path, monkeypatch):
    """A hand computation of the logged figures (float64 forward, F.cross_entropy per row) on a val window of
    8 rows; the window's bytes are counted once however often it is evaluated."""
    shards = make_shards(tmp_path / "shards")
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run", val_tokens=256, dtype="float64", eval_interval=1)
    counted = []
    count = ValLoader.target_bytes
    monkeypatch.setattr(ValLoader, "target_bytes", lambda self, *a, **k: counted.append(self) or count(self, *a, **k))
    logged = []
    ctx.logger.log = logged.append
    evaluation = make_evaluation(cfg, ctx, run.strategy, tokenizer=None)
    for _ in range(3):
        evaluation.run_due(run, last_step=False, agree_to_stop=lambda: False)
    assert len(counted) == 1 and len(logged) == 3
    record = logged[-1]
    assert set_names(record) == [] and sorted(record) == ["bpb", "kind", "loss", "step", "tokens"]

    val = np.load(sorted(shards.glob("*_val_*.npy"))[0]).astype(np.int64)[:8 * 32 + 1]  # 8 rows of 32 targets
    x, y = torch.from_numpy(val[:-1]).view(8, 32), torch.from_numpy(val[1:]).view(8, 32)
    with torch.no_grad():
        logits = run.model.lm_head(run.model.hidden_states(x))  # (8, 32, V)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    n_bytes = len(get_tokenizer().decode_bytes(y.flatten().tolist()))  # make_shards' ids are all < 512: text
    assert math.isclose(record["loss"], loss_sum / 256, rel_tol=1e-12)
    assert math.isclose(record["bpb"], loss_sum / (n_bytes * math.log(2)), rel_tol=1e-12)
    assert math.isclose(record["bpb"], record["loss"] * 256 / (n_bytes * math.log(2)), rel_tol=1e-12)
    (val,) = [e for e in evaluation.evaluators if isinstance(e, ValLoss)]
    assert val.describe(record) == f"val loss {record['loss']:.4f} ({record['bpb']:.4f} bpb)"


def test_named_sets_each_get_their_bpb_and_the_ema_its_own(tmp_path):
    edu, code = make_shards(tmp_path / "edu", seed=1), make_shards(tmp_path / "code", seed=2)
    cfg, ctx, run = build_tiny_run(edu, tmp_path / "run", val_sets=f"edu={edu},code={code}", ema_decay=0.9,
                                   ema_start=0.0, eval_interval=1)
    run.ema.update(run.model, step=0)  # an average of the weights, which then move away from it
    with torch.no_grad():  # scaled, not shifted: a constant added to c_fc's weights meets ln_2's zero-mean output
        run.model.transformer.h[0].mlp.c_fc.weight.mul_(2.0)  # and changes nothing, bitwise on some CPUs
    logged = []
    ctx.logger.log = logged.append
    make_evaluation(cfg, ctx, run.strategy, tokenizer=None).run_due(run, last_step=True, agree_to_stop=lambda: False)
    (record,) = logged
    assert set_names(record) == ["edu", "code"]
    assert record["bpb"] == record["bpb_edu"] != record["bpb_code"] and record["loss"] == record["edu"]
    assert {"ema_bpb", "ema_bpb_edu", "ema_bpb_code", "ema_edu", "ema_code"} <= record.keys()
    assert record["ema_edu"] != record["edu"]
    for name in ("edu", "code"):  # the ratio of bpb to loss is the window's tokens over its bytes: the same weights' or not
        assert math.isclose(record[f"bpb_{name}"] / record[name], record[f"ema_bpb_{name}"] / record[f"ema_{name}"],
                            rel_tol=1e-12)
