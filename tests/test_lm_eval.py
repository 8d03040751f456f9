"""eval_lm.py and evals/lm_eval_harness.py: lm-evaluation-harness on our checkpoints, offline.

Tasks come from tests/fixtures/lm_eval/: 20 examples in the HellaSwag jsonl format read from a
local file, as `hellaswag_fixture` (lm_eval's built-in acc and character-normalised acc_norm)
and `hellaswag_fixture_tokens` (the trainer's token-normalised acc_norm as an lm_eval metric).
The fixture tasks find their data file beside their YAML, from any working directory.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import torch

from conftest import GPT2_VOCAB, REPO, base_args, make_shards, run_trainer
from data.tokenizer import EOT_TOKEN, get_tokenizer
from common.errors import ConfigError, run_cli
from evals.hellaswag import HellaSwag, read_examples
from hellaswag_scores import per_example_scores
from model import GPT, GPTConfig
from runtime.process_group import DistEnv
from runtime.logger import read_log

pytest.importorskip("lm_eval")

from evals.lm_eval_harness import GPTLM  # noqa: E402  (needs lm_eval)


FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
HELLASWAG = FIXTURES / "hellaswag_fixture.jsonl"
TASKS = ["hellaswag_fixture", "hellaswag_fixture_tokens"]
CPU = torch.device("cpu")


@pytest.fixture
def offline(monkeypatch):
    """The repository root as working directory, and no Hugging Face Hub."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_model(seed: int = 0, block_size: int = 32) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=64)).eval()


