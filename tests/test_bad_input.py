"""Bad input: exit code 2 and one line naming the key or file, on every rank, no hang, no traceback.

Problems that depend on data or checkpoints run under 2-rank torchrun (where a rank-local error
could leave the other rank waiting in a collective); pure configuration errors, which are
raised before any process group exists, run as one process.
"""

from __future__ import annotations


import numpy as np
import pytest

from conftest import (REPO, background, base_args, build_tiny_run, make_shards, run_trainer, signalled, train_here,
                      wait_until)
from data.shards import shard_name, write_shard



def drop_val(d):
    for p in d.glob("*_val_*.npy"):
        p.unlink()


def empty_dir(d):
    for p in d.iterdir():
        p.unlink()


def unfinished_prep(d):
    """What a prep killed before its first shard leaves: its progress record alone (issue 44: the trainer
    said `no train shards` without the hint that the data is not prepared yet)."""
    empty_dir(d)
    (d / "edufineweb_progress.json").write_text("{}")


def wrong_dtype(d):
    np.save(d / "tiny_train_000009.npy", np.arange(100, dtype=np.int32))


def wrong_dimension(d):
    np.save(d / "tiny_train_000009.npy", np.zeros((40, 40), dtype=np.uint16))


def out_of_range(d):
    write_shard(d / shard_name("tiny", "train", 4), np.full(500, 50304, dtype=np.uint16))


def corrupt(d):
    (d / "tiny_train_000009.npy").write_bytes(b"\x93NUMPY garbage that is not a header")


# Under 2-rank torchrun: a problem one rank sees (here: token ranges are checked rank by rank,
# dtypes on every rank), the messages that depend on the world size, and a configuration error, found
# before the ranks connect. Each is printed once, by rank 0, for both.
RANK_CASES = [
    (wrong_dtype, [], "tiny_train_000009.npy: token shards must be uint16, found int32"),
    (out_of_range, [], "tiny_train_000004.npy: token id 50304 at position 0 is out of range for vocab_size 512"),
    (None, ["--total_batch_size", "448"], "total_batch_size: 448 is not divisible by micro_batch_size * seq_len * world_size = 4 * 32 * 2 = 256; on 2 ranks with micro_batch_size 4, total_batch_size 256 or 512 works"),
    (None, ["--total_batch_size", "32", "--micro_batch_size", "1"], "total_batch_size: a step of 32 tokens holds 1 rows of seq_len 32, fewer than the 2 ranks"),
    (None, ["--n_layer", "x"], "n_layer: expected an integer or null, got 'x'"),
]
# The same mechanism for the other problems, in this process (one rank): the message and exit code 2.
IN_PROCESS_CASES = [
    (drop_val, {}, "no val shards (*_val_*.npy)"),
    (empty_dir, {}, "no train shards (*_train_*.npy); prepare data first, e.g. `python prep/fineweb.py`"),
    (unfinished_prep, {}, "no train shards (*_train_*.npy); a prep into it has not finished "
                          "(edufineweb_progress.json): run its command again to continue it"),
    (wrong_dimension, {}, "tiny_train_000009.npy: token shards must be 1-D"),
    (corrupt, {}, "tiny_train_000009.npy: not a readable .npy token shard"),
    (None, {"data": "/no/such/folder"}, "data_dir /no/such/folder: no such directory"),
    (None, {"total_batch_size": 65536}, "fewer than one step needs (2048)"),
    (None, {"val_tokens": 1000000}, "fewer than val_tokens 1000000 needs"),
]


@pytest.mark.slow
@pytest.mark.parametrize("damage,extra,message", RANK_CASES, ids=[c[2][:40] for c in RANK_CASES])
def test_bad_data_fails_cleanly_on_every_rank(tmp_path, damage, extra, message):
    data = make_shards(tmp_path / "shards")
    if damage:
        damage(data)
    proc = run_trainer(base_args(data, tmp_path / "out") + extra, nproc=2, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]  # rank 0's line, for both ranks (issue 53)
    assert proc.exitcodes == [2, 2]
    assert "train_gpt2.py\", line" not in proc.stderr  # no traceback from the trainer


