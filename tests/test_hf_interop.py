"""Hugging Face interop: import parity, export parity, tokenizer files, init_from, refusals.

Everything is offline: the "pretrained" GPT-2 is a tiny random transformers model saved into a
temp folder, and the Hub is switched off so a preset name fails fast instead of downloading.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub read it
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from conftest import GPT2_VOCAB, REPO, base_args, load_weights, run_trainer  # noqa: E402
from slowness import guard

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from data.loader import ValLoader  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from hf_interop.convert import HFInteropError, gpt_config_from_hf, load_hf_gpt2  # noqa: E402

# The shape of conftest's TINY_MODEL, with a longer position table than its block_size 32.
TINY_HF = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=50257)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VARIED_TEXT = (
    "Héllo wörld! Ça va? naïve café, Zürich 日本語のテキスト 中文 한국어 🤖🎉👍🏽 \t\ttabs\tand\n\nnewlines\r\n"
    "   leading and trailing spaces   \n"
    "x = [1, 22, 333, 4444, 55555]; 3.14159 1e-5 $12,000\n"
    "def f(a, b):\n    return a ** 2 + b  # comment\n"
    "don't they're I'll WE'VE it's she'd you'RE \"quoted\" 'single' — dash… ellipsis   "
)


def hf_logits(model: GPT2LMHeadModel, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits  # (B, T, 50257)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[GPT2LMHeadModel, Path]:
    """A tiny random GPT2LMHeadModel and the folder save_pretrained wrote it to (safetensors).

    initializer_range 0.2 (not 0.02) makes the logits spread over several units, so a wrong
    weight shows in the loss instead of hiding near log(vocab).
    """
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY_HF, initializer_range=0.2)).eval()
    folder = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, data) -> tuple[Path, Path]:
    """(run folder of a 3-step tiny training run, its export by `python export_hf.py`)."""
    root = tmp_path_factory.mktemp("export")
    run = root / "run"
    run_trainer(base_args(data, run, max_steps=3, checkpoint_interval=3, eval_interval=3, vocab_size=GPT2_VOCAB))
    out = root / "hf"
    proc = subprocess.run([sys.executable, str(REPO / "export_hf.py"), str(run), str(out)], cwd=REPO,
                          env=dict(os.environ, **OFFLINE_ENV), capture_output=True, text=True, timeout=guard(120))
    assert proc.returncode == 0, proc.stderr
    return run, out


# --- import -----------------------------------------------------------------------------------


def test_from_pretrained_safetensors_matches_transformers(hf_model):
    model, folder = hf_model
    ours = load_hf_gpt2(str(folder)).eval()
    assert ours.config.vocab_size == 50257 and ours.config.block_size == 64
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = ours(idx)
    torch.testing.assert_close(logits, hf_logits(model, idx), atol=1e-5, rtol=0)


def test_sample_py_reads_a_hugging_face_folder_like_a_checkpoint(hf_model, capfd):
    """`sample.py --ckpt FOLDER` (or a preset name): the same greedy text as our GPT loaded from it."""
    import sample
    from data.tokenizer import get_tokenizer
    from common.errors import run_cli

    _, folder = hf_model
    argv = ["--ckpt", str(folder), "--device", "cpu", "--num_samples", "1", "--max_new_tokens", "5",
            "--temperature", "0", "--prompt", "Hello"]
    assert run_cli(sample.main, argv) == 0
    out = capfd.readouterr().out
    ours = load_hf_gpt2(str(folder)).eval()
    greedy = ours.generate(torch.tensor([get_tokenizer().encode("Hello")]), 5, temperature=0)
    assert out.startswith(f"# Hugging Face GPT-2 {folder}") and get_tokenizer().decode(greedy[0].tolist()) in out


def test_from_pretrained_legacy_bin_matches_transformers(hf_model, tmp_path):
    """An old-style pytorch_model.bin: no `transformer.` prefix, attention buffers, a tied lm_head."""
    model, folder = hf_model
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    state = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["wte.weight"]
    for i in range(TINY_HF["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.ones(64, 64).tril().view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = load_hf_gpt2(str(tmp_path)).eval()
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = ours(idx)
    torch.testing.assert_close(logits, hf_logits(model, idx), atol=1e-5, rtol=0)


@pytest.mark.parametrize("key,value", [
    ("scale_attn_by_inverse_layer_idx", True),
    ("activation_function", "relu"),
    ("layer_norm_epsilon", 1e-6),
    ("n_inner", 100),
    ("tie_word_embeddings", False),
    ("scale_attn_weights", False),
    ("model_type", "gpt_neo"),
])
def test_unsupported_config_fields_are_refused(key, value):
    with pytest.raises(HFInteropError, match=re.escape(f"some/folder: {key}={value!r} is not supported")):
        gpt_config_from_hf({**TINY_HF, key: value}, "some/folder")


def test_numerics_only_and_legacy_config_fields_are_accepted():
    """reorder_and_upcast_attn changes rounding, not the function; old configs spell n_positions n_ctx."""
    legacy = {k: v for k, v in TINY_HF.items() if k != "n_positions"}
    config = gpt_config_from_hf({**legacy, "n_ctx": 48, "reorder_and_upcast_attn": True,
                                 "activation_function": "gelu_pytorch_tanh"}, "old/folder")
    assert (config.block_size, config.vocab_size, config.n_embd) == (48, 50257, 64)


def test_unsupported_config_in_a_folder_names_the_file_and_field(hf_model, tmp_path):
    _, folder = hf_model
    shutil.copytree(folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(HFInteropError, match=r"/m: scale_attn_by_inverse_layer_idx=True is not supported"):
        load_hf_gpt2(str(tmp_path / "m"))


# --- export -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits_and_greedy_text(exported):
    run, out = exported
    state = torch.load(sorted((run / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    ours = GPT(GPTConfig(**state["model_args"]))
    ours.load_state_dict(state["model"])
    ours.eval()
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == 50257 and hf.config.n_positions == 32
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # re-tied on load

    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = ours(idx)
    torch.testing.assert_close(logits[..., :50257], hf_logits(hf, idx), atol=1e-5, rtol=0)

    prompt = torch.tensor([get_tokenizer().encode_ordinary("Hello, I'm a language model,")])  # (1, 8)
    ours_ids = ours.generate(prompt, 20, temperature=0, valid_vocab=50257)
    hf.generation_config.eos_token_id = None  # ours does not stop at <|endoftext|>; compare all 20
    hf_ids = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20)
    assert hf_ids.tolist() == ours_ids.tolist()


@pytest.mark.slow
def test_export_writes_a_model_card_and_a_loadable_config(exported):
    run, out = exported
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\nlibrary_name: transformers\n")
    assert "exported after step 3 (1,536 tokens seen)" in card
    assert "| val_loss |" in card and "| `max_steps` | 3 |" in card
    assert f"lm_eval --model hf --model_args pretrained={out} --tasks hellaswag" in card
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["vocab_size"] == 50257
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # stored once, as transformer.wte.weight
        assert f.get_tensor("transformer.wte.weight").shape == (50257, 64)


@pytest.mark.slow
def test_exported_tokenizer_matches_tiktoken(exported):
    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    reference = get_tokenizer()
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 50256 and len(tokenizer) == 50257
    for text in (VARIED_TEXT, " ", "\n\n\n", "a  b   c    ", "1234567890"):
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode_ordinary(text), text
        assert tokenizer.decode(ids) == text
    # <|endoftext|> in text is the special token, as in sample.py's prompts (lm-eval relies on it)
    text = "The end.<|endoftext|>A new document"
    ids = tokenizer(text)["input_ids"]
    assert ids == reference.encode(text, allowed_special="all") and 50256 in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_export_of_a_missing_checkpoint_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "export_hf.py"), str(tmp_path / "nope.pt"), str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=guard(60))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'nope.pt'}: no such checkpoint"


# --- init_from --------------------------------------------------------------------------------


@pytest.mark.slow
def test_init_from_hf_folder_starts_from_its_weights(hf_model, data, tmp_path):
    """max_lr 0 keeps the weights at their init, so the step-1 checkpoint shows what was loaded."""
    model, folder = hf_model
    run = tmp_path / "run"
    run_trainer(base_args(data, run, init_from=folder, max_steps=1, max_lr=0, min_lr=0, warmup_steps=0,
                          eval_interval=1, checkpoint_interval=1, dtype="float32", vocab_size=GPT2_VOCAB),
                extra_env=OFFLINE_ENV)
    weights = load_weights(run, 1)
    hf = model.state_dict()
    wte = weights["transformer.wte.weight"]  # (50304, 64): 50257 real rows, 47 padding rows at their mean
    torch.testing.assert_close(wte[:50257], hf["transformer.wte.weight"], atol=0, rtol=0)
    torch.testing.assert_close(wte[50257:], hf["transformer.wte.weight"].mean(0).expand(47, -1))
    torch.testing.assert_close(weights["transformer.wpe.weight"], hf["transformer.wpe.weight"][:32], atol=0, rtol=0)
    torch.testing.assert_close(weights["transformer.h.1.mlp.c_fc.weight"], hf["transformer.h.1.mlp.c_fc.weight"].t(),
                               atol=0, rtol=0)

    # the step-0 val loss is the HF model's own loss on the same window (padding rows cost <= 0.1%)
    logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    val0 = next(r["loss"] for r in logged if r["kind"] == "val" and r["step"] == 0)
    losses, count = 0.0, 0
    for _, x, y in ValLoader(data, 32, 256, 4).batches():
        with torch.no_grad():
            losses += model(x).logits.flatten(0, 1).log_softmax(-1).gather(1, y.view(-1, 1)).sum().item()
        count += y.numel()
    hf_loss = -losses / count
    assert abs(hf_loss - 10.83) > 0.5  # far from a uniform guess: the check below means something
    assert abs(val0 - hf_loss) < 2e-3


@pytest.mark.slow
def test_init_from_shape_mismatch_names_the_key(hf_model, data, tmp_path):
    _, folder = hf_model
    args = base_args(data, tmp_path / "run", init_from=folder, max_steps=1, vocab_size=GPT2_VOCAB)
    args[args.index("--n_embd") + 1] = "32"
    proc = run_trainer(args, check=False, extra_env=OFFLINE_ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: init_from: n_embd: {folder} has n_embd=64 but this run has n_embd=32"


@pytest.mark.slow
def test_init_from_preset_offline_is_a_one_line_error(data, tmp_path):
    args = base_args(data, tmp_path / "run", init_from="gpt2", max_steps=1, vocab_size=GPT2_VOCAB)
    proc = run_trainer(args, check=False, extra_env={**OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: init_from: gpt2: could not fetch openai-community/gpt2")


def test_the_report_card_of_a_hugging_face_model_is_that_of_its_transformers_logits(hf_model, data, tmp_path, capfd,
                                                                                     monkeypatch):
    """`eval_lm.py FOLDER --card` (as for `gpt2`, OpenAI's weights): val loss and bpb equal transformers' own
    cross-entropy on the same 8 rows of 32 tokens, and the fixture task's acc the in-loop HellaSwag's."""
    pytest.importorskip("lm_eval")
    import numpy as np
    import torch.nn.functional as F

    from common.errors import run_cli
    from data.tokenizer import EOT_TOKEN
    from eval_lm import main
    from evals.hellaswag import HellaSwag
    from runtime.process_group import DistEnv

    model, folder = hf_model
    fixtures = REPO / "tests" / "fixtures" / "lm_eval"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv = [str(folder), "--card", "--data_dir", str(data), "--seq_len", "32", "--val_tokens", "256", "--tasks",
            "hellaswag_fixture", "--include_path", str(fixtures), "--device", "cpu", "--dtype", "float32",
            "--out_dir", str(tmp_path)]
    assert run_cli(main, argv) == 0
    card = json.loads((tmp_path / "report.json").read_text())
    tokens = torch.from_numpy(np.load(next(data.glob("*_val_*.npy"))).astype(np.int64)[:8 * 32 + 1])
    x, y = tokens[:-1].view(8, 32), tokens[1:].view(8, 32)
    loss_sum = F.cross_entropy(hf_logits(model, x).flatten(0, 1), y.flatten(), reduction="sum").item()
    n_bytes = len(get_tokenizer().decode_bytes([t for t in y.flatten().tolist() if t != EOT_TOKEN]))
    (val,) = card["val"]
    assert val["loss"]["value"] == pytest.approx(loss_sum / 256, rel=1e-5)
    assert val["bpb"]["value"] == pytest.approx(loss_sum / (n_bytes * math.log(2)), rel=1e-5) and val["bytes"] == n_bytes
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)
    in_loop = HellaSwag(str(fixtures / "hellaswag_fixture.jsonl"), 0, env, get_tokenizer()).accuracy(
        load_hf_gpt2(str(folder)).eval())
    assert card["tasks"]["hellaswag_fixture"]["value"] == in_loop["acc"]
    assert card["model"] == {"name": f"Hugging Face GPT-2 {folder}", "hf_model": str(folder)}
    assert f"# Report card: Hugging Face GPT-2 {folder}" in capfd.readouterr().out
