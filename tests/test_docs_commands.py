"""Every command the documentation shows works as shown: README.md, docs/*.md, and every entry point's --help.

The commands are read from the documents themselves (```bash blocks, and inline `python ...`, `bash ...`,
`make ...` spans that name a file of the repository) and from the example lines of each --help, so a command
added to them is covered without a change here. Each one is checked the cheapest way that would catch it
breaking:

- a Python entry point of this repository: its own argument parser reads the arguments as shown (the
  trainer's: the whole configuration is loaded and validated, config files included), without running it;
  and every entry point's --help works;
- the commands a user runs on a CPU after `make demo` (the README's mixture example, plot_log.py,
  sample.py, export_hf.py) run for real, shrunk: one small run, reused by them all (SHRINK, RUN_FOLDERS);
- torchrun's own options are read by torchrun's parser; `make` targets are the Makefile's; `pip install`
  names what requirements.txt holds; bash scripts' groups and parts are theirs (bench_gpu.sh lists its
  variants without running them);
- what needs a GPU, the network or hours (the 124M run, FineWeb from the Hub, lm-eval's tasks, the GPU
  benchmarks) is read by its parser as above, and never run.

Placeholders the documents use (ARGS, DIR, `[optional]` parts, `...`) are filled in by PLACEHOLDERS; what
cannot be checked here is in EXCEPTIONS, each with its reason.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from forked_ranks import launch

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("python", "torchrun", "bash", "make", "pip", "sbatch", "source", "lm_eval", "git")

# Words of the documents that stand for something the reader fills in, and what the check puts there
# (exact tokens; a list of several tokens, or none).
PLACEHOLDERS = {
    "ARGS": [],  # "any trainer arguments" (PERFORMANCE.md)
    "DIR": ["{tmp}/dir"], "OUT": ["{tmp}/out"], "OUT.pt": ["{tmp}/out.pt"],
    "CHECKPOINT_FOLDER": ["{tmp}/step_00000001"],
    "$HEAD_NODE:29500": ["localhost:29500"], "--rdzv_endpoint=$HEAD_NODE:29500": ["--rdzv_endpoint=localhost:29500"],
    "STRATEGY": ["fsdp"], "SETTING": ["full"], "M": ["gpt2"],
    "--max-restarts=N": ["--max-restarts=3"],
    "HOST": ["localhost"], "PORT": ["29500"], "--rdzv_endpoint=HOST:PORT": ["--rdzv_endpoint=localhost:29500"],
}
# Words a prose sentence abbreviates, and the command they stand for.
TEXT_PLACEHOLDERS = {
    "--config ...": "--config configs/gpt2_124m.yaml",  # README: "one GPU, a Mac or a CPU: python train_gpt2.py --config ..."
    "configs/NAME.yaml": "configs/gpt2_124m.yaml",  # the CONFIGURATION.md synopsis
}
# Fragments a document shows as a synopsis rather than a command: `[--key value | --key=value ...]` and
# `...` alone stand for "more of the same"; they are dropped. Other `[...]` parts are optional arguments:
# checked with them.
SYNOPSIS = re.compile(r"\[[^\[\]]*(?:\.\.\.|\|)[^\[\]]*\]|(?<!\S)\.\.\.(?!\S)")

# What is not checked here, and why.
EXCEPTIONS = {
    # lm-evaluation-harness's own CLI (`lm_eval --model hf ...` on an export): tests/test_lm_eval.py runs it
    "lm_eval": "lm-evaluation-harness's own command line, run by tests/test_lm_eval.py on an export",
    # build-nanogpt, cloned for the GPU check's reference loop (PERFORMANCE.md, benchmarks/gpu_reference.py)
    "git clone": "another repository, cloned over the network for the GPU check's reference loop",
    # make install's probe of PyTorch's CPU wheel index (standard library only, before anything is installed):
    # no argument parser, its one argument a URL it asks over the network
    "python scripts/torch_index.py": "make install's network probe: no parser, its argument is a URL it asks",
    # pip packages that are optional and not in requirements.txt: what to install for a feature (s3:// checkpoints)
    "pip install s3fs": "an optional package for s3:// checkpoint_dir URLs (docs/OPERATIONS.md), not a dependency",
}
# scripts/compare_recipes.py and its README table are being reworked apart from this test (issue 44, item 1):
# its --help is checked, not its documented arguments.
HELP_ONLY = {"scripts/compare_recipes.py"}


@dataclass
class Command:
    text: str  # as shown
    where: str  # file:line, or `SCRIPT --help`

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


# --- reading the commands --------------------------------------------------------------------------------

def commands_of_lines(lines: list[tuple[int, str]], where: str) -> list[Command]:
    """The commands of a block of shell lines (numbered): backslash continuations joined, comments dropped,
    and the block's shell variables (`B=... D=...` lines) substituted into the lines after them."""
    commands, variables, pending, start = [], {}, "", 0
    for number, line in lines:
        line = line.strip()
        if not pending:
            start = number
        line = f"{pending} {line}" if pending else line
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if words and all(re.fullmatch(r"[A-Z_]+=.*", w) for w in words):  # B="..." D=/tmp/x
            variables.update(w.split("=", 1) for w in words)
            continue
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        if words:
            for part in re.split(r"\s#", line)[0].split(" && "):  # `make install && source ...`: two commands
                commands.append(Command(part.strip(), f"{where}:{start}" if start else where))
    return commands