def fixture_results(lm: GPTLM, **kwargs) -> dict:
    """lm_eval's results dict for the two fixture tasks, with only the fixture tasks indexed."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(FIXTURES), include_defaults=False)
    return simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, log_samples=False, **kwargs)


def test_loglikelihoods_are_the_in_loop_hellaswag_ending_losses():
    """Per ending: lm_eval's request (ctx, " " + ending) scores minus the trainer's summed loss."""
    model, tokenizer = tiny_model(), get_tokenizer()
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, distributed=False)
    in_loop = per_example_scores(HellaSwag(str(HELLASWAG), 0, env, tokenizer), model)  # contexts longer than 32 tokens get cut
    lm = GPTLM(model, tokenizer, CPU, batch_size=7)  # batches that straddle examples
    pairs = [lm.encode_pair(ex.ctx, " " + ending) for ex in read_examples(HELLASWAG) for ending in ex.endings]
    scored = lm.score_pairs(pairs)
    ours = torch.tensor([-logprob for logprob, _ in scored]).view(-1, 4)
    assert torch.allclose(ours, torch.tensor([s.sum_losses for s in in_loop]), rtol=1e-5, atol=1e-5)


def test_lm_eval_acc_and_token_normalised_acc_norm_equal_the_in_loop_hellaswag(offline):
    model, tokenizer = tiny_model(seed=3), get_tokenizer()
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, distributed=False)
    in_loop = HellaSwag(str(HELLASWAG), 0, env, tokenizer).accuracy(model)
    results = fixture_results(GPTLM(model, tokenizer, CPU, batch_size=16))["results"]
    assert results["hellaswag_fixture"]["acc,none"] == in_loop["acc"]
    assert results["hellaswag_fixture_tokens"]["acc_norm_tokens,none"] == in_loop["acc_norm"]
    assert 0 <= results["hellaswag_fixture"]["acc_norm,none"] <= 1  # lm_eval's, per character: not ours


def test_greedy_flag_and_generation_match_the_models_own_greedy_decoding():
    model, tokenizer = tiny_model(), get_tokenizer()
    lm = GPTLM(model, tokenizer, CPU)
    prompt = tokenizer.encode_ordinary("The woman runs")
    reference = model.generate(torch.tensor([prompt]), 40, temperature=0, valid_vocab=tokenizer.n_vocab)[0, len(prompt):]
    text = tokenizer.decode(reference.tolist())
    stop = text[10:14]
    request = type("Request", (), {"args": ("The woman runs", {"until": [stop], "max_gen_toks": 40})})
    assert lm.generate_until([request]) == [text[:text.find(stop)]]
    request.args = ("The woman runs", {"until": [], "max_gen_toks": 40})
    assert lm.generate_until([request]) == [text]  # chunked generation = one 40-token generation
    greedy, other = reference[:5].tolist(), [(reference[0].item() + 1) % tokenizer.n_vocab] + reference[1:5].tolist()
    assert [flag for _, flag in lm.score_pairs([(prompt, greedy), (prompt, other)])] == [True, False]
    assert lm.score_pairs([(prompt, [])]) == [(0.0, True)]  # nothing to predict: probability 1


def test_rolling_loglikelihood_predicts_every_token_once_within_the_context_window(monkeypatch):
    model, tokenizer = tiny_model(), get_tokenizer()
    lm = GPTLM(model, tokenizer, CPU)
    short = "A man runs then slowly falls over the ball."
    tokens = torch.tensor([[EOT_TOKEN, *tokenizer.encode_ordinary(short)]])  # (1, T + 1), T < block_size
    with torch.no_grad():
        _, mean_loss = model(tokens[:, :-1], tokens[:, 1:])
    request = type("Request", (), {"args": (short,)})
    expected = -mean_loss.item() * (tokens.size(1) - 1)
    assert lm.loglikelihood_rolling([request])[0] == pytest.approx(expected, rel=1e-5)
    seen = []
    score = lm.score_pairs
    monkeypatch.setattr(lm, "score_pairs", lambda pairs: seen.extend(pairs) or score(pairs))
    long = " ".join(["the ball slowly falls and a dog jumps over it"] * 12)  # about 110 tokens, 4 windows of 32
    request.args = (long,)
    lm.loglikelihood_rolling([request])
    assert [t for _, continuation in seen for t in continuation] == tokenizer.encode_ordinary(long)
    assert len(seen) > 3 and all(len(context) + len(continuation) <= 33 for context, continuation in seen)


def test_bad_arguments_and_a_missing_checkpoint_are_one_error_line(tmp_path, capfd):
    cases = [
        (["--tasks", "hellaswag", str(tmp_path / "missing")], "no such checkpoint file or run folder"),
        ([str(tmp_path), "--tasks", "hellaswag", "--batch_size", "0"], "--batch_size: must be >= 1, got 0"),
        ([str(tmp_path), "--tasks", " , "], "--tasks: no task names given"),
        ([str(tmp_path)], "--tasks: needed without --card (comma-separated lm_eval task names)"),
    ]
    from eval_lm import check_tasks, main

    for argv, message in cases:
        assert run_cli(main, argv) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    with pytest.raises(ConfigError, match=r"unknown task 'helaswag' \(did you mean hellaswag\?\)"):
        check_tasks(["hellaswag", "helaswag"], ["arc_easy", "hellaswag", "piqa"])


def test_results_table_and_metric_names():
    from eval_lm import format_table, task_entries

    results = {
        "results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1},
                    "piqa": {"alias": "piqa", "acc,none": 0.6, "acc_stderr,none": float("nan")}},
        "n-samples": {"gsm8k": {"original": 1319, "effective": 4}, "piqa": {"original": 1838, "effective": 1}},
        "n-shot": {"gsm8k": 5, "piqa": 0}, "versions": {"gsm8k": 3.0, "piqa": 1.0},
    }
    entries = task_entries(results, {"limit": 4})
    assert entries["gsm8k"]["metrics"] == {"exact_match/strict-match": 0.25, "exact_match_stderr/strict-match": 0.1}
    assert entries["piqa"] == {"metrics": {"acc": 0.6, "acc_stderr": None}, "n": 1, "num_fewshot": 0, "version": 1.0,
                               "limit": 4}
    assert format_table(entries).splitlines()[2:] == ["| gsm8k | exact_match/strict-match | 0.2500 | 0.1000 | 4 |",
                                                      "| piqa | acc | 0.6000 |  | 1 |"]


# --- the command on a trained run ------------------------------------------------------------


def eval_lm(*args: str, extra_env: dict | None = None, include_path=FIXTURES, cwd=REPO) -> subprocess.CompletedProcess:
    """eval_lm.py as a user runs it (from the repository root unless cwd says otherwise), with no Hugging Face Hub."""
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    return run_trainer([*args, "--include_path", str(include_path), "--device", "cpu", "--dtype", "float32"],
                       script="eval_lm.py", extra_env=env, check=False, cwd=cwd)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A 2-step run that scored the fixture with its in-loop HellaSwag and logged to W&B offline,
    then eval_lm.py on its folder."""
    root = tmp_path_factory.mktemp("lm_eval")
    out = root / "run"
    run_trainer(base_args(make_shards(root / "shards"), out, max_steps=2, eval_interval=2, checkpoint_interval=2,
                          hellaswag_interval=2, hellaswag_path=HELLASWAG, wandb="true", wandb_mode="offline", vocab_size=GPT2_VOCAB,
                          wandb_project="test"))
    proc = eval_lm(str(out), "--tasks", ",".join(TASKS), extra_env={"HF_DATASETS_CACHE": str(root / "hf")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_eval_lm_on_a_run_folder_agrees_with_the_trainers_hellaswag_and_writes_json(evaluated_run):
    out, proc = evaluated_run
    (in_loop,) = [r for r in read_log(out / "log.jsonl") if r["kind"] == "hellaswag" and r["step"] == 2]
    record = json.loads((out / "lm_eval" / "step_00000002.json").read_text())
    assert record["step"] == 2 and record["checkpoint"] == str((out / "checkpoints" / "step_00000002.pt").resolve())
    tasks = record["tasks"]
    assert sorted(tasks) == TASKS
    assert tasks["hellaswag_fixture"]["metrics"]["acc"] == in_loop["acc"]
    assert tasks["hellaswag_fixture_tokens"]["metrics"]["acc_norm_tokens"] == in_loop["acc_norm"]
    assert tasks["hellaswag_fixture"]["lm_eval_version"] == metadata.version("lm_eval")
    assert {tasks[t]["n"] for t in TASKS} == {20} and tasks["hellaswag_fixture"]["limit"] is None
    assert f"| hellaswag_fixture | acc | {in_loop['acc']:.4f} |" in proc.stdout
    # (issue 53) no progress bar (lm_eval's, the datasets library's) where stderr is no terminal: tqdm's time stamp
    assert not re.search(r"\[\d\d:\d\d", proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
def test_eval_lm_logs_into_the_runs_own_wandb_run_at_the_checkpoint_step(evaluated_run):
    from test_observability import wandb_history

    out, _ = evaluated_run
    run_id = torch.load(out / "checkpoints" / "step_00000002.pt", weights_only=True)["wandb_run_id"]
    training_run, evaluation = sorted((out / "wandb").glob("offline-run-*"))  # names start with the start time
    assert training_run.name.endswith(run_id) and evaluation.name.endswith(run_id)
    (row,) = [row for row in wandb_history(evaluation) if "lm_eval/step" in row]
    tasks = json.loads((out / "lm_eval" / "step_00000002.json").read_text())["tasks"]
    assert row["lm_eval/step"] == 2
    assert row["lm_eval/hellaswag_fixture/acc"] == tasks["hellaswag_fixture"]["metrics"]["acc"]
    assert row["lm_eval/hellaswag_fixture_tokens/acc_norm_tokens"] == tasks["hellaswag_fixture_tokens"]["metrics"]["acc_norm_tokens"]


@pytest.mark.slow
def test_a_later_evaluation_of_the_same_checkpoint_adds_to_its_results(evaluated_run, tmp_path):
    """What a second `eval_lm.py CKPT --tasks hellaswag_fixture --limit 5 --wandb_mode disabled` keeps and
    replaces (its evaluation itself is the fixture's, so it runs in this process)."""
    from eval_lm import log_to_wandb, write_results

    out = tmp_path / "run"
    shutil.copytree(evaluated_run[0], out)
    ckpt = out / "checkpoints" / "step_00000002.pt"
    state = torch.load(ckpt, weights_only=True)
    again = {"hellaswag_fixture": {"metrics": {"acc": 0.4}, "n": 5, "num_fewshot": 0, "version": 1.0, "limit": 5}}
    write_results(out, ckpt, state, again)
    tasks = json.loads((out / "lm_eval" / "step_00000002.json").read_text())["tasks"]
    assert (tasks["hellaswag_fixture"]["n"], tasks["hellaswag_fixture"]["limit"]) == (5, 5)  # replaced
    assert tasks["hellaswag_fixture_tokens"]["n"] == 20  # kept
    assert log_to_wandb(state, again, out, "disabled") is None
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2  # nothing new: W&B disabled


def test_an_earlier_results_file_of_another_shape_is_replaced_not_merged(tmp_path):
    """The regression of a traceback (AttributeError) on an earlier results file whose tasks are not a table."""
    from eval_lm import write_results

    entries = {"hellaswag_fixture": {"metrics": {"acc": 0.4}, "n": 5}}
    for earlier in ('{"tasks": ["hellaswag"]}', '["tasks"]', '{"tasks": 3}', "{"):
        (tmp_path / "lm_eval").mkdir(exist_ok=True)
        (tmp_path / "lm_eval" / "step_00000002.json").write_text(earlier)
        path = write_results(tmp_path, tmp_path / "step_00000002.pt", {"step": 2}, entries)
        assert json.loads(path.read_text())["tasks"] == entries, earlier


def test_an_unknown_task_is_one_error_line_before_the_model_loads(tmp_path, capfd, monkeypatch, offline):
    """In this process, with lm_eval's index of the fixture tasks alone: indexing its thousands of
    built-in tasks, which a name not among --include_path's makes eval_lm.py do, takes 10-15 s of CPU
    (the test of a task whose data is not cached goes through it)."""
    from lm_eval import tasks as lm_eval_tasks

    from eval_lm import main

    class FixturesOnly(lm_eval_tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", FixturesOnly)
    argv = [str(tmp_path), "--tasks", "hellaswag_fixture,helaswag_fixture", "--include_path", str(FIXTURES)]
    assert run_cli(main, argv) == 2
    out, err = capfd.readouterr()
    assert err.count("\n") == 1 and err.startswith(
        "error: --tasks: unknown task 'helaswag_fixture' (did you mean hellaswag_fixture"), err
    assert out == ""  # refused before the checkpoint (an empty folder here) was read


@pytest.mark.slow
def test_a_task_whose_data_is_not_cached_offline_is_one_error_line(evaluated_run, tmp_path):
    """The offline flags unset but the Hub unreachable (a closed local port): one note, then one error line naming
    the task and the cache, and no retries (datasets' own would take ~25 s). With HF_DATASETS_OFFLINE=1 set by the
    user the same flags are set from the start (test_an_unreachable_hub_is_one_note_and_then_the_cache_alone)."""
    cache = tmp_path / "hf" / "datasets"
    unreachable = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9",
                   "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "TRANSFORMERS_OFFLINE": ""}
    proc = eval_lm(str(evaluated_run[0]), "--tasks", "arc_easy", "--limit", "2", extra_env=unreachable)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --tasks: arc_easy: the task's data is not in {cache} and the Hugging Face Hub "
                           f"cannot be reached (Couldn't reach") and "HF_DATASETS_OFFLINE=1 works" in line, line
    assert "Retry" not in proc.stderr and "Traceback" not in proc.stderr
    # before the model is read (the "# evaluating" line): a missing task costs no checkpoint load (nor a 1.5B one's)
    assert proc.stdout.splitlines()[0].startswith("note: 127.0.0.1 cannot be reached (") and "#" not in proc.stdout


@pytest.mark.slow
def test_the_fixture_task_finds_its_data_from_any_folder_and_a_missing_file_is_one_line(evaluated_run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = {"HF_DATASETS_CACHE": str(tmp_path / "hf")}
    found = eval_lm(str(evaluated_run[0]), "--tasks", "hellaswag_fixture", "--limit", "2", extra_env=cache,
                    cwd=elsewhere)
    assert found.returncode == 0 and "| hellaswag_fixture | acc |" in found.stdout, found.stderr[-3000:]
    # a task of the user's own whose data_files path does not resolve from the current folder
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: data/mine.jsonl\n"
        "output_type: multiple_choice\nvalidation_split: validation\ndoc_to_text: '{{ctx}}'\n"
        "doc_to_choice: endings\ndoc_to_target: label\n")
    missing = eval_lm(str(evaluated_run[0]), "--tasks", "mine", "--limit", "2", extra_env=cache, include_path=tasks,
                      cwd=elsewhere)
    assert missing.returncode == 2, missing.stderr[-3000:]
    (line,) = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --tasks: mine: data file not found") and "data/mine.jsonl" in line, line
    assert "Traceback" not in missing.stderr


# --- the report card (eval_lm.py --card) -------------------------------------------------------


def direct_val_figures(model, data_dir, seq_len: int, rows: int) -> tuple[list[float], int]:
    """Each row's summed token loss over the first `rows` rows of data_dir's val shard (F.cross_entropy on the
    model's logits), and the UTF-8 bytes of the text its targets decode to: the card's val figures by hand."""
    import numpy as np
    import torch.nn.functional as F

    (shard,) = Path(data_dir).glob("*_val_*.npy")
    tokens = torch.from_numpy(np.load(shard).astype(np.int64)[:rows * seq_len + 1])
    x, y = tokens[:-1].view(rows, seq_len), tokens[1:].view(rows, seq_len)
    with torch.no_grad():
        logits, _ = model(x, y)  # (rows, T, V) with targets: every position's logits
        losses = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view(rows, seq_len)
    return losses.sum(dim=1).tolist(), len(get_tokenizer().decode_bytes([t for t in y.flatten().tolist() if t != EOT_TOKEN]))


def expected_card_rows(row_sums: list[float], seq_len: int, n_bytes: int) -> dict:
    """val loss and bpb with their intervals, from the rows' summed losses: the mean, Student's t over the rows'
    mean losses (statistics.stdev; the t quantile is tested in test_stats.py), and the same scaled to bits per byte."""
    import math
    import statistics

    from evals.stats import t_quantile

    rows = len(row_sums)
    loss = sum(row_sums) / (rows * seq_len)
    half = t_quantile(0.975, rows - 1) * statistics.stdev(s / seq_len for s in row_sums) / math.sqrt(rows)
    scale = rows * seq_len / (n_bytes * math.log(2))
    return {"loss": (loss, loss - half, loss + half), "bpb": (loss * scale, (loss - half) * scale, (loss + half) * scale)}


@pytest.mark.slow
def test_the_card_of_a_run_equals_a_direct_computation(evaluated_run, tmp_path, capfd, offline):
    """`eval_lm.py RUN --card` on the fixture tasks, in this process: val loss and bpb (8 rows of 32 tokens) against
    F.cross_entropy and the decoded bytes; acc and acc_norm_tokens against the in-loop HellaSwag of the same step,
    each accuracy with Wilson's interval of k right of 20."""
    from eval_lm import main
    from evals.stats import wilson_interval
    from training.checkpoint.folder import read_model

    out, _ = evaluated_run
    argv = [str(out), "--card", "--tasks", "hellaswag_fixture,hellaswag_fixture_tokens:acc_norm_tokens", "--include_path",
            str(FIXTURES), "--device", "cpu", "--dtype", "float32", "--out_dir", str(tmp_path)]
    assert run_cli(main, argv) == 0
    printed = capfd.readouterr().out
    card = json.loads((tmp_path / "report.json").read_text())
    model, state, _ = read_model(out, "test")
    row_sums, n_bytes = direct_val_figures(model.eval(), state["config"]["data_dir"], 32, 8)
    (val,) = card["val"]
    assert (val["set"], val["rows"], val["seq_len"], val["bytes"]) == ("val", 8, 32, n_bytes)
    for name, (value, low, high) in expected_card_rows(row_sums, 32, n_bytes).items():
        assert val[name]["value"] == pytest.approx(value, rel=1e-6) and val[name]["n"] == 8
        assert val[name]["ci95"] == pytest.approx([low, high], rel=1e-6)
    (logged,) = [r for r in read_log(out / "log.jsonl") if r["kind"] == "val" and r["step"] == 2]
    assert val["loss"]["value"] == logged["loss"] and val["bpb"]["value"] == logged["bpb"]  # the trainer's own figures
    (in_loop,) = [r for r in read_log(out / "log.jsonl") if r["kind"] == "hellaswag" and r["step"] == 2]
    tasks = card["tasks"]
    for task, metric, value in (("hellaswag_fixture", "acc", in_loop["acc"]),
                                ("hellaswag_fixture_tokens", "acc_norm_tokens", in_loop["acc_norm"])):
        assert (tasks[task]["metric"], tasks[task]["value"], tasks[task]["n"]) == (metric, value, 20)
        assert tasks[task]["ci95"] == pytest.approx(list(wilson_interval(round(value * 20), 20)), abs=1e-12)
        low, high = tasks[task]["ci95"]
        assert f"| {task} {metric} | {value:.4f} | {low:.4f} – {high:.4f} | 20 |" in printed
    assert card["model"]["step"] == 2 and card["settings"]["num_fewshot"] == 0
    report = (tmp_path / "report.md").read_text()
    assert report in printed and report.startswith(f"# Report card: step 2 of {out / 'checkpoints'}")
    assert "[1/2] hellaswag_fixture: acc " in printed and "[2/2] hellaswag_fixture_tokens: acc_norm_tokens" in printed


@pytest.mark.slow
def test_the_card_refuses_a_metric_the_task_lacks_and_writes_nothing(evaluated_run, tmp_path, capfd, offline):
    """Before the val pass (issue 53): the task's metrics are known once it is loaded."""
    from eval_lm import main

    argv = [str(evaluated_run[0]), "--card", "--tasks", "hellaswag_fixture:accuracy", "--include_path", str(FIXTURES),
            "--device", "cpu", "--dtype", "float32", "--out_dir", str(tmp_path / "card")]
    assert run_cli(main, argv) == 2
    out, err = capfd.readouterr()
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --tasks: hellaswag_fixture has no metric 'accuracy' (it has acc, acc_norm)"]
    assert "val:" not in out and not (tmp_path / "card").exists()


def uncached_task(folder: Path, name: str) -> None:
    """A task YAML in folder whose data is a Hugging Face Hub dataset that no datasets cache holds."""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: nobody/{name}_data\noutput_type: multiple_choice\nvalidation_split: validation\n"
        "doc_to_text: '{{ctx}}'\ndoc_to_choice: endings\ndoc_to_target: label\n")


@pytest.mark.slow
def test_the_card_offline_names_every_task_whose_data_is_not_cached_before_the_val_pass(evaluated_run, tmp_path,
                                                                                        capfd, monkeypatch, offline):
    """Issue 53: the card spent its val pass, then failed on the first task whose data was not cached, and the
    val figures were lost. Every task's data is loaded first: the missing ones are named in one line, with the
    --tasks of the ones that are there (the fixture, its data beside its YAML) and --tasks none; nothing was
    scored, nothing is written."""
    import datasets.config
    import huggingface_hub.constants

    import eval_lm
    from eval_lm import main

    loads, load_card_model = [], eval_lm.load_card_model  # no model is loaded: a missing task costs no checkpoint
    monkeypatch.setattr(eval_lm, "load_card_model", lambda args: loads.append(args) or load_card_model(args))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("hellaswag_fixture.yaml", "hellaswag_fixture.jsonl", "utils.py"):
        shutil.copy(FIXTURES / name, tasks / name)
    uncached_task(tasks, "uncached_a")
    uncached_task(tasks, "uncached_b")
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    # as the variables make them when the libraries are imported (in this process, maybe before the fixture set them)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = [str(evaluated_run[0]), "--card", "--tasks", "uncached_a,hellaswag_fixture:acc_norm,uncached_b",
            "--include_path", str(tasks), "--device", "cpu", "--out_dir", str(tmp_path / "card")]
    assert run_cli(main, argv) == 2
    out, err = capfd.readouterr()
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --tasks: uncached_a, uncached_b: their data is not in {cache} and the Hugging "
                           f"Face Hub cannot be reached (Couldn't reach 'nobody/uncached_a_data'"), line
    assert line.endswith("then HF_DATASETS_OFFLINE=1 works; --tasks hellaswag_fixture:acc_norm scores the others, "
                         "--tasks none the card's val figures alone"), line
    assert "Traceback" not in err and "val:" not in out and not (tmp_path / "card").exists() and loads == []


