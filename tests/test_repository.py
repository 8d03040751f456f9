"""The repository as a user receives it: it carries the license it names, and a README that a reader gets
through."""

from __future__ import annotations

import inspect
import re

from conftest import REPO


def test_the_license_is_the_mit_license_that_pyproject_and_the_model_card_name():
    from hf_interop.export import export_hf

    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License\n") and "the gpt2-repro authors" in license_text
    assert re.search(r'^license = \{ text = "MIT" \}$', (REPO / "pyproject.toml").read_text(), re.M)
    assert inspect.signature(export_hf).parameters["license"].default == "mit"


def test_the_readme_stays_under_350_lines():
    """Issue 53: the status and the 124M table went in, and the README still reads in one sitting."""
    assert len((REPO / "README.md").read_text().splitlines()) < 350


def test_the_cpu_malloc_settings_are_written_once_and_make_reads_the_same():
    """common/cpu_malloc.env holds them; the Makefile's CPU_MALLOC and common/cpu_malloc.py read it alike."""
    import subprocess

    from common.cpu_malloc import CPU_MALLOC

    proc = subprocess.run(["make", "-s", "--eval", 'print-malloc: ; @echo "$(CPU_MALLOC)"', "print-malloc"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"{key}={value}" for key, value in CPU_MALLOC.items()]
    assert CPU_MALLOC == {"MALLOC_MMAP_THRESHOLD_": str(2**34), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
