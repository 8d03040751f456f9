"""HellaSwag eval: scoring against a plain reference, batching, truncation, files, download, ranks.

Never touches the network: examples are generated here in the official jsonl format,
"downloads" read file:// URLs, and offline runs point at a closed port on 127.0.0.1 or at a
patched urlopen. Multi-process runs go through torchrun on gloo.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from conftest import REPO
from slowness import guard
from forked_ranks import launch
from data.tokenizer import EOT_TOKEN, get_tokenizer
from common.errors import DataError
from hellaswag_scores import per_example_scores
from model import GPT, GPTConfig
from runtime.process_group import DistEnv
from evals.hellaswag import (
    VAL_FILENAME, HellaSwagDataError, HellaSwag, collate, default_cache_dir, download_val, fetch_val,
    read_examples, render_rows,
)

BLOCK_SIZE = 64
TINY = dict(block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=64)
UNREACHABLE_URL = "http://127.0.0.1:9/hellaswag_val.jsonl"  # the discard port: refused at once
WORDS = ("the man woman dog ball kitchen knife then slowly quickly picks up puts down walks across "
         "room camera shows a of and is are to in on with, while. again! her his").split()
SINGLE = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def write_fixture(path: Path, n: int = 13, seed: int = 0) -> Path:
    """n examples in the official val format, contexts of 2 to 80 words (some longer than 64 tokens)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            ctx_a, ctx_b = sentence(rng, rng.randint(1, 70)), sentence(rng, rng.randint(1, 10))
            record = {
                "ind": 1000 + i, "activity_label": "Cooking", "ctx_a": ctx_a, "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain",
                "source_id": f"activitynet~v_{i}", "label": rng.randrange(4),
                "endings": [sentence(rng, rng.randint(1, 15)) for _ in range(4)],
            }
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture
def fixture_file(tmp_path) -> Path:
    return write_fixture(tmp_path / "val.jsonl")


def tiny_model() -> GPT:
    torch.manual_seed(0)  # the torchrun script below builds the same weights the same way
    return GPT(GPTConfig(**TINY)).eval()


@torch.no_grad()
def reference_losses(model: GPT, path: Path) -> list[list[float]]:
    """Mean ending loss per example and ending: each row alone, unpadded, through model.forward."""
    enc = get_tokenizer()
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        ctx = enc.encode(record["ctx"])
        losses = []
        for ending in record["endings"]:
            end = enc.encode(" " + ending)
            tokens = (ctx + end)[-(BLOCK_SIZE + 1):]  # left-truncated; endings here are short
            logits, _ = model(torch.tensor([tokens[:-1]]))  # (1, T, V)
            losses.append(F.cross_entropy(logits[0, -len(end):], torch.tensor(end)).item())
        out.append(losses)
    return out


def test_scores_match_a_plain_reference_for_any_batch_size(fixture_file):
    model = tiny_model()
    reference = reference_losses(model, fixture_file)
    labels = [json.loads(line)["label"] for line in fixture_file.read_text().splitlines()]
    enc = get_tokenizer()
    lengths = [len(enc.encode(json.loads(line)["ctx"])) for line in fixture_file.read_text().splitlines()]
    assert max(lengths) > BLOCK_SIZE  # the fixture exercises left truncation

    results = {}
    for batch_examples in (1, 5):
        evaluator = HellaSwag(str(fixture_file), 0, SINGLE, enc, batch_examples=batch_examples)
        scores = per_example_scores(evaluator, model)
        assert [s.index for s in scores] == list(range(13))
        for score, ref in zip(scores, reference):
            assert score.mean_losses == pytest.approx(ref, rel=1e-5)
        predictions = [min(range(4), key=ref.__getitem__) for ref in reference]
        assert [s.pred_norm for s in scores] == predictions
        assert [s.label for s in scores] == labels
        results[batch_examples] = (evaluator.accuracy(model), [s.pred_norm for s in scores], [s.pred for s in scores])

    expected_norm = sum(p == y for p, y in zip(predictions, labels)) / 13
    assert results[1] == results[5]
    result, _, preds_sum = results[1]
    assert result == {"acc_norm": expected_norm, "acc": sum(p == y for p, y in zip(preds_sum, labels)) / 13, "n": 13}