@pytest.mark.slow
def test_a_card_cut_short_keeps_the_figures_it_made(evaluated_run, tmp_path, capfd, monkeypatch, offline):
    """Ctrl-C (or a failure) while the second task is scored: the card so far is written, naming the task it
    lacks, then the interruption is reported as usual."""
    import eval_lm

    scored = []

    def interrupted_at_the_second(*args, **kwargs):
        if scored:
            raise KeyboardInterrupt
        scored.append(True)
        return evaluate(*args, **kwargs)

    evaluate = eval_lm.evaluate_tasks
    monkeypatch.setattr(eval_lm, "evaluate_tasks", interrupted_at_the_second)
    argv = [str(evaluated_run[0]), "--card", "--tasks", "hellaswag_fixture,hellaswag_fixture_tokens:acc_norm_tokens",
            "--include_path", str(FIXTURES), "--device", "cpu", "--out_dir", str(tmp_path)]
    assert run_cli(eval_lm.main, argv) == 130
    out, err = capfd.readouterr()
    card = json.loads((tmp_path / "report.json").read_text())
    assert len(card["val"]) == 1 and list(card["tasks"]) == ["hellaswag_fixture"]
    assert card["not_scored"] == ["hellaswag_fixture_tokens"]
    assert "a partial card: hellaswag_fixture_tokens not scored" in (tmp_path / "report.md").read_text()
    assert f"partial card written, without hellaswag_fixture_tokens: {tmp_path / 'report'}.md" in out
    assert err.splitlines()[-1] == "interrupted"


