"""The bookkeeping files of a prep beside its shards, and the fingerprint of a data folder.

    {prefix}_progress.json   while a prep runs: what is written and where the input continues
    {prefix}_manifest.json   written last, when the prep is complete: every shard with its
                             token count, document count and sha256, the source, the settings
                             and the tokenizer's hash

Both are written atomically (temp file, fsync, rename), so a killed prep leaves either the old
record or the new one, never half of one. `data_fingerprint` names the data a run trained on
in a few hex digits, so a resumed run can tell that its data folder changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from common.atomic_file import atomic_write
from data.shards import shard_files
from data.tokenizer import EOT_TOKEN
from common.errors import DataError

MANIFEST_FORMAT = 1


def manifest_path(out_dir: str | os.PathLike, prefix: str) -> Path:
    return Path(out_dir) / f"{prefix}_manifest.json"


def progress_path(out_dir: str | os.PathLike, prefix: str) -> Path:
    return Path(out_dir) / f"{prefix}_progress.json"


def prep_files(out_dir: str | os.PathLike, prefix: str) -> list[Path]:
    """The files a prep with this prefix writes that are in out_dir: shards, progress record and
    manifest, and the temp files a killed write leaves (`.NAME.tmp`, and `NAME.tmp` from older
    code). Other prefixes' files are never matched (`local` does not match `local_b_train_000001.npy`)."""
    name = re.escape(prefix) + r"_(?:(?:val|train)_\d{6}\.npy|progress\.json|manifest\.json)"
    pattern = re.compile(rf"\.{name}\.tmp|{name}(?:\.tmp)?")
    out_dir = Path(out_dir)
    return sorted(p for p in out_dir.iterdir() if pattern.fullmatch(p.name)) if out_dir.is_dir() else []


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def shard_record(path: Path, tokens: np.ndarray) -> dict:
    """A shard's manifest entry; `tokens` is what was just written to `path`.

    `documents` counts the documents that start in the shard (each starts with <|endoftext|>);
    sha256 is of the .npy file, so `sha256sum` on the folder checks it.
    """
    return {"name": path.name, "tokens": int(tokens.size), "documents": int(np.count_nonzero(tokens == EOT_TOKEN)),
            "sha256": file_sha256(path)}


def write_json_atomic(path: Path, record: dict) -> None:
    with atomic_write(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")


def read_json(path: Path) -> dict:
    """A bookkeeping record; a damaged one is a DataError that names it."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable ({e}); delete it, or re-run the prep with --overwrite") from None
    if not isinstance(record, dict) or record.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: not a format-{MANIFEST_FORMAT} prep record")
    return record


def write_manifest(out_dir: str | os.PathLike, prefix: str, source: dict, settings: dict, tokenizer_sha256: str,
                   shards: list[dict]) -> Path:
    """Write `{prefix}_manifest.json`: the last file of a complete prep. Its bytes depend only on
    what was prepared (no dates, no process counts), so a resumed prep ends with the same file."""
    path = manifest_path(out_dir, prefix)
    write_json_atomic(path, {
        "format": MANIFEST_FORMAT,
        "source": source,
        "settings": settings,
        "tokenizer_sha256": tokenizer_sha256,
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_documents": sum(s["documents"] for s in shards),
        "shards": shards,
    })
    return path


def data_fingerprint(data_dir: str | os.PathLike) -> str:
    """16 hex digits that change when the shards a trainer would read change.

    Covers every `*_val_*.npy` / `*_train_*.npy` file (what the loader reads): its name, its
    size, and its sha256 where a `*_manifest.json` in the folder lists it. Only manifests and
    directory entries are read, never the token bytes, so it takes milliseconds on a 20 GB
    folder, and equal data gives an equal fingerprint wherever its inputs lived. Not noticed: a
    shard overwritten after the prep by another of the same size (that needs reading tokens).
    """
    data_dir = Path(data_dir)
    listed = {}
    for manifest in sorted(data_dir.glob("*_manifest.json")):
        try:
            listed.update({s["name"]: s["sha256"] for s in read_json(manifest)["shards"]})
        except (KeyError, TypeError):
            raise DataError(f"{manifest}: malformed shard list; re-run the prep with --overwrite") from None
    shards = shard_files(data_dir)
    entries = [[p.name, p.stat().st_size, listed.get(p.name, "")] for p in shards]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]