def test_summed_loss_is_mean_times_ending_length(fixture_file):
    enc = get_tokenizer()
    records = [json.loads(line) for line in fixture_file.read_text().splitlines()]
    for score in per_example_scores(HellaSwag(str(fixture_file), 0, SINGLE, enc, batch_examples=4), tiny_model()):
        lengths = [len(enc.encode(" " + e)) for e in records[score.index]["endings"]]
        assert score.sum_losses == pytest.approx([m * n for m, n in zip(score.mean_losses, lengths)], rel=1e-5)


def test_left_truncation_keeps_the_ending_whole():
    ctx, endings = list(range(100, 140)), [[1, 2, 3], [4], list(range(10, 20)), [5, 6]]
    rows = render_rows(ctx, endings, block_size=16)
    for (tokens, n_end), ending in zip(rows, endings):
        assert len(tokens) == 17  # the model reads 16 of them and predicts the last 16
        assert n_end == len(ending) and tokens[-n_end:] == ending
        assert tokens[:-n_end] == ctx[-(17 - n_end):]  # the latest context tokens
    # short rows are left alone; an empty context is replaced by <|endoftext|>
    assert render_rows([7, 8], [[9]], block_size=16) == [([7, 8, 9], 1)]
    assert render_rows([], [[9, 10]], block_size=16) == [([EOT_TOKEN, 9, 10], 2)]
    # an ending longer than the model's context keeps its head after one context token
    assert render_rows([7, 8], [list(range(30))], block_size=16) == [([8, *range(16)], 16)]


def test_collate_pads_to_a_multiple_and_marks_the_ending_tokens():
    from evals.hellaswag import EncodedExample

    examples = [EncodedExample(index=i, label=i % 4, ctx_ids=list(range(1, 5 + 20 * i)),
                               endings_ids=([901], [902, 903], [904, 905, 906], [907])) for i in range(2)]
    batch = collate(examples, block_size=64, pad_multiple=32)
    assert batch.inputs.shape == (8, 32)  # longest row: 24 context + 3 ending tokens = 26 inputs -> 32
    assert collate(examples, block_size=24, pad_multiple=32).inputs.shape == (8, 24)  # capped at block_size
    positions, targets = [], []
    for r, (tokens, n_end) in enumerate(row for ex in examples for row in render_rows(ex.ctx_ids, ex.endings_ids, 64)):
        n_in = len(tokens) - 1
        assert batch.inputs[r, :n_in].tolist() == tokens[:-1]
        assert (batch.inputs[r, n_in:] == EOT_TOKEN).all()  # right padding
        positions += [r * 32 + c for c in range(n_in - n_end, n_in)]  # each predicts tokens[c + 1]
        targets += [tokens[c + 1] for c in range(n_in - n_end, n_in)]
    assert batch.positions.tolist() == positions and batch.targets.tolist() == targets
    assert sorted(targets) == sorted([901, 902, 903, 904, 905, 906, 907] * 2)
    assert batch.ending_lengths.tolist() == [1, 2, 3, 1] * 2 and batch.max_ending == 3
    assert batch.labels.tolist() == [0, 1] and batch.indices == [0, 1]

def test_limit_and_train_mode_are_respected(fixture_file):
    model = tiny_model()
    full = per_example_scores(HellaSwag(str(fixture_file), 0, SINGLE, get_tokenizer()), model)
    model.train()
    evaluator = HellaSwag(str(fixture_file), 5, SINGLE, get_tokenizer())
    result = evaluator.accuracy(model)
    assert model.training  # left as it came
    assert result["n"] == 5
    assert result["acc_norm"] == sum(s.pred_norm == s.label for s in full[:5]) / 5  # scored in eval mode


def test_runs_under_bf16_autocast(fixture_file):
    model = tiny_model()
    evaluator = HellaSwag(str(fixture_file), 0, SINGLE, get_tokenizer(), batch_examples=8)
    exact = per_example_scores(evaluator, model)
    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    approx = per_example_scores(evaluator, model, autocast)
    for a, b in zip(approx, exact):
        assert a.mean_losses == pytest.approx(b.mean_losses, rel=2e-2)
    assert evaluator.accuracy(model, autocast)["n"] == 13