@pytest.mark.slow
def test_the_card_evaluates_in_the_runs_own_dtype_unless_told(evaluated_run, tmp_path, capfd, monkeypatch):
    """Issue 52: on a CPU with native bf16 (made so here) `auto` meant bfloat16, and the card of a float32 run
    differed from the run's logged val loss in the fifth decimal. By default the card takes the checkpoint
    config's dtype: its val loss is the logged one bitwise (the same weights, rows and batches of 4 rows, each
    row's loss summed into its own float64 slot, the slots added in the same order: evals/val_loss.py). An
    explicit --dtype still wins."""
    from eval_lm import main
    from runtime import runtime

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    out = evaluated_run[0]
    (logged,) = [r for r in read_log(out / "log.jsonl") if r["kind"] == "val" and r["step"] == 2]
    for dtype, folder in ((None, tmp_path / "own"), ("bfloat16", tmp_path / "bf16")):
        argv = [str(out), "--card", "--tasks", "none", "--device", "cpu", "--batch_size", "4", "--out_dir",
                str(folder)] + (["--dtype", dtype] if dtype else [])
        assert run_cli(main, argv) == 0, capfd.readouterr().err
        card = json.loads((folder / "report.json").read_text())
        if dtype is None:
            assert card["settings"]["dtype"] == "float32"  # the run's (tests' base_args: dtype float32)
            assert card["val"][0]["loss"]["value"] == logged["loss"] and card["val"][0]["bpb"]["value"] == logged["bpb"]
        else:
            assert card["settings"]["dtype"] == "bfloat16" and card["val"][0]["loss"]["value"] != logged["loss"]


