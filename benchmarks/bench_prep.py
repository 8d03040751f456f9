"""Time prep/fineweb.py on a synthetic .jsonl corpus at several --num_proc (and, optionally, another prep).

    python benchmarks/bench_prep.py --corpus_mb 100 --num_proc 1 2 --repeat 3
    python benchmarks/bench_prep.py --reference "python /tmp/other_prep.py {input} {out} {num_proc}" [--reference ...]

The corpus is generated once into --workdir (seeded: the same bytes on every machine): JSON
Lines of documents made of GPT-2 vocabulary words drawn with a Zipf-like law, some
punctuation and paragraph breaks, of log-normally distributed length (median ~250 words).
Each run is a fresh process timed from launch to exit (imports, reading, tokenizing, writing)
into an emptied output folder. --reference (repeatable) is another prep's command line with
{input}, {out} and {num_proc} placeholders. The settings are timed round-robin, --repeat
rounds, so that a load that comes and goes on a shared machine hits them all alike; the best
of each setting's runs is reported, every run's time is in the JSON. Runs are offline
(HF_*_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.tokenizer import get_tokenizer  # noqa: E402
from common.errors import ArgumentParser, ConfigError, run_cli  # noqa: E402


def vocabulary_words() -> np.ndarray:
    """GPT-2 tokens that are a space + letters, as words, most frequent merges first."""
    enc = get_tokenizer()
    words = []
    for rank in range(enc.n_vocab - 1):
        try:
            piece = enc.decode_single_token_bytes(rank).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(piece) >= 2 and piece[0] == " " and piece[1:].isalpha():
            words.append(piece[1:])
    return np.array(words, dtype=object)


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write about `megabytes` MB of JSON Lines documents to path; the number of documents."""
    rng = np.random.default_rng(seed)
    words = vocabulary_words()
    p_word = 1.0 / (np.arange(len(words)) + 30.0)  # Zipf-like: rank r drawn with weight 1/(r+30)
    p_word /= p_word.sum()
    endings = np.array(["", ",", ".", ".\n\n", "'s", " 1999", ":"], dtype=object)
    p_ending = [0.84, 0.06, 0.06, 0.01, 0.01, 0.01, 0.01]
    size = documents = 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            n = int(rng.lognormal(5.5, 1.0)) + 5
            chosen = words[rng.choice(len(words), n, p=p_word)] + endings[rng.choice(len(endings), n, p=p_ending)]
            text = " ".join(chosen)
            line = json.dumps({"text": text, "id": documents}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            documents += 1
    tmp.replace(path)
    return documents


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds of one run, and the CPU seconds (user + system) of it and its worker processes."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise ConfigError(f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores of {cpu}, Python {platform.python_version()}"


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks/bench_prep.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus_mb", type=float, default=100.0, help="size of the synthetic corpus in MB")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--workdir", default="bench_results/prep", help="corpus and outputs go here")
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2], help="process counts to time")
    parser.add_argument("--repeat", type=int, default=3, help="runs per setting; the best is reported")
    parser.add_argument("--reference", action="append", default=[],
                        help="another prep to time: a command with {input}, {out} and {num_proc} placeholders")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.corpus_mb <= 0 or args.repeat < 1 or min(args.num_proc) < 1:
        raise ConfigError("--corpus_mb, --repeat and --num_proc must be positive")

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / f"corpus_{args.corpus_mb:g}mb_seed{args.seed}.jsonl"
    if not corpus.exists():
        print(f"writing {corpus} ...", flush=True)
        write_corpus(corpus, args.corpus_mb, args.seed)
    out = workdir / "out"
    ours = [sys.executable, str(REPO / "prep" / "fineweb.py"), "--input", "{input}", "--out", "{out}",
            "--num_proc", "{num_proc}"]
    settings = [(name, n, [part.format(input=corpus, out=out, num_proc=n) for part in template])
                for name, template in [("prep/fineweb.py", ours)] + [(r, shlex.split(r)) for r in args.reference]
                for n in args.num_proc]
    times = {(name, n): [] for name, n, _ in settings}  # (wall s, CPU s) of each run
    for _ in range(args.repeat):
        for name, n, cmd in settings:
            shutil.rmtree(out, ignore_errors=True)
            times[name, n].append(timed(cmd))
            if name == "prep/fineweb.py":
                tokens = json.loads((out / "local_manifest.json").read_text())["total_tokens"]

    results = {"date": datetime.date.today().isoformat(), "machine": machine(), "corpus": str(corpus),
               "corpus_bytes": corpus.stat().st_size, "corpus_tokens": tokens, "runs": []}
    for name, n, cmd in settings:
        wall, cpu = min(times[name, n])  # the fastest run, and its CPU time
        results["runs"].append({"prep": name, "num_proc": n, "best_s": wall, "cpu_s_of_best": cpu,
                                "times_s": [t for t, _ in times[name, n]], "command": shlex.join(cmd)})
        print(f"num_proc {n}: best {wall:6.2f} s ({tokens / wall / 1e6:5.2f}M tokens/s, {cpu:6.2f} CPU s)  "
              f"runs {', '.join(f'{t:.2f}' for t, _ in times[name, n])}  {name}")
    print(f"{results['machine']}; corpus {results['corpus_bytes'] / 1e6:.1f} MB, {results['corpus_tokens']:,} tokens")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
