"""eval_lm.py and evals/lm_eval_harness.py: lm-evaluation-harness on our checkpoints, offline.

Tasks come from tests/fixtures/lm_eval/: 20 examples in the HellaSwag jsonl format read from a
local file, as `hellaswag_fixture` (lm_eval's built-in acc and character-normalised acc_norm)
and `hellaswag_fixture_tokens` (the trainer's token-normalised acc_norm as an lm_eval metric).
The fixture tasks find their data file beside their YAML, from any working directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import metadata

import pytest
import torch

from conftest import GPT2_VOCAB, REPO, base_args, make_shards, run_trainer
from data.tokenizer import EOT_TOKEN, get_tokenizer
from common.errors import ConfigError, run_cli
from evals.hellaswag import HellaSwag, read_examples
from hellaswag_scores import per_example_scores
from model import GPT, GPTConfig
from training.distributed.process_group import DistEnv
from training.observe.logger import read_log

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
        ([str(tmp_path)], "the following arguments are required: --tasks"),
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
    empty_cache = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    proc = eval_lm(str(evaluated_run[0]), "--tasks", "arc_easy", "--limit", "2", extra_env=empty_cache)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --tasks: could not load a task's data (Couldn't reach") and "HF_DATASETS_OFFLINE" in line


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
