"""viasd: multi-tier speculative decoding (VIA-SD) for local LLM generation."""

__version__ = "0.1.0"

import logging as _logging

# transformers imports torchao when it is installed (for `--quant int8/int4`); torchao then logs
# each optional CUDA extension it cannot load, and torch's pytree a deprecation for its enums:
# lines on stderr, where viasd keeps its statistics, for every command.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

from viasd_core import cpu_isa as _cpu_isa

_cpu_isa.apply()  # before any tensor operation: PyTorch's kernels follow VIASD_MAX_CPU_ISA too
