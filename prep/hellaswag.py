"""Fetch the HellaSwag validation split (10,042 examples) for the trainer's HellaSwag eval.

    python prep/hellaswag.py                            # into the cache folder (below)
    python prep/hellaswag.py --out hellaswag_val.jsonl  # or anywhere

The cache folder is $GPT2_REPRO_CACHE/hellaswag/, by default ~/.cache/gpt2-repro/hellaswag/.

Run it once on a machine with internet. The trainer finds the cached file by itself; on a
cluster whose nodes are offline, copy the file somewhere they can read and pass
`--hellaswag_path FILE`. An existing valid file is kept unless --force is given.
"""

from __future__ import annotations

import argparse
import http.client
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `training` importable

import common.startup  # noqa: E402,F401 - first: a Ctrl-C while the modules below load is one line

from common.errors import ArgumentParser, DataError, run_cli  # noqa: E402
from common.settings import path_argument  # noqa: E402
from evals.hellaswag import (  # noqa: E402
    DOWNLOAD_TIMEOUT_S, VAL_FILENAME, VAL_URL, HellaSwagDataError, default_cache_dir, download_val, read_examples,
)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="prep/hellaswag.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, type=path_argument,
                        help=f"file to write (default: the cache's {VAL_FILENAME})")
    parser.add_argument("--url", default=VAL_URL, help="where to download from (a mirror, or a file:// URL)")
    parser.add_argument("--timeout", type=float, default=DOWNLOAD_TIMEOUT_S, help="seconds per network operation")
    parser.add_argument("--force", action="store_true", help="download again even if a valid file is there")
    args = parser.parse_args(argv)

    out = Path(args.out) if args.out else default_cache_dir() / VAL_FILENAME
    if out.is_file() and not args.force:
        try:
            count = len(read_examples(out))
        except HellaSwagDataError as e:
            raise DataError(f"{e}; rerun with --force to download it again") from None
        print(f"hellaswag: {count:,} examples already in {out}")
        return 0
    print(f"hellaswag: downloading {args.url}")
    try:
        count = download_val(out, args.url, args.timeout)
    except (OSError, http.client.HTTPException, HellaSwagDataError) as e:
        raise DataError(f"could not download {args.url} to {out}: {e}") from None
    print(f"hellaswag: {count:,} examples in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
