"""What a user watches: HellaSwag in the trainer, samples, W&B offline runs, MFU, sample.py."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import GPT2_VOCAB, REPO, TINY_VOCAB, base_args, make_shards, run_trainer, train_losses
from runtime.metrics import model_flops_utilization, peak_flops_for
from common.log_fields import RECORD_FIELDS, TRAIN_METRICS, Metric
from runtime.logger import LOG_ONLY_KINDS, RunLogger, read_log


def hellaswag_fixture(path: Path, n: int = 11) -> Path:
    """A small file in the official HellaSwag jsonl format."""
    rng = random.Random(0)
    lines = []
    for i in range(n):
        ctx = " ".join(rng.choice(["A man", "The woman", "a dog", "runs", "then", "slowly", "the ball"]) for _ in range(5 + i))
        endings = [" ".join(rng.choice(["jumps", "over", "it", "and", "falls", "smiles"]) for _ in range(2 + j)) for j in range(4)]
        lines.append(json.dumps({"ind": i, "activity_label": "Sports", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                                 "endings": endings, "label": rng.randrange(4), "split": "val",
                                 "split_type": "indomain", "source_id": f"fixture-{i}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def wandb_records(run_dir: Path):
    """Decode the records of an offline W&B run file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, partial = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial + chunk)
            partial = b""
            yield record
        elif kind in (2, 3):  # first or middle piece
            partial += chunk
        elif kind == 0:
            pos += block - pos % block


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


# --- W&B in this process, offline: what the logger sends and what W&B stores --------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline and silent, its folders in tmp_path: never the network, nothing left in $HOME."""
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "run"


def start_logger(out: Path, start_step: int, run_id: str | None = None) -> RunLogger:
    logger = RunLogger(enabled=True)
    logger.open_run_folder(out, start_step, {})
    logger.start_wandb("test", "rewinds", "offline", {}, [], run_id, out)
    return logger


def end_launch(logger: RunLogger) -> None:
    """What the end of a trainer's process does to W&B: the run finished, and W&B's service, which writes
    the offline run file, shut down (finish() alone may return before the service wrote the file's last
    records: seen once in a loaded full suite)."""
    import wandb

    logger.close()
    wandb.teardown()


def train_steps(logger: RunLogger, steps, offset: float) -> None:
    for step in steps:
        logger.log({"kind": "train", "step": step, "loss": offset + step, "lr": 0.5})


def wandb_rows(out: Path) -> list[dict]:
    """The history rows of every offline W&B run file in out, in the order they were logged (file by file)."""
    return [row for run_dir in sorted((out / "wandb").glob("offline-run-*")) for row in wandb_history(run_dir)]


