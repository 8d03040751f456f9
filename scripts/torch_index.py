"""pip's arguments for PyTorch's CPU wheel index, or none, with one line saying so, when it cannot be reached.

    python scripts/torch_index.py [URL]   # prints "--extra-index-url URL" when URL answers within 5 s

`make install` (on Linux without an NVIDIA GPU) asks this before installing torch. Given an index it
cannot reach (an air-gapped or proxied machine), pip retries it for every package and prints
dozens of `WARNING: Retrying ...` lines before it falls back to the other indexes; asked first,
the install says so once and takes torch from the configured index alone (pip's own settings:
PyPI's torch is the CUDA build, several GB). Standard library only: it runs before anything is
installed, and honours the same proxy variables as pip (HTTPS_PROXY, NO_PROXY).
"""

from __future__ import annotations

import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TIMEOUT_S = 5  # a reachable index answers in well under a second; a black-holed one never does


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    url = (argv[0] if argv else CPU_INDEX).rstrip("/")
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/torch/", method="HEAD"), timeout=TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are OSErrors
        reason = getattr(e, "reason", None) or e
        print(f"PyTorch's CPU wheel index {url} cannot be reached ({reason}): installing torch from pip's configured "
              "index instead (on PyPI, the CUDA build)", file=sys.stderr)
        return 0
    print(f"--extra-index-url {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