def test_card_arguments_that_cannot_work_are_one_error_line(tmp_path, capfd):
    from eval_lm import card_tasks, main

    cases = [
        ([str(tmp_path), "--tasks", "piqa", "--data_dir", "data"], "--data_dir: only for the report card (--card)"),
        ([str(tmp_path), "--card", "--num_fewshot", "5"], "--num_fewshot: the report card is zero-shot, got 5"),
        ([str(tmp_path), "--card", "--wandb_mode", "offline"], "--wandb_mode: the report card logs nothing to W&B"),
        ([str(tmp_path), "--card", "--tasks", ","], "--tasks: no task names given (none: the card without tasks)"),
        ([str(tmp_path / "missing"), "--card"], "no such checkpoint file or run folder"),
        ([str(tmp_path), "--card", "--val_tokens", "0"], "--val_tokens: must be >= 1, got 0"),
        (["gpt2", "--card", "--tasks", "none"], "--out_dir: needed for gpt2: where report.md and report.json go"),
        (["gpt2", "--card", "--tasks", "none", "--weights", "ema"], "--weights: ema needs one of our checkpoints"),
        (["gpt2", "--tasks", "piqa"], "gpt2: a Hugging Face model is evaluated with --card here"),
    ]
    for argv, message in cases:
        assert run_cli(main, argv) == 2, argv
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert card_tasks(None) == {"hellaswag": "acc_norm", "arc_easy": "acc", "arc_challenge": "acc_norm", "piqa": "acc",
                                "winogrande": "acc", "lambada_openai": "acc"}
    assert card_tasks("none") == {} and card_tasks("piqa:acc_norm, mine") == {"piqa": "acc_norm", "mine": "acc"}