@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', "'endings' must be a list of 4 strings"),
    ('{"ctx": "a", "endings": ["b", "c", "d", 5], "label": 0}', "'endings' must be a list of 4 strings"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', "'label' must be an integer in 0..3"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": "1"}', "'label' must be an integer in 0..3"),
    ('{"endings": ["b", "c", "d", "e"], "label": 1}', "'ctx' must be a string"),
])
def test_malformed_file_is_an_error_naming_the_file_and_line(tmp_path, fixture_file, line, problem):
    bad = tmp_path / "bad.jsonl"
    lines = fixture_file.read_text().splitlines()
    bad.write_text("\n".join(lines[:3] + [line] + lines[3:]) + "\n")
    with pytest.raises(HellaSwagDataError, match=re.escape(f"{bad}: line 4: {problem}")) as info:
        HellaSwag(str(bad), 0, SINGLE, get_tokenizer())
    assert "\n" not in str(info.value)
    assert len(read_examples(bad, limit=3)) == 3  # a limit stops before the bad line


def test_missing_or_empty_local_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(HellaSwagDataError, match=re.escape(f"{tmp_path / 'nope.jsonl'}: No such file")):
        HellaSwag(str(tmp_path / "nope.jsonl"), 0, SINGLE, get_tokenizer())
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(HellaSwagDataError, match=re.escape(f"{tmp_path / 'empty.jsonl'}: no examples")):
        read_examples(tmp_path / "empty.jsonl")


def test_download_is_validated_atomic_and_cached(tmp_path, fixture_file, monkeypatch):
    monkeypatch.setenv("GPT2_REPRO_CACHE", str(tmp_path / "root"))
    assert default_cache_dir() == tmp_path / "root" / "hellaswag"
    cache = default_cache_dir()
    # a garbled download (an HTML error page) leaves nothing behind, not even a temp file
    garbled = tmp_path / "page.html"
    garbled.write_text("<html>rate limited</html>\n")
    with pytest.raises(HellaSwagDataError, match="page.html \\(downloaded\\): line 1: not valid JSON"):
        fetch_val(url=garbled.as_uri())
    assert list(cache.iterdir()) == []
    # a good one lands whole, and later calls use it without any network
    assert download_val(cache / VAL_FILENAME, fixture_file.as_uri()) == 13
    assert fetch_val(url=UNREACHABLE_URL, timeout=1) == cache / VAL_FILENAME
    assert sorted(p.name for p in cache.iterdir()) == [VAL_FILENAME]
    assert (cache / VAL_FILENAME).read_bytes() == fixture_file.read_bytes()
    evaluator = HellaSwag("", 0, SINGLE, get_tokenizer(), url=UNREACHABLE_URL, timeout=1)
    assert evaluator.available and evaluator.source == cache / VAL_FILENAME and evaluator.num_examples == 13


