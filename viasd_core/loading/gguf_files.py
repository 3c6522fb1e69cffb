"""GGUF files as models: a `.gguf` file is converted once, through transformers, into a safetensors
folder in viasd's cache, and loaded from there like any other model folder.

The conversion dequantizes the file's quantized blocks (Q4_0, Q4_1, Q8_0, K-quants...) to float32:
the weights viasd runs are the GGUF's values, not its block layout (`--quant` then applies to the
float weights as it does for any folder; `--quant gguf` instead packs the file's own 4-bit blocks
from the file: gguf_blocks.py). Tokenizer and chat template come from the file.

One conversion per file: the folder's name carries the file's name and a key of its resolved path,
size and modification time (a file replaced in place is converted again), and the transformers
major version (a config saved by one major version and read by another once changed rope_theta
silently). The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

from viasd_core import paths
from viasd_core.errors import ViasdError

SUFFIX = ".gguf"
_DONE = ("model.safetensors", "config.json")


def is_gguf_path(ref: str | os.PathLike) -> bool:
    """True when `ref` names an existing file ending in .gguf."""
    path = Path(ref).expanduser()
    return path.suffix.lower() == SUFFIX and path.is_file()


def converted_dir(gguf: Path) -> Path:
    """Where the safetensors conversion of `gguf` lives (or will) in viasd's cache."""
    import transformers

    gguf = gguf.expanduser().resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    major = transformers.__version__.split(".")[0]
    return paths.cache_dir() / "models" / "gguf" / f"{gguf.stem}-{key}-tf{major}"


def is_converted(folder: Path) -> bool:
    return all((folder / name).exists() for name in _DONE)


def convert(gguf: Path, out: Path, source: dict | None = None, progress=None, name: str | None = None) -> Path:
    """The safetensors folder `out` for the GGUF file `gguf`, converting it on first use (dequantized
    to float32; tokenizer and chat template from the file). `source`: extra lines of
    viasd_source.json (where the file came from)."""
    if is_converted(out):
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from viasd_core.loading.progress import quiet_transformers

    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ViasdError(f"could not read the GGUF file '{gguf}': it does not start with the GGUF magic bytes")
    if progress:
        progress(f"converting {name or gguf.name} (GGUF, weights dequantized to float32) to safetensors, once...")
    quiet_transformers()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # transformers' GGUF reader draws its own tqdm bar (not behind its progress-bar switch):
            # stderr carries our lines only
            with contextlib.redirect_stderr(io.StringIO()):
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, OSError, TypeError, IndexError) as e:  # gguf / transformers refusals
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ViasdError(f"could not read the GGUF file '{gguf}': {detail}") from None
        # The weights are dequantized to float: drop the quantizer so that the model can be saved.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        record = {"gguf": str(gguf), "transformers": transformers.__version__, "weights": "dequantized to float32"}
        (tmp / "viasd_source.json").write_text(json.dumps(record | (source or {})))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