def kept_rows(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The numbers of the rows a user keeps by the rule the logger follows: a `rewind/to_step` row
    supersedes every row logged before it at or past that trainer/step, except rollback rows."""
    kept: list[dict] = []
    for row in rows:
        if "rewind/to_step" in row:
            kept = [r for r in kept if r["trainer/step"] < row["rewind/to_step"] or "rollback/from_step" in r]
        else:
            kept.append(row)
    found: dict[str, list[tuple[int, float]]] = {}
    for row in kept:
        for key, value in row.items():
            if key != "trainer/step" and key.count("/") == 1 and isinstance(value, (int, float)):  # not a sample's
                found.setdefault(key, []).append((row["trainer/step"], value))
    return found


def numbers_of_the_log(path: Path) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for r in read_log(path):
        if r["kind"] in LOG_ONLY_KINDS:  # log.jsonl's own bookkeeping
            continue
        for key, value in r.items():
            if key not in RECORD_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
                found.setdefault(f"{r['kind']}/{key}", []).append((r["step"], value))
    return found


def test_after_a_rollback_wandb_holds_every_record_and_marks_the_rewound_steps(wandb_offline):
    """A rollback from step 8 to the checkpoint of step 6, twice. W&B cannot drop rows it holds (an
    offline run cannot rewind): every record arrives against W&B's own step with its trainer/step, and
    a rewind row marks where the rows of the steps redone stop counting."""
    logger = start_logger(wandb_offline, 0)
    train_steps(logger, range(9), 0.0)
    logger.log({"kind": "skip", "step": 7, "loss": 70.0})
    logger.log({"kind": "sample", "step": 8, "text": "ROMEO: hello"})
    logger.log({"kind": "sample", "step": 8, "text": "JULIET: hi"})
    for attempt in (1, 2):
        logger.rewind(6)
        logger.log({"kind": "rollback", "step": 6, "from_step": 8, "tokens": 3072 * attempt})
        train_steps(logger, range(6, 9), 100.0 * attempt)
    end_launch(logger)
    rows = wandb_rows(wandb_offline)
    assert [row["_step"] for row in rows] == list(range(len(rows)))  # W&B's own step: nothing was dropped
    losses = [(row["trainer/step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert losses == [(s, s) for s in range(9)] + [(s, 100 + s) for s in range(6, 9)] + [(s, 200 + s) for s in range(6, 9)]
    assert [row["trainer/step"] for row in rows if "sample/text/path" in row] == [8, 8]  # both samples, a row each
    assert [(row["trainer/step"], row["rewind/to_step"], row["rewind/dropped_records"])
            for row in rows if "rewind/to_step" in row] == [(6, 6, 6), (6, 6, 3)]
    assert [row["rollback/tokens"] for row in rows if "rollback/tokens" in row] == [3072, 6144]
    assert kept_rows(rows) == numbers_of_the_log(wandb_offline / "log.jsonl")  # the rule gives back the log
    (run_dir,) = (wandb_offline / "wandb").glob("offline-run-*")
    axes = {r.metric.glob_name: r.metric.step_metric for r in wandb_records(run_dir)
            if r.WhichOneof("record_type") == "metric" and r.metric.glob_name}
    assert axes == {f"{kind}/*": "trainer/step" for kind in ("train", "skip", "sample", "rewind", "rollback")}


def test_a_resumed_wandb_run_starts_with_a_rewind_row_when_the_log_dropped_records(wandb_offline):
    first = start_logger(wandb_offline, 0)
    train_steps(first, range(8), 0.0)
    run_id = first.wandb_run_id
    end_launch(first)  # stopped after step 7; the newest checkpoint is step 5's
    resumed = start_logger(wandb_offline, 5, run_id)
    train_steps(resumed, range(5, 8), 100.0)
    end_launch(resumed)
    run_dirs = sorted((wandb_offline / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(run_id in d.name for d in run_dirs)  # offline: a file per launch
    rows = wandb_history(run_dirs[1])
    assert [(row["trainer/step"], row.get("rewind/to_step"), row.get("train/loss")) for row in rows] == [
        (5, 5, None), (5, None, 105), (6, None, 106), (7, None, 107)]
    assert kept_rows(wandb_rows(wandb_offline)) == numbers_of_the_log(wandb_offline / "log.jsonl")

    again = start_logger(wandb_offline, 8, run_id)  # resumed where the log ends: nothing to mark
    end_launch(again)
    assert wandb_history(sorted((wandb_offline / "wandb").glob("offline-run-*"))[2]) == []


@pytest.mark.slow
def test_a_rank_ending_without_atexit_leaves_nothing_of_wandb_in_the_temp_dir(tmp_path):
    """`import wandb` makes two folders in the temp dir that only an atexit hook removes; a process
    that ends without it (as ranks forked by tests/forked_ranks.py do, or a killed one) keeps them."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = tmp_path / "run"
    script = ("import os\n"
              "from runtime.logger import RunLogger\n"
              f"logger = RunLogger(enabled=True)\n"
              f"logger.open_run_folder({str(out)!r}, 0, {{}})\n"
              f"logger.start_wandb('test', '', 'offline', {{}}, [], None, {str(out)!r})\n"
              "logger.log({'kind': 'sample', 'step': 0, 'text': 'ROMEO: hello'})\n"
              "logger.close()\n"
              "os._exit(0)\n")
    env = dict(os.environ, TMPDIR=str(temp), PYTHONPATH=str(REPO), WANDB_SILENT="true", WANDB_MODE="offline",
               **{name: str(tmp_path / name.lower()) for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
    env.pop("WANDB_API_KEY", None)
    subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, check=True, timeout=120)
    deadline = time.monotonic() + 30  # W&B's service removes its socket's folder once it sees the process gone
    while list(temp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(temp.iterdir()) == []
    assert sorted(p.name[11:] for p in (out / "wandb").glob("tmp*")) == ["wandb-artifacts", "wandb-media"]  # with the run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank and one single-process run with HellaSwag, samples and W&B offline."""
    root = tmp_path_factory.mktemp("observe")
    data = make_shards(root / "shards")
    hellaswag = hellaswag_fixture(root / "hellaswag_val.jsonl")
    common = dict(dtype="float64", hellaswag_interval=3, hellaswag_path=hellaswag, sample_interval=3, vocab_size=GPT2_VOCAB,
                  sample_count=2, sample_tokens=6, wandb="true", wandb_mode="offline", wandb_project="test",
                  wandb_run_name="observe")
    secret = {"WANDB_API_KEY": "k" * 40 + "SECRET"}
    run_trainer(base_args(data, root / "ddp", **common), nproc=2, extra_env=secret)
    # offline from the environment alone, as W&B's own tools take it (wandb_mode auto)
    single = {key: value for key, value in common.items() if key != "wandb_mode"}
    run_trainer(base_args(data, root / "single", **single), extra_env={**secret, "WANDB_MODE": "offline"})
    return root, data, common


@pytest.mark.slow
def test_hellaswag_in_the_trainer_is_identical_for_one_and_two_ranks(runs):
    root, _, _ = runs
    results = {d: [r for r in read_log(root / d / "log.jsonl") if r["kind"] == "hellaswag"] for d in ("ddp", "single")}
    assert [r["step"] for r in results["ddp"]] == [0, 3, 6]
    for a, b in zip(results["ddp"], results["single"]):
        assert (a["acc_norm"], a["acc"], a["n"]) == (b["acc_norm"], b["acc"], b["n"])
        assert a["n"] == 11


@pytest.mark.slow
def test_samples_are_written_once_by_rank_zero(runs):
    root, _, _ = runs
    samples = [r for r in read_log(root / "ddp" / "log.jsonl") if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [3, 3, 6, 6]
    assert all(r["text"].startswith("Hello, I'm a language model,") for r in samples)
    single = [r["text"] for r in read_log(root / "single" / "log.jsonl") if r["kind"] == "sample"]
    assert single == [r["text"] for r in samples]  # seeded: the same continuations for any world size


@pytest.mark.parametrize("setting, environment, mode", [
    (None, None, "online"), (None, "offline", "offline"), (None, "dryrun", "offline"), (None, " Disabled ", "disabled"),
    ("online", "offline", "online"), ("disabled", "bogus", "disabled")])
def test_wandb_mode_auto_takes_the_environments_mode(monkeypatch, setting, environment, mode):
    """--wandb_mode wins; unset (auto) it is WANDB_MODE's, as W&B's own tools take it, else online."""
    from runtime.logger import wandb_mode_of

    if environment is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", environment)
    assert wandb_mode_of(setting) == mode


def test_an_unknown_wandb_mode_in_the_environment_is_one_error_naming_it(monkeypatch, tmp_path):
    from common.errors import ConfigError
    from launch.config import parse_args

    monkeypatch.setenv("WANDB_MODE", "bogus")
    parse_args(base_args(tmp_path, tmp_path / "out"))  # W&B off: the variable is none of the run's business
    with pytest.raises(ConfigError, match=r"^WANDB_MODE: unknown mode 'bogus' in the environment"):
        parse_args(base_args(tmp_path, tmp_path / "out", wandb="true"))


@pytest.mark.slow
def test_a_wandb_start_that_fails_writes_nothing_into_the_run_folder(tmp_path):
    """No API key for an online run: one error line, and no config.yaml, run.json or empty log.jsonl of a run that
    never ran (nor the run folder this launch made)."""
    data = make_shards(tmp_path / "shards")
    out = tmp_path / "out"
    env = {"HOME": str(tmp_path), "WANDB_MODE": "online", "WANDB_API_KEY": ""}  # no key, nor ~/.netrc
    proc = run_trainer(base_args(data, out, wandb="true"), check=False, extra_env=env, timeout=60)
    assert proc.returncode == 2 and "error: wandb: could not start the run" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.slow
def test_wandb_offline_history_holds_the_logged_metrics_and_no_api_key(runs):
    root, _, _ = runs
    assert len(list((root / "single" / "wandb").glob("offline-run-*"))) == 1  # WANDB_MODE=offline alone
    (run_dir,) = (root / "ddp" / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    logged = {row["trainer/step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert logged == train_losses(root / "ddp")
    val = {row["trainer/step"]: row["val/loss"] for row in history if "val/loss" in row}
    assert sorted(val) == [0, 3, 6]
    logged_bpb = {r["step"]: r["bpb"] for r in read_log(root / "ddp" / "log.jsonl") if r["kind"] == "val"}
    assert {row["trainer/step"]: row["val/bpb"] for row in history if "val/bpb" in row} == logged_bpb
    assert any("hellaswag/acc_norm" in row for row in history)
    assert any("train/tokens_per_sec" in row and "train/grad_norm" in row for row in history)
    # the API key comes from the environment only: never in the run folder or a checkpoint
    for path in (root / "ddp").rglob("*"):
        if path.is_file():
            assert b"SECRET" not in path.read_bytes(), path


@pytest.mark.slow
def test_resume_continues_the_same_wandb_run(runs, tmp_path):
    root, data, common = runs
    out = tmp_path / "resumed"
    run_trainer(base_args(data, out, **{**common, "max_steps": 3}))
    first_id = torch.load(out / "checkpoints" / "step_00000003.pt", weights_only=True)["wandb_run_id"]
    run_trainer(base_args(data, out, **common))
    assert torch.load(out / "checkpoints" / "step_00000006.pt", weights_only=True)["wandb_run_id"] == first_id
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(first_id) for d in run_dirs)
    resumed_steps = [row["trainer/step"] for row in wandb_history(run_dirs[1]) if "train/loss" in row]
    assert resumed_steps == [3, 4, 5]  # the resumed part logs the steps after the checkpoint, once


def test_mfu_is_reported_against_the_peak_and_lookup_table():
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("NVIDIA GeForce RTX 4090") == 165.2e12
    assert peak_flops_for("NVIDIA H200") == 989.4e12
    assert peak_flops_for("Some Future GPU") is None
    # GPT-2 124M at T=1024: ~ 6 * 124M + 12 * 12 * 12 * 64 * 1024 FLOPs per token
    assert model_flops_utilization(8.5e8, 468_000, 1, 989.4e12) == pytest.approx(8.5e8 * 468_000 / 989.4e12)
    assert model_flops_utilization(8.5e8, 468_000, 8, 989.4e12) == pytest.approx(8.5e8 * 468_000 / 989.4e12 / 8)


@pytest.mark.slow
def test_train_records_carry_throughput_and_mfu_with_a_peak_override(tmp_path):
    data = make_shards(tmp_path / "shards")
    proc = run_trainer(base_args(data, tmp_path / "out", max_steps=2, peak_flops=1e12))  # warmup_steps 2
    # the console (issue 44): where the run is, its time so far and to go (from the second step: the first one
    # compiles), and one warning for a schedule that never leaves its warmup
    # (issue 53) one step count: the line after the 2nd update says step 2, as the val loss of the model it made does
    lines = [line for line in proc.stdout.splitlines() if re.match(r"step +\d+[/ ]", line)]
    figures = r"\| loss \d+\.\d{4} \| lr [\d.e+-]+ \| norm +[\d.]+ \| +[\d.]+ ms \| +[\d,]+ tok/s \| mfu +[\d.]+%"
    assert lines[0].startswith("step      0 | val loss ") and lines[3].startswith("step      2 | val loss "), lines
    assert re.fullmatch(rf"step 1/2 \( 50\.0%\) {figures} \| elapsed \d+s", lines[1]), lines
    assert re.fullmatch(rf"step 2/2 \(100\.0%\) {figures} \| elapsed \d+s \| eta 0s", lines[2]), lines
    assert [line for line in proc.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: warmup_steps 2 >= max_steps 2: the schedule never leaves its warmup; the lr goes from 1.500e-03 at "
        "step 0 to 3.000e-03 at the last step (max_lr 0.003) and never decays; lower warmup_steps"]
    records = [r for r in read_log(tmp_path / "out" / "log.jsonl") if r["kind"] == "train"]
    from model import GPT, GPTConfig

    flops = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, vocab_size=TINY_VOCAB)).estimate_flops_per_token(32)
    for r in records:
        assert r["tokens_per_sec"] == pytest.approx(512 / (r["step_ms"] / 1000))
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_sec"] / 1e12)
    assert [r["tokens"] for r in records] == [512, 1024]
    startup = [r for r in read_log(tmp_path / "out" / "log.jsonl") if r["kind"] == "startup"]
    assert len(startup) == 1 and 0 < startup[0]["seconds_to_first_step"] < 120


@pytest.mark.slow
def test_sample_py_generates_from_a_checkpoint_like_the_model(runs):
    root, _, _ = runs
    cmd = [sys.executable, str(REPO / "sample.py"), "--ckpt", str(root / "single"), "--prompt", "Hello",
           "--max_new_tokens", "8", "--num_samples", "2", "--temperature", "0", "--device", "cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "# step 6 of" in out and out.count("--- sample") == 2
    from sample import load_model
    from data.tokenizer import get_tokenizer

    model, _ = load_model(str(root / "single"), torch.device("cpu"))
    enc = get_tokenizer()
    greedy = model.generate(torch.tensor([enc.encode("Hello")]), 8, temperature=0, valid_vocab=50257)
    assert enc.decode(greedy[0].tolist()) in out
    seeded = [subprocess.run(cmd[:-4] + ["--seed", "3", "--device", "cpu"], capture_output=True, text=True).stdout
              for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.slow
def test_every_run_records_what_produced_it(runs):
    import subprocess as sp

    root, _, _ = runs
    record = json.loads((root / "ddp" / "run.json").read_text())
    head = sp.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["git_commit"] == head and isinstance(record["git_dirty"], bool)
    assert record["torch"] == torch.__version__ and record["world_size"] == 2 and record["device_count"] == 1
    assert record["command"].startswith("train_gpt2.py --model custom") and len(record["config_sha256"]) == 64
    assert len(record["data_fingerprint"]) == 16
    assert (record["device"], record["dtype"], record["cpu_capability"]) == ("cpu", "float64",
                                                                             torch.backends.cpu.get_cpu_capability())
    assert record["cpu"] and record["cpu"] != "cpu"
    saved = torch.load(root / "ddp" / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert saved["provenance"] == record
    (run_dir,) = (root / "ddp" / "wandb").glob("offline-run-*")
    configs = [json.loads(item.value_json) for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"
               for item in r.run.config.update if item.key == "provenance"]
    assert configs and configs[0] == record


# --- the console (issue 44) -----------------------------------------------------------------------------------

def test_a_metric_the_step_records_reaches_the_log_each_sink_and_the_step_line(shards, wandb_offline, monkeypatch,
                                                                                 capsys):
    """common/log_fields.py's train_metric (issue 54): what the step records (a test's share, a tensor on the
    device) is a field of that step's train record, train/<name> in TensorBoard and W&B at the step, and on the
    step line as its declaration shows it, after the peak memory."""
    from conftest import build_tiny_run, train_loop
    from test_tensorboard import scalars
    from runtime.context import Context
    from training.distributed.preemption import PreemptionFlag
    from runtime.recorder import record_metric
    from training.run import lockstep

    share = Metric("test_share", "mean", "share {:.0%}".format)
    monkeypatch.setitem(TRAIN_METRICS, share.name, share)
    step_math = lockstep.train_step

    def recording(run, *args):
        record_metric(share, torch.tensor(run.step / 4))
        return step_math(run, *args)

    monkeypatch.setattr(lockstep, "train_step", recording)
    cfg, ctx, run = build_tiny_run(shards, wandb_offline, max_steps=3, eval_interval=0, checkpoint_interval=0,
                                   final_checkpoint="false")
    logger = start_logger(wandb_offline, 0)
    logger.start_tensorboard(wandb_offline / "tensorboard", 0)
    train_loop(cfg, Context(ctx.env, ctx.runtime, logger), run, PreemptionFlag(), record={})
    end_launch(logger)
    shares = [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [(r["step"], r["test_share"]) for r in read_log(wandb_offline / "log.jsonl") if r["kind"] == "train"] == shares
    assert scalars(wandb_offline / "tensorboard")["train/test_share"] == shares
    (run_dir,) = (wandb_offline / "wandb").glob("offline-run-*")
    assert [(row["trainer/step"], row["train/test_share"]) for row in wandb_history(run_dir)
            if "train/test_share" in row] == shares
    lines = [line for line in capsys.readouterr().out.splitlines() if " tok/s " in line]
    assert [line.split(" tok/s | ")[1].split(" | elapsed")[0] for line in lines] == ["share 0%", "share 25%", "share 50%"]


def test_the_step_line_says_where_the_run_is_its_peak_memory_and_its_time():
    from runtime.logger import format_duration, format_train_line

    record = {"step": 1199, "loss": 4.18734, "lr": 6e-4, "grad_norm": 0.412, "step_ms": 1105.3,
              "tokens_per_sec": 474350.0, "mfu": 0.413, "peak_mem_gb": 31.24}
    assert format_train_line(record, 19073, 3725, 61234.0) == (
        "step  1200/19073 (  6.3%) | loss 4.1873 | lr 6.000e-04 | norm  0.412 |   1105.3 ms |    474,350 tok/s | "
        "mfu  41.3% | mem  31.2 GiB | elapsed 1h02m | eta 17h00m")
    # (issue 53) updates done, as the evaluations after them count: the last record, step 19072, is the 19,073rd update
    assert format_train_line({**record, "step": 19072}, 19073, 3725, 0.0).startswith("step 19073/19073 (100.0%) | ")
    cpu = {k: v for k, v in record.items() if k not in ("mfu", "peak_mem_gb")}  # no peak to measure against
    assert format_train_line(cpu, 19073, 59.4, None).endswith("474,350 tok/s | elapsed 59s")
    assert [format_duration(s) for s in (0, 59.4, 60, 725, 3725, 90000)] == ["0s", "59s", "1m00s", "12m05s",
                                                                            "1h02m", "1d01h"]


def test_a_metric_is_recorded_from_the_model_or_after_the_update_in_one_place(shards, tmp_path, monkeypatch):
    """runtime/recorder.py: a hook on the model (during the step: that step's field, the mean over its
    micro-steps; the evaluations' forwards record nothing) and one on the optimizer (after the update: it rides the
    next step's collective, a field of the next step's record) each record a declared metric by name, and nothing
    else is written for either."""
    from conftest import build_tiny_run, lockstep_steps
    from runtime.recorder import record_metric, take_recorded

    during, after = Metric("test_block_rms", "mean"), Metric("test_updated_wte_norm", "max")
    for metric in (during, after):
        monkeypatch.setitem(TRAIN_METRICS, metric.name, metric)
    cfg, ctx, run = build_tiny_run(shards, tmp_path / "run")
    outputs, norms = {}, []  # the block's RMS at each step, by step; wte's norm after each update

    def block_rms(module, inputs, output):
        if module.training:
            outputs.setdefault(run.step, []).append(output.detach().pow(2).mean().sqrt())
            record_metric(during, outputs[run.step][-1])

    wte = run.model.transformer.wte.weight
    run.model.transformer.h[0].register_forward_hook(block_rms)
    run.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: record_metric(after, wte.detach().norm()))
    run.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: norms.append(wte.detach().norm().item()))
    record_metric(during, torch.tensor(99.0))  # before the run's first step: no step's
    results = lockstep_steps(cfg, ctx, run, 3)
    assert [len(outputs[step]) for step in range(3)] == [run.grad_accum_steps] * 3 and run.grad_accum_steps > 1
    assert [r.metrics[during.name] for r in results] == pytest.approx(
        [torch.stack(outputs[step]).mean().item() for step in range(3)], rel=1e-6)
    assert after.name not in results[0].metrics  # nothing was updated before the first step
    assert [r.metrics[after.name] for r in results[1:]] == pytest.approx(norms[:2], rel=1e-6)
    run.model.eval()
    run.model(torch.zeros((1, 8), dtype=torch.long))
    assert list(take_recorded()) == [after]  # the last update's norm waits for a next step; the eval forward: nothing


def test_a_log_read_back_is_its_records_and_a_rewind_keeps_to_them(tmp_path):
    """read_log gives the JSON objects of a log.jsonl: a line torn by a crash and a line holding another JSON value
    are passed over, by the readers (plot_log, compare_runs) and by truncate_log's rewind alike."""
    from runtime.logger import truncate_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"kind": "train", "step": 0}\n[1, 2]\n7\n{"kind": "train", "step": 1}\n{"kind": "tra')
    assert read_log(log) == [{"kind": "train", "step": 0}, {"kind": "train", "step": 1}]
    assert truncate_log(log, 1) == 1 and read_log(log) == [{"kind": "train", "step": 0}]


def test_the_eta_is_the_launchs_pace_since_its_first_step_times_the_steps_left(monkeypatch):
    """Evaluations and checkpoints between the steps count (they recur); the first step, which compiles, not."""
    from types import SimpleNamespace

    from training.run import step_records

    monkeypatch.setattr(step_records.time, "perf_counter", lambda: 130.0)  # 3 steps after the first ended, at 100
    run = SimpleNamespace(model=SimpleNamespace(estimate_flops_per_token=lambda T: 1.0), step=1)
    records = step_records.StepRecords(SimpleNamespace(), run, seq_len=32, total_batch_size=512, max_steps=100,
                                       log_interval=1, hang_timeout_minutes=1.0)
    assert records.eta() is None
    records.steps_taken, records.rate_from = 1, 100.0
    assert records.eta() is None  # one step: no pace yet
    records.steps_taken, run.step = 4, 4
    assert records.eta() == pytest.approx(30.0 / 3 * 96)


def test_a_long_evaluation_shows_its_progress_and_a_short_one_nothing():
    from evals.base import Progress

    now, said = [0.0], []
    progress = Progress("step    250 | val loss", 160, said.append, clock=lambda: now[0])
    for done in range(1, 161):  # 0.1 s a batch: 16 s in all
        now[0] = done * 0.1
        progress(done)
    assert said == ["step    250 | val loss: 50/160 batches (31%) | elapsed 5s | eta 11s",
                    "step    250 | val loss: 150/160 batches (94%) | elapsed 15s | eta 1s"]
    quick = Progress("hellaswag", 10, said.append, clock=lambda: now[0])
    for done in range(1, 11):
        now[0] += 0.1
        quick(done)
    assert len(said) == 2  # under Progress.AFTER_S (5 s): no line


def test_the_val_loss_and_hellaswag_in_the_loop_report_their_progress_on_rank_0(tmp_path, monkeypatch, capsys):
    """The evaluators the trainer builds print through rank 0's console (Progress: no collective, no sync)."""
    from conftest import build_tiny_run
    from evals.base import Progress
    from evals.hellaswag import HellaSwag
    from evals.val_loss import ValLoss

    monkeypatch.setattr(Progress, "AFTER_S", 0.0)
    monkeypatch.setattr(Progress, "EVERY_S", 0.0)  # a line a batch
    data = make_shards(tmp_path / "shards", vocab=GPT2_VOCAB)
    cfg, ctx, run = build_tiny_run(data, tmp_path / "out", vocab_size=GPT2_VOCAB, val_tokens=512,
                                   hellaswag_path=hellaswag_fixture(tmp_path / "hs.jsonl", n=33), hellaswag_interval=5)
    ctx.logger.enabled = True
    settings, seed = cfg.evaluation, cfg.runtime.seed
    assert ValLoss.from_settings(settings, ctx, run.strategy, None, seed).evaluate(run)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"step      0 \| val loss: 1/4 batches \(25%\) \| elapsed \d+s \| eta \d+s", lines[0]), lines
    assert lines[-1].startswith("step      0 | val loss: 3/4 batches (75%)") and len(lines) == 3  # no line once done
    from data.tokenizer import get_tokenizer

    HellaSwag.from_settings(settings, ctx, run.strategy, get_tokenizer(), seed).evaluate(run)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("step      0 | hellaswag: 2/3 batches (67%)") and len(lines) == 2, lines  # 16 a batch


def test_a_hellaswag_that_cannot_be_fetched_is_a_record_of_the_launch_besides_its_warning(tmp_path, monkeypatch,
                                                                                          capsys):
    """log.jsonl says why a run has no HellaSwag curve: one skip_eval record at the launch's first step (not one per
    step it was due), with the reason the warning gives; a rollback's rewind keeps it, as it keeps the startup record."""
    import urllib.error
    import urllib.request

    from conftest import build_tiny_run
    from data.tokenizer import get_tokenizer
    from evals.periodic import PeriodicEvaluation

    def no_network(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setenv("GPT2_REPRO_CACHE", str(tmp_path / "empty_cache"))
    data = make_shards(tmp_path / "shards", vocab=GPT2_VOCAB)
    cfg, ctx, run = build_tiny_run(data, tmp_path / "out", vocab_size=GPT2_VOCAB, hellaswag_interval=1,
                                   eval_interval=0)
    ctx.logger.enabled = True
    ctx.logger.open_run_folder(tmp_path / "out", 0, {})
    evaluation = PeriodicEvaluation(cfg.evaluation, ctx, run.strategy, get_tokenizer(), cfg.runtime.seed)
    for _ in range(2):  # HellaSwag is due at both calls
        assert not evaluation.run_due(run, last_step=False, agree_to_stop=lambda: False)
    ctx.logger.rewind(0)
    ctx.logger.close()
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    (record,) = read_log(tmp_path / "out" / "log.jsonl")
    assert {k: record[k] for k in ("kind", "step", "tokens", "eval")} == {"kind": "skip_eval", "step": 0, "tokens": 0,
                                                                         "eval": "hellaswag"}
    assert record["reason"].startswith("could not fetch ") and "Temporary failure in name resolution" in record["reason"]
    assert warning == f"warning: hellaswag eval skipped: {record['reason']}; run `python prep/hellaswag.py` where " \
                      f"there is internet, or set hellaswag_path"
    assert isinstance(record["time"], float)