def test_offline_without_cache_skips_with_one_warning(tmp_path, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    evaluator = HellaSwag("", 0, SINGLE, get_tokenizer(), cache_dir=tmp_path / "empty")
    assert not evaluator.available
    assert evaluator.accuracy(tiny_model()) is None
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and err.count("\n") == 1
    assert "hellaswag eval skipped" in err and "Temporary failure in name resolution" in err
    assert not (tmp_path / "empty" / VAL_FILENAME).exists()


@pytest.mark.slow
def test_prep_script_fetches_into_the_cache(tmp_path, fixture_file, capsys, monkeypatch):
    env = dict(os.environ, GPT2_REPRO_CACHE=str(tmp_path / "root"), NO_PROXY="*", no_proxy="*")
    proc = subprocess.run([sys.executable, str(REPO / "prep" / "hellaswag.py"), "--url", fixture_file.as_uri()],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 0, proc.stderr
    cached = tmp_path / "root" / "hellaswag" / VAL_FILENAME
    assert f"13 examples in {cached}" in proc.stdout
    assert cached.read_bytes() == fixture_file.read_bytes()

    from prep.hellaswag import main

    out = tmp_path / "elsewhere" / "val.jsonl"
    main(["--out", str(out), "--url", fixture_file.as_uri()])
    main(["--out", str(out), "--url", UNREACHABLE_URL])  # already there: no download
    assert capsys.readouterr().out.splitlines()[-1] == f"hellaswag: 13 examples already in {out}"
    with pytest.raises(DataError, match="could not download"):
        main(["--out", str(out), "--url", UNREACHABLE_URL, "--timeout", "1", "--force"])
    assert out.read_bytes() == fixture_file.read_bytes()  # a failed download leaves the old file


# --- two ranks through torchrun --------------------------------------------------------------------

def run_two_ranks(tmp_path: Path, jobs: list[dict]):
    """hellaswag_scores.score_jobs_on_every_rank on 2 ranks (torchrun's environment, tests/forked_ranks.py);
    per rank, a {result, predictions} or {error} per job; and the launch's output."""
    spec = tmp_path / "spec.json"
    jobs = [dict(dict(cache_dir=None, url=UNREACHABLE_URL, batch_examples=3, limit=0), **job) for job in jobs]
    spec.write_text(json.dumps({"model": TINY, "jobs": jobs, "out": str(tmp_path)}))
    env = dict(GPT2_REPRO_CACHE=str(tmp_path / "root"), NO_PROXY="*", no_proxy="*")
    proc = launch([str(spec)], 2, target="hellaswag_scores:score_jobs_on_every_rank", extra_env=env, timeout=180,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], proc


@pytest.mark.slow
def test_two_ranks_give_the_single_process_figure_even_with_empty_shares(tmp_path, fixture_file):
    limits = [0, 12, 1]  # 13 examples: 7 + 6; 12: 6 + 6; 1: rank 1 has none
    ranks, _ = run_two_ranks(tmp_path, [dict(path=str(fixture_file), limit=limit) for limit in limits])
    model = tiny_model()
    for job, limit in enumerate(limits):
        evaluator = HellaSwag(str(fixture_file), limit, SINGLE, get_tokenizer(), batch_examples=4)
        single = evaluator.accuracy(model)
        assert ranks[0][job]["result"] == ranks[1][job]["result"] == single
        # rank-strided shares, and each example gets the prediction it gets in one process
        shares = [ranks[r][job]["predictions"] for r in range(2)]
        assert [[p[0] for p in share] for share in shares] == [list(range(r, single["n"], 2)) for r in range(2)]
        expected = [[s.index, s.pred_norm, s.pred] for s in per_example_scores(evaluator, model)]
        assert sorted(shares[0] + shares[1]) == expected
    assert ranks[1][2]["predictions"] == [] and ranks[1][2]["result"]["n"] == 1

@pytest.mark.slow
def test_two_ranks_offline_skip_on_every_rank_with_one_warning(tmp_path, fixture_file):
    jobs = [dict(path="", cache_dir=str(tmp_path / "empty_cache")),
            dict(path=str(fixture_file))]  # and the group is still healthy for a later eval
    ranks, proc = run_two_ranks(tmp_path, jobs)
    assert [ranks[r][0] for r in range(2)] == [{"result": None, "predictions": []}] * 2
    assert ranks[0][1]["result"] == ranks[1][1]["result"] and ranks[0][1]["result"]["n"] == 13
    output = proc.stdout + proc.stderr
    assert output.count("warning: hellaswag eval skipped") == 1, output[-3000:]
    assert not (tmp_path / "empty_cache" / VAL_FILENAME).exists()


@pytest.mark.slow
def test_two_ranks_malformed_file_is_the_same_error_on_every_rank(tmp_path, fixture_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    ranks, _ = run_two_ranks(tmp_path, [dict(path=str(bad)), dict(path=str(fixture_file))])
    message = f"{bad}: line 1: 'endings' must be a list of 4 strings"
    assert [ranks[r][0]["error"][:len(message)] for r in range(2)] == [message] * 2
    assert ranks[0][1]["result"]["n"] == ranks[1][1]["result"]["n"] == 13  # and the group goes on