def fenced_commands(path: Path) -> list[Command]:
    """The commands of a document's ```bash blocks, one per line."""
    commands, block, in_block = [], [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            if in_block:
                commands += commands_of_lines(block, str(path.relative_to(REPO)))
            in_block, block = line.strip() == "```bash", []
        elif in_block:
            block.append((number, line))
    return commands


INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:" + "|".join(PROGRAMS) + r") [^`]*)`")


def inline_commands(path: Path) -> list[Command]:
    """Inline `...` spans that are commands: they start with a program and name a file of the repository
    (`make X`, `pip install X` and `source X` always count); a span may run over a line break."""
    text = path.read_text()
    found = []
    for match in INLINE.finditer(text):
        span = " ".join(match.group(1).split())
        words = span.split()
        program = next(w for w in words if not re.fullmatch(r"[A-Z_]+=\S+", w))
        # a script named, whether it exists or not (a command naming one that does not is what this test is for)
        names_a_script = any(w.endswith((".py", ".sh", ".sbatch")) for w in words)
        if program in ("make", "pip", "source") or names_a_script or " -m " in span:
            found.append(Command(span, f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"))
    return found


def indented_commands(path: Path) -> list[Command]:
    """Commands of indented code blocks (the documents use ```bash blocks, but a command written indented is
    checked too): lines indented 4 spaces or more outside ```-blocks that start with a program, with their
    continuation lines."""
    numbered, in_fence, continued = [], False, False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        in_fence = in_fence != line.startswith("```")
        if not in_fence and (continued or re.match(r" {4,}(?:" + "|".join(PROGRAMS) + r") ", line)):
            numbered.append((number, line))
            continued = line.rstrip().endswith("\\")
    return commands_of_lines(numbered, str(path.relative_to(REPO)))


def doc_commands() -> list[Command]:
    return [c for path in DOCS for c in fenced_commands(path) + inline_commands(path) + indented_commands(path)]


# --- the entry points and their --help ------------------------------------------------------------------

ENTRY_POINTS = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("*.py"), *REPO.glob("prep/*.py"),
                                                             *REPO.glob("scripts/*.py"), *REPO.glob("benchmarks/*.py")]
                      if re.search(r"^def main\(", p.read_text(), re.M))


class Parsed(Exception):
    """Raised by the patched argparse once a script's parser has read its arguments: nothing more runs."""

    def __init__(self, extras: list[str]):
        super().__init__(extras)
        self.extras = extras


def call_main(script: str, args: list[str], monkeypatch) -> None:
    """SCRIPT's main with args, as `python SCRIPT args` runs it (main(argv), or main() reading sys.argv)."""
    monkeypatch.syspath_prepend(str((REPO / script).parent))  # python puts the script's folder first
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    monkeypatch.setattr(sys, "argv", [script, *args])
    main = module.main
    main(args) if inspect.signature(main).parameters else main()


def parse_only(script: str, args: list[str], monkeypatch) -> list[str]:
    """Run SCRIPT's main until its argument parser has read args (argparse patched to stop there); what the
    parser left over (parse_known_args: scripts/bench.py's trainer arguments). A usage error raises."""
    parse_known = argparse.ArgumentParser.parse_known_args

    def stop_known(self, args=None, namespace=None):
        raise Parsed(parse_known(self, args, namespace)[1])

    def stop(self, args=None, namespace=None):
        _, extras = parse_known(self, args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        raise Parsed([])

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", stop_known)
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            call_main(script, args, patch)
        except Parsed as parsed:
            return parsed.extras
    raise AssertionError(f"{script} never parsed its arguments")


def help_text(script: str, monkeypatch, capsys) -> str:
    """`python SCRIPT --help`: its output, which must end in exit status 0."""
    try:
        call_main(script, ["--help"], monkeypatch)
        code = 0  # train_gpt2.main returns after printing it
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None) and out.strip(), f"{script} --help: exit {code}\n{err[-2000:]}"
    return out


def help_commands(script: str, text: str) -> list[Command]:
    """The example command lines of a --help: its docstring's indented lines that start with a program (or set
    shell variables for the next ones), with their continuation lines."""
    starts = re.compile(r"^\s+(?:[A-Z_]+=|(?:" + "|".join(PROGRAMS + ("rm",)) + r") )")  # variables, or a program
    lines, continued = [], False
    for line in text.splitlines():
        if continued or starts.match(line):
            lines.append((0, line))
            continued = line.rstrip().endswith("\\")
    return commands_of_lines(lines, f"{script} --help")


# --- from a command's text to its words --------------------------------------------------------------------

def git_python_files() -> list[str]:
    """`$(git ls-files '*.py')` (the README's code corpus); the repository's .py files where git is missing."""
    proc = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.split() if proc.returncode == 0 else [str(p.relative_to(REPO)) for p in REPO.glob("*.py")]


def words_of(command: Command, tmp: Path) -> tuple[dict[str, str], list[str]]:
    """The environment assignments and the words of a command as a shell would run it: synopsis parts
    dropped, optional `[...]` parts kept, placeholders filled in, $(git ls-files) and globs expanded, a
    trailing `&` dropped."""
    text = command.text
    for shown, meant in TEXT_PLACEHOLDERS.items():
        text = text.replace(shown, meant)
    text = SYNOPSIS.sub(" ", text).replace("$(git ls-files '*.py')", " ".join(git_python_files()))
    env, words = {}, []
    for word in shlex.split(text, comments=True):
        if not words and re.fullmatch(r"[A-Z_]+=\S*", word):
            env.update([word.split("=", 1)])
            continue
        word = word.removeprefix("[") if word.startswith("[--") else word
        word = word.removesuffix("]") if word.endswith("]") and "[" not in word else word
        if word in PLACEHOLDERS:
            words += [w.format(tmp=tmp) for w in PLACEHOLDERS[word]]
        elif any(c in word for c in "*?") and sorted(REPO.glob(word)):
            words += [str(p.relative_to(REPO)) for p in sorted(REPO.glob(word))]
        else:
            words.append(word)
    if words and words[-1] == "&":  # started in the background: the command is the same
        words.pop()
    return env, words


# --- the checks ----------------------------------------------------------------------------------------------

def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def check_pip(words: list[str]) -> None:
    assert words[:2] == ["pip", "install"], words
    requirements = {re.split(r"[<>=!~ ]", line)[0] for line in (REPO / "requirements.txt").read_text().splitlines()
                    if line and not line.startswith("#")}
    rest = words[2:]
    if rest[:1] == ["-r"]:
        assert (REPO / rest[1]).is_file(), rest
    elif rest == ["-e", "."]:
        assert (REPO / "pyproject.toml").is_file()
    else:
        for requirement in rest:
            assert re.split(r"[<>=!~ ]", requirement)[0] in requirements, f"{requirement} is not in requirements.txt"


def check_bash(script: str, args: list[str], env: dict[str, str], tmp: Path) -> None:
    path = REPO / script
    assert path.is_file(), f"no {script}"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, f"{script}: not valid bash"
    text = path.read_text()
    if script == "benchmarks/bench_gpu.sh":  # its groups, listed without running a variant
        proc = subprocess.run(["bash", str(path), "-", *args[1:]], capture_output=True, text=True, cwd=REPO,  # RESULTS
                              env={**subprocess.os.environ, **env, "BENCH_LIST": "1"})
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    elif script == "scripts/gpu_check.sh":
        if args[:1] == ["--report"]:
            assert "--report" in text and len(args) >= 3
        else:
            parts = re.search(r'^ALL_PARTS="([^"]+)"', text, re.M).group(1).split()
            assert set(args[1:]) <= set(parts), f"{args[1:]}: not parts of gpu_check.sh ({parts})"
    else:
        assert not args, f"{script} takes no arguments here"


def check_python(words: list[str], tmp: Path, monkeypatch, capsys) -> None:
    if words[0] == "-m":
        assert importlib.util.find_spec(words[1]) is not None, f"no module {words[1]}"
        return
    script, args = words[0], words[1:]
    assert (REPO / script).is_file(), f"no {script}"
    assert script in ENTRY_POINTS, f"{script} is not an entry point (no main)"
    if script in HELP_ONLY:
        help_text(script, monkeypatch, capsys)
    elif script == "train_gpt2.py":  # the whole configuration, validated (config files read, keys checked)
        from launch.config import parse_args, wants_help
        from launch.estimate import estimate_flags, wants_estimate

        if wants_estimate(args):  # --estimate's own flags read (a GPU model of the table), the rest the config's
            _, args = estimate_flags(args)
        wants_help(args) or parse_args(args)
    else:
        extras = parse_only(script, args, monkeypatch)
        if extras:  # scripts/bench.py: its own arguments, then the trainer's
            from launch.config import parse_args

            parse_args(extras)


def check_torchrun(words: list[str], tmp: Path, monkeypatch, capsys) -> None:
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(words)
    except SystemExit:
        raise AssertionError(f"torchrun cannot read {words}") from None
    check_python([parsed.training_script, *parsed.training_script_args], tmp, monkeypatch, capsys)


def check(command: Command, tmp: Path, monkeypatch, capsys) -> None:
    """One command, checked as the module docstring says (run for real only where test_shrunk_runs says)."""
    env, words = words_of(command, tmp)
    program, rest = words[0], words[1:]
    if program == "make":
        assert set(rest) <= makefile_targets(), f"{rest}: not Makefile targets"
    elif program == "pip":
        check_pip(words)
    elif program == "source":
        venv = re.search(r"^VENV \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
        assert rest == [f"{venv}/bin/activate"], rest
    elif program == "sbatch":
        check_bash(next(w for w in rest if not w.startswith("-")), [], env, tmp)
    elif program == "bash":
        check_bash(rest[0], rest[1:], env, tmp)
    elif program == "torchrun":
        check_torchrun(rest, tmp, monkeypatch, capsys)
    elif program == "python":
        check_python(rest, tmp, monkeypatch, capsys)
    elif program == "rm":  # a block's cleanup of its own files
        assert all(w.startswith(("-", "/tmp/")) for w in rest), rest
    else:
        raise AssertionError(f"no check for {program!r}")


def excepted(command: Command) -> str | None:
    return next((why for start, why in EXCEPTIONS.items() if command.text.startswith(start)), None)


# --- the tests -------------------------------------------------------------------------------------------------

def test_every_documented_command_works_as_shown(tmp_path, monkeypatch, capsys):
    """README.md and docs/*.md: each command checked (see the module docstring), all failures listed at once."""
    commands = doc_commands()
    assert len(commands) > 50  # the reader found the documents' commands
    failures = []
    for command in commands:
        if excepted(command):
            continue
        try:
            check(command, tmp_path, monkeypatch, capsys)
        except Exception as e:  # noqa: BLE001 - every broken command is listed, not the first one only
            failures.append(f"{command}\n    {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    assert not failures, "\n".join(failures)


def test_every_entry_point_has_a_help_whose_examples_work(tmp_path, monkeypatch, capsys):
    """`python SCRIPT --help` for every entry point (a main() in the top folder, prep/, scripts/ or benchmarks/), and the
    example commands its help shows, checked like the documents' commands."""
    failures = []
    for script in ENTRY_POINTS:
        try:
            examples = help_commands(script, help_text(script, monkeypatch, capsys))
        except Exception as e:  # noqa: BLE001 - listed
            failures.append(f"{script} --help\n    {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            continue
        for command in examples:
            if excepted(command) or (script in HELP_ONLY):
                continue
            try:
                check(command, tmp_path, monkeypatch, capsys)
            except Exception as e:  # noqa: BLE001 - listed
                failures.append(f"{command}\n    {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    assert not failures, "\n".join(failures)


def test_the_demo_checkpoints_the_documents_name_are_those_the_demo_writes(monkeypatch, capsys):
    """Issue 44: export_hf.py's and eval_lm.py's --help named out/demo/checkpoints/step_00000200.pt, which the
    demo (400 steps, checkpoint_interval 0) does not write."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    interval = demo.get("checkpoint_interval") or demo["max_steps"]
    written = {f"{demo['out_dir']}/checkpoints/step_{s:08d}.pt" for s in range(interval, demo["max_steps"] + 1, interval)}
    texts = [path.read_text() for path in DOCS] + [help_text(s, monkeypatch, capsys) for s in ENTRY_POINTS]
    named = {m for text in texts for m in re.findall(re.escape(demo["out_dir"]) + r"/checkpoints/step_\d{8}\.pt", text)}
    assert named and named <= written, named - written


# --- the shrunk runs -----------------------------------------------------------------------------------------

# The commands run for real, in the order the documents show them: the README's mixture example (two preps, a
# run, its plot), its comparison of seeds (three demo runs with an EMA, compare_runs.py on them), then what the
# README shows a user doing with a run folder. Everything else is checked above.
RUN = ("python prep/fineweb.py --input", "python train_gpt2.py --config configs/demo.yaml --data_dir",
       "python train_gpt2.py --config configs/demo.yaml --ema_decay 0.98 --ema_start 0.5 --sample_interval 0 --seed",
       "python compare_runs.py --a out/ema/",
       "python plot_log.py", "python sample.py --ckpt out/", "python export_hf.py out/")
# How each is shrunk: arguments added after the documented ones (the last value of a key wins).
SHRINK = {
    "prep/fineweb.py": ["--num_proc", "1"],  # no worker processes for a few hundred KB
    "train_gpt2.py": ["--max_steps", "2"],  # 2 steps of the demo model, and the val loss after the last
    "sample.py": ["--max_new_tokens", "4", "--num_samples", "1"],
}
# The demo's data (data/shakespeare, which `make demo` prepares from a download) for a run that reads it: the
# prose folder the mixture example prepared, and a val window that folder holds.
DEMO_DATA = ["--data_dir", "data/prose", "--val_tokens", "2048"]
# The documents' run folders: the one small run trained here stands in for each (the demo's, the 124M run's).
RUN_FOLDERS = {"out/demo": "out/mix", "out/gpt2_124m": "out/mix"}


def in_workspace(words: list[str], work: Path) -> list[str]:
    """The words with every out/, data/ and hf/ path moved into work (run folders as RUN_FOLDERS says), and
    a bare image name (`-o curves.png`) too: nothing is written into the working tree."""
    def move(word: str) -> str:
        if (REPO / word).exists() and not word.startswith("out/"):  # an input: data/loader.py is no output
            return word
        for shown, used in RUN_FOLDERS.items():
            word = re.sub(rf"(?<![\w/]){re.escape(shown)}(?![\w-])", used, word)
        word = re.sub(r"(?<![\w/.])(out|data|hf)/", lambda m: f"{work}/{m.group(1)}/", word)
        return str(work / word) if word.endswith(".png") and "/" not in word else word

    return [move(w) for w in words]


def runnable_commands() -> list[Command]:
    seen, chosen = set(), []
    for command in doc_commands():
        if command.text.startswith(RUN) and command.text not in seen:
            seen.add(command.text)
            chosen.append(command)
    return chosen


@pytest.mark.slow
def test_the_commands_a_user_runs_on_a_cpu_run_as_shown(tmp_path):
    """The README's mixture example (prep of the repository's prose and code, a demo-model run on both,
    plot_log.py), its three seeds compared live against EMA (issue 53: its example needed a 35-minute script's
    runs), then plot_log.py, sample.py and export_hf.py on that run folder, each launched as a user would
    (forked from a warm process: tests/forked_ranks.py), shrunk by SHRINK."""
    commands = runnable_commands()
    assert [c.text.split()[1] for c in commands][:4] == ["prep/fineweb.py", "prep/fineweb.py", "train_gpt2.py",
                                                          "plot_log.py"], commands  # the README's order
    assert {c.text.split()[1] for c in commands} >= {"sample.py", "export_hf.py", "compare_runs.py"}
    for command in commands:
        _, words = words_of(command, tmp_path)
        script, args = words[1], in_workspace(words[2:], tmp_path)
        if script == "train_gpt2.py" and "--data_dir" not in args:
            args += in_workspace(DEMO_DATA, tmp_path)
        target = script.removesuffix(".py").replace("/", ".") + ":main"
        proc = launch([*args, *SHRINK.get(script, [])], target=target, timeout=180)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if script == "compare_runs.py":
            assert "paired t-test" in proc.stdout and "final val loss" in proc.stdout, proc.stdout
    assert (tmp_path / "out" / "mix" / "curves.png").is_file() and (tmp_path / "curves.png").is_file()
    assert (tmp_path / "hf" / "gpt2-124m" / "config.json").is_file()


def test_the_readme_has_the_reader_use_the_environment_make_made_before_any_python_command():
    """Issue 44: after `make demo`, the README's next command (`python sample.py ...`) ran the system's python:
    `No module named 'torch'`. Every command says `python` (not python3, not .venv/bin/python), after the line
    that activates .venv."""
    readme = [c for c in doc_commands() if c.where.startswith("README.md:")]
    line = {id(c): int(c.where.split(":")[1]) for c in readme}
    uses_env = [line[id(c)] for c in readme if c.text.split()[0] in ("python", "torchrun", "pip")]
    activate = min(line[id(c)] for c in readme if c.text == "source .venv/bin/activate")  # the Quick start's
    assert uses_env and activate < min(uses_env)
    assert not [c for c in doc_commands() if re.search(r"(^|\s)(python3|\.venv/bin/python)\s", c.text)]
