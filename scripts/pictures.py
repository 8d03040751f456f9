"""Every picture the documentation shows (docs/NAME.png), drawn by plot_log.py or ladder.py from the real runs it
shows.

    python scripts/pictures.py                        # redraw each from its runs stored in docs/pictures/: seconds
    python scripts/pictures.py --store out/pictures   # first store the runs trained there (the runs of PICTURES)

`make pictures` runs the first; `make pictures FROM_SCRATCH=1` trains the runs again into out/pictures/ (make
demo's training, the README's mixture, scripts/compare_recipes.py's seed 1337, the README's scaling ladder) and
runs the second.

The runs are kept in docs/pictures/NAME/RUN/ with what plot_log.py draws of them and no more: log.jsonl holds the
evaluation, skip and rollback records whole (a val record's fields name its sets), each step's train record cut to
the fields of its curves, each launch's startup record to its step (a resume); config.yaml is the trainer's (the
reference lines follow it); unigram.json holds the unigram entropy of the run's train data, counted from its
shards when the run is stored (the shards are not kept). A ladder's picture (docs/ladder.png) is drawn from its
ladder.json alone, kept whole in docs/pictures/NAME/ladder.json (every rung's plan and final val figures; ladder.py
fits the law to them again). docs/pictures/NAME/figure.txt says what the picture draws (plot_log.describe: panels,
curves and points with their labels, colours, line and marker styles, reference lines, bands, legends), the same
text the PNG carries: tests/test_plot_log.py draws every picture again from what is stored with today's
plot_log.py and ladder.py and fails where they would draw something else, until this script has redrawn them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ladder  # noqa: E402
import plot_log  # noqa: E402
from common.errors import ArgumentParser, DataError, run_cli  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from runtime.logger import LOG_NAME  # noqa: E402

DOCS = REPO / "docs"
STORED = DOCS / "pictures"
UNIGRAM = "unigram.json"  # {"entropy": nats, "sampled": whether a source had more tokens than were counted}


class Picture(NamedTuple):
    """plot_log.py's curves of runs."""

    runs: tuple[str, ...]  # run folders, under the folder they were trained in; each is labelled by its name
    smooth: int = 1  # plot_log.py --smooth
    title: str | None = None  # plot_log.py --title


class LadderPicture(NamedTuple):
    """ladder.py's picture of a scaling ladder: its law, the prediction and its check."""

    out: str  # the ladder's --out, under the folder it was trained in: its ladder.json


PICTURES = {  # docs/NAME.png, each drawn as the command the README shows beside it draws it
    "demo_curves": Picture(("demo",)),  # make demo: plot_log.py out/demo
    "mixture": Picture(("mix",)),  # the README's mixture: plot_log.py out/mix
    "recipes": Picture(("recipes/faithful_s1337", "recipes/modern_s1337"), smooth=20,  # compare_recipes.py's
                       title="demo model: faithful vs modern recipe (seed 1337)"),
    "ladder": LadderPicture("ladder"),  # the README's ladder: ladder.py --tokens_per_param 0.01 --seeds 1337 1 --check
}
LADDER_JSON = "ladder.json"
DRAWN_KINDS = {s.kind for s in plot_log.SERIES} | set(plot_log.MARKERS) | {"startup"}
TRAIN_FIELDS = {"kind", "step", "tokens"} | {s.field for s in plot_log.SERIES if s.kind == "train"}


def drawn_fields(record: dict) -> dict:
    """What plot_log.py reads of a record of a kind it draws."""
    if record["kind"] == "train":
        return {k: v for k, v in record.items() if k in TRAIN_FIELDS}
    if record["kind"] == "startup":
        return {"kind": "startup", "step": record.get("step")}
    return record


def read_ladder(path: Path) -> dict:
    """A ladder's ladder.json; DataError (naming it) where it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (the ladder writes it when its rungs are trained)") from None
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e})") from None


def store(runs_root: Path) -> None:
    """Keep the runs of every picture, read from runs_root, in docs/pictures/ (replacing the stored ones); every
    run is read, and its unigram entropy counted, before anything is written."""
    loaded, ladders = {}, {}
    for name, picture in PICTURES.items():
        if isinstance(picture, LadderPicture):
            source = runs_root / picture.out / LADDER_JSON
            read_ladder(source)  # it is kept as the ladder wrote it
            ladders[STORED / name / LADDER_JSON] = source
            continue
        for run in picture.runs:
            found = plot_log.load_run(runs_root / run)
            loaded[STORED / name / Path(run).name] = runs_root / run, found
            if found.unigram is None:
                raise DataError(f"{runs_root / run / 'config.yaml'}: its data_dir's train shards cannot be read "
                                f"(the unigram entropy line is drawn from them)")
    for name in PICTURES:
        shutil.rmtree(STORED / name, ignore_errors=True)
    for folder, (source, run) in loaded.items():
        folder.mkdir(parents=True)
        with open(folder / LOG_NAME, "w") as f:
            f.writelines(json.dumps(drawn_fields(r)) + "\n" for r in run.records if r.get("kind") in DRAWN_KINDS)
        shutil.copyfile(source / "config.yaml", folder / "config.yaml")
        entropy, sampled = run.unigram
        (folder / UNIGRAM).write_text(json.dumps({"entropy": entropy, "sampled": sampled}) + "\n")
    for path, source in ladders.items():
        path.parent.mkdir(parents=True)
        shutil.copyfile(source, path)


def stored_runs(name: str) -> dict[str, plot_log.PlottedRun]:
    """The runs of picture `name` as stored in docs/pictures/NAME/, by label."""
    runs = {}
    for run in PICTURES[name].runs:
        folder = STORED / name / Path(run).name
        unigram = json.loads((folder / UNIGRAM).read_text())
        runs[folder.name] = plot_log.load_run(folder, unigram=False)._replace(
            unigram=(unigram["entropy"], unigram["sampled"]))
    return runs


def draw(name: str, out: Path) -> Figure:
    """The figure of picture `name` from what is stored of it, written to the image `out`: plot_log.py's of its runs,
    or ladder.py's of its ladder.json."""
    picture = PICTURES[name]
    if isinstance(picture, LadderPicture):
        return ladder.redraw(read_ladder(STORED / name / LADDER_JSON), out)
    return plot_log.plot(stored_runs(name), out, picture.smooth, picture.title)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="scripts/pictures.py", description=__doc__)
    parser.add_argument("--store", type=Path, metavar="RUNS",
                        help="first store the runs of every picture from this folder (make pictures FROM_SCRATCH=1 "
                             "trains them in out/pictures)")
    args = parser.parse_args(argv)
    if args.store:
        store(args.store)
    for name in PICTURES:
        fig = draw(name, DOCS / f"{name}.png")
        (STORED / name / "figure.txt").write_text(plot_log.describe(fig))
        print((DOCS / f"{name}.png").relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