@pytest.mark.parametrize("damage,overrides,message", IN_PROCESS_CASES, ids=[c[2][:40] for c in IN_PROCESS_CASES])
def test_bad_data_is_one_error_naming_the_file_or_key(tmp_path, damage, overrides, message):
    from common.errors import ReproError

    data = make_shards(tmp_path / "shards")
    if damage:
        damage(data)
    with pytest.raises(ReproError) as raised:
        build_tiny_run(overrides.pop("data", data), tmp_path / "out", **overrides)
    assert message in str(raised.value) and raised.value.exit_code == 2


def test_the_early_checks_find_a_missing_input_with_the_trainers_own_error(tmp_path, monkeypatch):
    """What the trainer finds once torch is imported and the ranks connect (launch/resume.py, launch/build.py,
    launch/weights.py), found before (launch/early_checks.py), with the same line and in the same order.
    Where the ranks span nodes it is left to then: a node may lack a file another has, and the ranks share what
    each found only once they connect."""
    from common.errors import ReproError
    from launch.early_checks import check_launch

    data, none = make_shards(tmp_path / "shards"), tmp_path / "none"
    cases = [
        ({"resume": none}, f"resume: no checkpoint file or folder at '{none}' (use auto, never, or the path of a"),
        ({"data_dir": none}, f"data_dir {none}: no such directory (prepare data first"),
        ({"val_sets": f"v={none}"}, f"val_sets {none}: no such folder or val shard file"),
        ({"init_from": none}, f"init_from: '{none}' is not scratch, a checkpoint file, a GPT-2 preset or a HF folder"),
        ({"resume": none, "data_dir": none}, "resume: "),  # the checkpoint is chosen before the data is opened
    ]
    for overrides, message in cases:
        argv = [str(a) for a in base_args(overrides.pop("data_dir", data), tmp_path / "out", **overrides)]
        with pytest.raises(ReproError) as raised:
            check_launch(argv)
        assert str(raised.value).startswith(message) and raised.value.exit_code == 2
        with monkeypatch.context() as two_nodes:  # this node runs one of the launch's two ranks
            two_nodes.setenv("WORLD_SIZE", "2")
            two_nodes.setenv("LOCAL_WORLD_SIZE", "1")
            check_launch(argv)
    assert check_launch([str(a) for a in base_args(data, tmp_path / "out")]).data.data_dir == str(data)


@pytest.mark.parametrize("world_size,micro_batch_size", [(3, 64), (5, 64), (6, 64), (7, 64), (8, 48), (3, 16)])
def test_an_indivisible_batch_names_the_nearest_batches_that_divide(world_size, micro_batch_size):
    """GPT-2's 524,288-token batch on 3 or 6 GPUs: the error says which total_batch_size (and micro_batch_size)
    works on that many ranks instead, each the nearest of its kind."""
    import re

    from common.errors import ConfigError
    from data.settings import grad_accum_steps

    total, seq_len = 524288, 1024
    with pytest.raises(ConfigError) as raised:
        grad_accum_steps(total, seq_len, micro_batch_size, world_size)
    message = str(raised.value)
    step = micro_batch_size * seq_len * world_size
    totals = [int(t) for t in re.search(r"total_batch_size ([\d ]+(?:or \d+)?) works", message)[1].split(" or ")]
    assert totals == [total // step * step, total // step * step + step]  # the nearest below and above
    for suggested in totals:
        grad_accum_steps(suggested, seq_len, micro_batch_size, world_size)  # they divide
    kept = re.search(rf"or keep {total} with micro_batch_size (\d+)", message)
    fitting = [b for b in range(1, micro_batch_size) if total % (b * seq_len * world_size) == 0]
    assert (int(kept[1]) if kept else None) == (max(fitting) if fitting else None), message
    if world_size == 3 and micro_batch_size == 64:
        assert message == ("total_batch_size: 524288 is not divisible by micro_batch_size * seq_len * world_size = "
                           "64 * 1024 * 3 = 196608; on 3 ranks with micro_batch_size 64, total_batch_size 393216 or "
                           "589824 works (grad_accum_steps 2 or 3); no micro_batch_size works for 524288 itself, "
                           "whose 512 rows of seq_len 1024 do not split over 3 ranks")


RANKS = {"RANK": "0", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("held_by,ranks,printed", [
    (None, {"RANK": "1", "LOCAL_RANK": "1"}, True),  # this rank's own error
    ("RANK", {"RANK": "0", "LOCAL_RANK": "0"}, True),  # shared with every rank: rank 0 prints it
    ("RANK", {"RANK": "1", "LOCAL_RANK": "0"}, False),
    ("LOCAL_RANK", {"RANK": "2", "LOCAL_RANK": "0"}, True),  # found alike by a node's ranks: its local rank 0
    ("LOCAL_RANK", {"RANK": "1", "LOCAL_RANK": "1"}, False),
    ("RANK", {}, True),  # no torchrun: one process
])
def test_an_error_ranks_hold_alike_is_printed_by_one_of_them_and_recorded_by_each(held_by, ranks, printed, tmp_path,
                                                                                 capfd, monkeypatch):
    """What every rank of a torchrun launch does with its error: the exit code, the line once for the ranks that
    hold it alike, and the line in torchrun's error file, whose report shows it for each worker."""
    import json

    from common.errors import EVERY_RANK, NODE_RANKS, DataError, held_alike_by, run_cli

    assert (EVERY_RANK, NODE_RANKS) == ("RANK", "LOCAL_RANK")
    for key in RANKS:
        monkeypatch.delenv(key, raising=False)
    for key, value in ranks.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))

    def main(argv):
        if held_by is None:
            raise DataError("shards: no such directory")
        with held_alike_by(held_by):
            raise DataError("shards: no such directory")

    assert run_cli(main, []) == 2
    assert capfd.readouterr().err == ("error: shards: no such directory\n" if printed else "")
    record = json.loads((tmp_path / "error.json").read_text())["message"]
    assert record["message"] == "error: shards: no such directory" and int(record["extraInfo"]["timestamp"]) > 0


