"""The weight format a model runs at: one value, parsed once from `--quant` / `--draft-quant`.

Two libraries sit side by side behind it. torchao's weight-only formats are packed by viasd
itself (weight_formats.py: `int8`, `int4`; `gguf` from a GGUF file's own 4-bit blocks,
loading/gguf_blocks.py); bitsandbytes' are applied by transformers while the
weights load (`8bit` LLM.int8, `4bit` NF4); `none` keeps the model's floating-point weights. Code
asks the value (`fmt.packed`, `fmt.bits`, `fmt.backend`) instead of comparing spellings; the
spelling (`fmt.name`, also `str(fmt)`) is what profiles and bench files store, so the files
written before this value existed still read.

`auto` is not a format: it is a choice made where the model is known (loading.models.resolve_format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from viasd_core.errors import UsageError

FLOAT, TORCHAO, BITSANDBYTES = "none", "torchao", "bitsandbytes"  # backends
AUTO = "auto"


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the option's spelling: none, int8, int4, 8bit, 4bit
    backend: str  # FLOAT, TORCHAO or BITSANDBYTES
    bits: int | None  # bits a weight; None: floating point
    display: str  # what doctor and --verbose print
    cuda_capability: tuple[int, int] | None = None  # the oldest GPU whose kernels run it; None: any
    from_file: bool = False  # packed from a GGUF file's own blocks (loading/gguf_blocks.py): GGUF models only

    @property
    def packed(self) -> bool:
        """Packed by viasd (weight_formats.py) after the floating-point weights load."""
        return self.backend == TORCHAO

    @property
    def quantized(self) -> bool:
        return self.backend != FLOAT

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str, also: tuple[str, ...] = ()) -> "WeightFormat":
        """The format spelled `text`; a UsageError naming the choices (`also`: other spellings the
        caller accepts, listed first) on any other."""
        key = (text or "").strip().lower()
        for fmt in ALL:
            if fmt.name == key:
                return fmt
        torchao = ", ".join(f.name for f in ALL if f.backend in (FLOAT, TORCHAO))
        bnb = ", ".join(f.name for f in ALL if f.backend == BITSANDBYTES)
        others = "".join(f"{a}, " for a in also)
        raise UsageError(f"unknown quantization '{text}': use {others}{torchao} (torchao) or {bnb} (bitsandbytes)")

    def runs_on(self, device: torch.device) -> bool:
        """Whether the kernels of this format run on `device`."""
        if self.cuda_capability is None or device.type != "cuda":
            return True
        return tuple(torch.cuda.get_device_capability(device)) >= self.cuda_capability

    def check_device(self, device: torch.device) -> None:
        """Refuse a format this GPU's kernels cannot run, before any weight is read."""
        if not self.runs_on(device):
            have = torch.cuda.get_device_capability(device)
            need = ".".join(map(str, self.cuda_capability))
            raise UsageError(f"{self.name} needs a GPU of compute capability {need} or newer (its kernel runs bfloat16 on "
                             f"tensor cores), this one is {have[0]}.{have[1]}: use --quant int8 or --quant 4bit")


NONE = WeightFormat("none", FLOAT, None, "none (the model's floating-point weights)")
INT8 = WeightFormat("int8", TORCHAO, 8, "int8 weight-only, one scale a row (torchao)")
INT4 = WeightFormat("int4", TORCHAO, 4, "int4 weight-only in groups of 32, int8 output head (torchao)",
                    cuda_capability=(8, 0))  # tinygemm's CUDA kernel: bfloat16 tensor cores
GGUF = WeightFormat("gguf", TORCHAO, 4, "a GGUF file's own Q4_0/Q4_1/Q4_K blocks as int4 in groups of 32, other "
                    "linear layers int8 per row", cuda_capability=(8, 0), from_file=True)
BNB_8BIT = WeightFormat("8bit", BITSANDBYTES, 8, "8-bit LLM.int8 (bitsandbytes)")
BNB_4BIT = WeightFormat("4bit", BITSANDBYTES, 4, "4-bit NF4 (bitsandbytes)")
ALL = (NONE, INT8, INT4, GGUF, BNB_8BIT, BNB_4BIT)
NAMES = tuple(f.name for f in ALL)
# packed from any model's float weights (slim views' twins), from the most precise down
PACKED = tuple(sorted((f for f in ALL if f.packed and not f.from_file), key=lambda f: -f.bits))
