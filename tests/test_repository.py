"""The repository as a user receives it: it speaks of itself alone, carries the license it names, and a README
that a reader gets through."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

# What one development setup had and a user's GPU machine does not: a machine of its own that files are moved
# to and from, with a mirror of other repositories, folders carried along, device time lent per session.
# Each pattern is one phrase of that setup as the files once named it, and what it stood for.
DEVELOPMENT_SETUP = {
    r"/work/": "an absolute path of the development machine",
    r"\.mirror\b": "its mirror of other repositories",
    r"\bdevice[- ]tool": "its tool that ran commands on a GPU machine",
    r"\bdevice (?:time|calls?)\b": "the GPU time lent to a session",
    r"\b(?:same|one|GPU)\s+leases?\b": "the GPU time lent to a session (not an NFS client's lease)",
    r"\blent\b": "a GPU lent to a session",
    r"\bfiles_at\b": "where its tool put the files a GPU command wrote",
    r"\bcarry\b(?:\s*:|\s*\[|\s+folders?|\s+it\b)": "the folders its tool carried to the GPU machine",
    r"(?m)^\s*\.(?:whl|gl)/": "the carry folders, ignored in .gitignore",
    r"\bfetch tool\b": "its tool that fetched other repositories",
    r"\bsandbox\b": "the development machine",
}
BINARY = (".png", ".npy")


def tracked_text_files() -> list[Path]:
    """The files git tracks (every file under the repository where git is missing), binary ones left out."""
    proc = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    paths = ([REPO / p for p in proc.stdout.splitlines()] if proc.returncode == 0 else
             [p for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts])
    return [p for p in paths if p.suffix not in BINARY and p.is_file() and p != Path(__file__).resolve()]


def test_no_tracked_file_names_the_development_setup():
    """Issue 53: scripts/gpu_reference.py, scripts/gpu_check.sh, docs/PERFORMANCE.md and .gitignore described
    how one development setup moved files to and from a GPU machine (a mirror path, carry folders, leases)."""
    found = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern, meaning in DEVELOPMENT_SETUP.items():
            for match in re.finditer(pattern, text, re.I):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {match.group(0).strip()!r} ({meaning})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", ["see /work/main", "git --git-dir=x/.mirror/y", "in the same lease", "a lent GPU",
                                  "with carry [\".ref\"]", "# device-tool carry folders", ".whl/", "device time left"])
def test_the_patterns_catch_the_setup_as_it_was_named(text):
    assert any(re.search(pattern, text, re.I) for pattern in DEVELOPMENT_SETUP)


@pytest.mark.parametrize("text", ["a release of the lock", "modified Lentz", "records carry the same record",
                                  "errors carry a message", "15 minutes on a slower machine",
                                  "the NFS client's lease expires"])
def test_the_patterns_leave_ordinary_prose_alone(text):
    assert not any(re.search(pattern, text, re.I) for pattern in DEVELOPMENT_SETUP)


def test_the_license_is_the_mit_license_that_pyproject_and_the_model_card_name():
    from hf_interop.export import export_hf

    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License\n") and "the gpt2-repro authors" in license_text
    assert re.search(r'^license = \{ text = "MIT" \}$', (REPO / "pyproject.toml").read_text(), re.M)
    assert inspect.signature(export_hf).parameters["license"].default == "mit"


def test_the_readme_stays_under_350_lines():
    """Issue 53: the status and the 124M table went in, and the README still reads in one sitting."""
    assert len((REPO / "README.md").read_text().splitlines()) < 350