@pytest.mark.parametrize("local_rank,printed", [(None, True), ("0", True), ("1", False)])
def test_an_interrupt_is_one_line_once_per_node(local_rank, printed, capfd, monkeypatch):
    """torchrun forwards a signal to each of its workers: one `interrupted` line per node, exit 130 on each."""
    from common.errors import run_cli

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)

    def main(argv):
        raise KeyboardInterrupt("a second SIGINT stops at once")

    assert run_cli(main, []) == 130
    assert capfd.readouterr().err == ("interrupted: a second SIGINT stops at once\n" if printed else "")


ENTRY_SCRIPTS = ("train_gpt2.py", "sample.py", "eval_lm.py", "export_hf.py", "compare_runs.py", "plot_log.py",
                 "consolidate_checkpoint.py", "prep/fineweb.py", "prep/hellaswag.py", "prep/shakespeare.py")


def accepted_arguments(script: str, folder) -> list[str]:
    """Arguments the script's own check accepts, with the data they name made in folder: train_gpt2.py and
    eval_lm.py check theirs before their slow imports, which the tests below are about."""
    if script == "train_gpt2.py":
        return ["--data_dir", str(make_shards(folder / "shards"))]
    if script == "eval_lm.py":
        return [str(folder / "run"), "--tasks", "hellaswag"]
    return []


# Stand-ins for what the entry scripts import first that takes time (torch takes seconds): each says it started
# importing, then waits, so that a Ctrl-C lands inside the import every time
SLOW_IMPORTS = ("torch", "numpy", "matplotlib", "statistics")