def test_a_long_scoring_prints_a_progress_line_at_most_every_30_seconds():
    from eval_lm import ProgressLine

    now, lines = [100.0], []
    progress = ProgressLine("[1/6] hellaswag", clock=lambda: now[0], out=lambda text, flush: lines.append(text))
    for done, at in ((16, 110.0), (32, 131.0), (48, 140.0), (64, 161.5), (4000, 400.0)):
        now[0] = at
        progress(done, 4000)
    assert lines == ["[1/6] hellaswag: 32 of 4,000 requests scored (1%), 31s so far, about 1h04m left",
                     "[1/6] hellaswag: 64 of 4,000 requests scored (2%), 1m02s so far, about 1h03m left"]  # done: no line
    model = tiny_model()
    seen = []
    lm = GPTLM(model, get_tokenizer(), CPU, batch_size=3, progress=lambda done, total: seen.append((done, total)))
    lm.score_pairs([([1, 2], [3]), ([4], [5, 6]), ([7], []), ([8, 9], [10]), ([11], [12])])
    assert seen == [(3, 4), (4, 4)]  # after each batch of the 4 pairs with a continuation to score


def test_an_unreachable_hub_is_one_note_and_then_the_cache_alone(monkeypatch, capfd):
    """The probe finds nothing listening (a closed local port): offline flags are set for the libraries, at once."""
    import datasets.config
    import huggingface_hub.constants

    from eval_lm import hub_offline

    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(flag, "")  # unset, as hub_offline reads it; restored (or removed) after the test
        monkeypatch.setattr(datasets.config, flag, False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    assert hub_offline() is True
    assert capfd.readouterr().out.startswith("note: 127.0.0.1 cannot be reached (")
    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert hub_offline() is True and capfd.readouterr().out == ""  # the flags say it now: no second probe, no note