@pytest.mark.slow
@pytest.mark.parametrize("script,local_rank", [(s, None) for s in ENTRY_SCRIPTS] + [("train_gpt2.py", "1")])
def test_a_ctrl_c_while_an_entry_point_imports_is_one_line(script, local_rank, tmp_path):
    """A Ctrl-C while the script still imports its modules (issue 52: a traceback from every rank). One
    `interrupted` line, and the process ends by SIGINT (the shell's 130); under torchrun, which forwards the
    signal to each worker, local rank 0 alone prints it."""
    import os
    import signal
    import sys

    started = tmp_path / "importing"
    for name in SLOW_IMPORTS:
        (tmp_path / "slow" / name).mkdir(parents=True)
        (tmp_path / "slow" / name / "__init__.py").write_text(
            # short sleeps: a SIGINT landing just before a long sleep's system call would wait for its end
            f"import time\nopen({str(started)!r}, 'w').close()\nfor _ in range(6000):\n    time.sleep(0.1)\n")
    env = {key: value for key, value in os.environ.items() if key not in RANKS}
    env["PYTHONPATH"] = str(tmp_path / "slow")  # ahead of the installed packages and the standard library
    if local_rank is not None:
        env.update(RANK=local_rank, LOCAL_RANK=local_rank)
    # SIGINT's default action in the child: a suite started in the background (`pytest &` from a script) has
    # SIGINT ignored, which Python would inherit and keep, never raising KeyboardInterrupt
    with background([sys.executable, str(REPO / script), *accepted_arguments(script, tmp_path)], env, cwd=tmp_path,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        wait_until(started.exists, proc, f"{script} importing one of {SLOW_IMPORTS}", 30)
        stdout, stderr = signalled(proc, signal.SIGINT, timeout=30)
    assert (proc.returncode, stdout, stderr) == (-signal.SIGINT, "", "interrupted\n" if local_rank is None else "")


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in ENTRY_SCRIPTS if s != "compare_runs.py"])  # it needs neither
def test_an_entry_point_run_outside_the_environment_says_so_in_one_line(script, tmp_path):
    """Run by a Python without the project's packages (the virtual environment not entered): one `error:` line
    naming the package and how to enter the environment, exit 1, not an import's traceback."""
    import os
    import subprocess
    import sys

    from slowness import guard

    for name in ("torch", "numpy"):  # what the entry scripts import first, as if not installed
        (tmp_path / "missing" / name).mkdir(parents=True)
        (tmp_path / "missing" / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named {name!r}\", name={name!r})\n")
    env = {key: value for key, value in os.environ.items() if key not in RANKS}
    env["PYTHONPATH"] = str(tmp_path / "missing")
    proc = subprocess.run([sys.executable, str(REPO / script), *accepted_arguments(script, tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=guard(30))
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: the package '") and \
        f"is not installed for {sys.executable}: enter the project's environment" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script,argv,message", [
    ("train_gpt2.py", ["--max_lrr", "1e-3"], "error: max_lrr: unknown config key"),
    ("train_gpt2.py", ["--config", "bad.yaml"], "error: max_lr: expected a number, got ['0.1', '0.2']"),
    ("train_gpt2.py", ["--data_dir", "no/such/folder"], "error: data_dir no/such/folder: no such directory (prepare"),
    ("eval_lm.py", ["out/run"], "error: --tasks: needed without --card"),
], ids=["unknown key", "bad YAML value", "missing data_dir", "eval_lm without --tasks"])
def test_a_configuration_error_is_one_line_before_torch_is_imported(script, argv, message, tmp_path):
    """`python train_gpt2.py` with a mistake in its arguments or the folders they name says so within 3 s on the
    reference machine: it took 17-33 s, importing torch and the training stack first (eval_lm.py's arguments
    likewise). Here torch cannot be imported at all (a stand-in fails), so the line is seen to need none of it."""
    import os
    import subprocess
    import sys
    import time

    from slowness import guard

    (tmp_path / "bad.yaml").write_text("max_lr: [0.1, 0.2]\n")
    (tmp_path / "no_torch" / "torch").mkdir(parents=True)
    (tmp_path / "no_torch" / "torch" / "__init__.py").write_text(
        "raise ImportError('torch was imported before the configuration was checked')\n")
    env = {key: value for key, value in os.environ.items() if key not in (*RANKS, "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(tmp_path / "no_torch")  # ahead of the installed packages
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / script), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=guard(60))
    took = time.perf_counter() - started
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-2000:]
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert took < guard(3), f"{took:.1f} s"


CONFIG_CASES = [
    (["--n_layer", "x"], "error: n_layer: expected an integer or null, got 'x'"),
    (["--micro_batch_size", "x"], "error: micro_batch_size: expected an integer or auto, got 'x'"),  # as --help
    (["--learning_rate", "1e-3"], "error: learning_rate: unknown config key"),
    (["--model", "gpt3"], "error: model: unknown model 'gpt3'"),
    (["--seq_len", "64"], "error: seq_len: 64 exceeds block_size 32"),
    (["--resume", "/no/such/step_00000100.pt"], "error: resume: no checkpoint file or folder at '/no/such/step_00000100.pt'"),
    (["--config", "/no/such.yaml"], "error: config: no such file /no/such.yaml"),
]


@pytest.mark.parametrize("extra,message", CONFIG_CASES, ids=[c[1][7:40] for c in CONFIG_CASES])
def test_bad_config_is_one_line_and_exit_code_2(tmp_path, extra, message, capfd):
    """`python train_gpt2.py ARGS` in this process: main through run_cli, as its __main__ does."""

    assert train_here(base_args(tmp_path, tmp_path / "out") + extra) == 2
    stderr = capfd.readouterr().err
    assert stderr.strip().splitlines() == [message] or stderr.strip().startswith(message), stderr


@pytest.mark.slow
def test_unreadable_resume_checkpoint_fails_on_every_rank(tmp_path):
    data = make_shards(tmp_path / "shards")
    bogus = tmp_path / "step_00000003.pt"
    bogus.write_bytes(b"not a checkpoint")
    proc = run_trainer(base_args(data, tmp_path / "out", resume=bogus), nproc=2, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step_00000003.pt: unreadable checkpoint" in errors[0], proc.stderr[-3000:]
    assert proc.exitcodes == [2, 2]


ENTRY_POINT_CASES = [
    ("sample", ["--ckpt", "x.pt", "--num_samples", "0"], "--num_samples: must be >= 1, got 0"),
    ("sample", ["--ckpt", "x.pt", "--top_k", "-1"], "--top_k: must be >= 0, got -1"),
    ("sample", ["--ckpt", "x.pt", "--device", "cuda"], "device: cuda requested but CUDA is not available"),
    ("sample", ["--ckpt", "x.pt", "--device", "tpu"], "device: unknown device 'tpu'"),
    ("sample", ["--ckpt", "x.pt", "--max_new_tokens", "ten"], "sample.py: argument --max_new_tokens: invalid int"),
    ("sample", [], "sample.py: the following arguments are required: --ckpt"),
    ("sample", ["--ckpt", "no/such.pt"], "no/such.pt: no such checkpoint"),
    ("export_hf", ["only_one_argument"], "export_hf.py: the following arguments are required: out_dir"),
    ("scripts.bench", ["--warmup", "0"], "--warmup and --steps must be at least 1"),
    ("scripts.bench", ["--micro_batch_size", "x"], "micro_batch_size: expected an integer"),
]


@pytest.mark.parametrize("script,argv,message", ENTRY_POINT_CASES, ids=[f"{c[0]} {' '.join(c[1])}"[:40] for c in ENTRY_POINT_CASES])
def test_every_entry_point_answers_bad_input_with_one_line_and_exit_2(script, argv, message, capfd, monkeypatch):
    """What `python SCRIPT.py ARGS` does: its main through run_cli (in this process, on a CPU-only view)."""
    import importlib

    import torch

    from common.errors import run_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli(importlib.import_module(script).main, argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


# Every path argument of the entry points, given '' (an unset shell variable) beside an argument that the script,
# had it taken '' for the current folder (or for its default), would refuse before writing anything
EMPTY_PATH_CASES = [
    ("sample", ["--ckpt", ""], "--ckpt"),
    ("eval_lm", [""], "ckpt"),
    *[("eval_lm", ["no/such.pt", option, ""], option) for option in ("--data_dir", "--include_path", "--out_dir")],
    ("export_hf", ["", "hf"], "ckpt"),
    ("export_hf", ["no/such.pt", ""], "out_dir"),
    ("compare_runs", ["--a", "", "--b", "no/such"], "--a"),
    ("compare_runs", ["--a", "no/such", "--b", ""], "--b"),
    ("compare_runs", ["--a", "no/such", "--b", "no/such", "--json", ""], "--json"),
    ("plot_log", [""], "OUT_DIR"),
    ("plot_log", ["no/such", "-o", ""], "-o/--output"),
    ("consolidate_checkpoint", ["", "out.pt"], "ckpt"),
    ("consolidate_checkpoint", ["no/such/step_00000001", ""], "out"),
    ("prep.fineweb", ["--out", "", "--shard_size", "0"], "--out"),
    ("prep.fineweb", ["--input", "", "--shard_size", "0"], "--input"),
    ("prep.hellaswag", ["--out", "", "--url", "file:///no/such.jsonl"], "--out"),
    ("prep.shakespeare", ["--out", "", "--val_size", "0"], "--out"),
    ("prep.shakespeare", ["--cache", "", "--val_size", "0"], "--cache"),
]


@pytest.mark.parametrize("script,argv,argument", EMPTY_PATH_CASES,
                         ids=[f"{c[0]} {c[2]}" for c in EMPTY_PATH_CASES])
def test_an_entry_points_empty_path_is_one_line_naming_the_argument(script, argv, argument, capfd, monkeypatch,
                                                                     tmp_path):
    """'' was the current folder (export_hf wrote the model there) or the default (prep's --out): refused at once."""
    import importlib

    from common.errors import run_cli

    monkeypatch.chdir(tmp_path)  # where '' would have pointed
    assert run_cli(importlib.import_module(script).main, argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"argument {argument}: '' names no file or folder" in err, err
    assert not any(tmp_path.iterdir())


def test_entry_points_end_with_run_cli():
    """Every script's __main__ goes through the same wrapper (so the in-process test above is what runs)."""
    for script in ("train_gpt2.py", "sample.py", "export_hf.py", "scripts/bench.py", "plot_log.py", "eval_lm.py",
                   "compare_runs.py", "prep/fineweb.py", "prep/shakespeare.py", "prep/hellaswag.py"):
        assert "run_cli(" in (REPO / script).read_text().split('if __name__ == "__main__":')[1], script


def tiny_checkpoint(tmp_path, drop: str | None, checkpoint_format: str = "file") -> tuple:
    """A real checkpoint of the tiny model (step 0, written by the Checkpointer) without entry `drop`; data and path."""
    import json

    import torch

    from launch.components import make_checkpointer

    data = make_shards(tmp_path / "shards")
    cfg, ctx, run = build_tiny_run(data, tmp_path / "source", checkpoint_format=checkpoint_format)
    checkpointer = make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run)
    checkpointer.wait()
    if checkpoint_format == "sharded":
        path = tmp_path / "source" / "checkpoints" / "step_00000000"
        if drop:
            commit = json.loads((path / "checkpoint.json").read_text())
            del commit[drop]
            (path / "checkpoint.json").write_text(json.dumps(commit))
        return data, path
    path = tmp_path / "source" / "checkpoints" / "step_00000000.pt"
    if drop:
        state = torch.load(path, weights_only=True)
        del state[drop]
        torch.save(state, path)
    return data, path


@pytest.mark.parametrize("drop,checkpoint_format", [("optimizer", "file"), ("tokens_seen", "file"), ("config", "file"),
                                                    ("model_args", "file"), ("tokens_seen", "sharded"),
                                                    ("model_args", "sharded")])
def test_resuming_a_checkpoint_without_an_entry_names_the_file_and_the_entry(tmp_path, drop, checkpoint_format, capfd):

    data, path = tiny_checkpoint(tmp_path, drop, checkpoint_format)
    assert train_here(base_args(data, tmp_path / "out", resume=path)) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"error: {path}: checkpoint has no '{drop}' entry" in err, err


@pytest.mark.parametrize("script", ["sample", "export_hf", "eval_lm"])
def test_reading_a_checkpoint_without_model_args_names_the_file_and_the_entry(tmp_path, script, capfd):
    import importlib

    from common.errors import run_cli

    _, path = tiny_checkpoint(tmp_path, "model_args")
    argv = {"sample": ["--ckpt", str(path), "--device", "cpu"], "export_hf": [str(path), str(tmp_path / "hf")],
            "eval_lm": [str(path), "--tasks", "hellaswag_fixture", "--include_path",
                        str(REPO / "tests" / "fixtures" / "lm_eval"), "--device", "cpu"]}[script]
    assert run_cli(importlib.import_module(script).main, argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"error: {path}: checkpoint has no 'model_args' entry" in err, err


def test_a_prompt_beyond_the_models_vocabulary_is_one_line(tmp_path, capfd):
    """The tiny model's 512 token ids: GPT-2's ids for "Hello" are not among them."""
    import sample
    from common.errors import run_cli

    _, path = tiny_checkpoint(tmp_path, drop=None)
    assert run_cli(sample.main, ["--ckpt", str(path), "--prompt", "Hello", "--device", "cpu"]) == 2
    err = capfd.readouterr().err
    assert err == "error: --prompt: token id 15496 is beyond the model's vocab_size 512\n", err
