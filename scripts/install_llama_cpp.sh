#!/usr/bin/env bash
# llama-cpp-python for `viasd bench --methods llama.cpp`, built from source without -march=native and
# without llama.cpp's AMX kernels; the x86 vector extensions the CPU has are turned on one by one.
#
# Why: on 2026-11-28, on a 2-core Intel Xeon (Sapphire Rapids under KVM: AVX-512 BF16, AMX-TILE/INT8),
# llama-cpp-python 0.3.36 built by `pip install llama-cpp-python` (GGML_NATIVE, Debian's GCC 12.2) died
# of SIGSEGV in Llama.__call__ -> decode on a prompt of several tokens. The fault is the `ldtilecfg` in
# ggml_backend_amx_mul_mat: GCC 12.2's _tile_loadconfig (amxtileintrin.h) declares the 64-byte tile
# configuration as an 8-byte memory operand, so at -O3 the stores of its rows and column widths are
# dropped and the CPU loads stack garbage (general-protection fault): the same native GCC build of
# libggml-cpu with that one `ldtilecfg` given the whole 64-byte struct as its operand ran (AMX works in
# that VM). clang 14 spells the macro __AMXINT8__, so its native build has no AMX kernels (ggml tests
# __AMX_INT8__) and ran too. With n_batch = n_ubatch = 1 (one-row products, another kernel) the prompt
# ran; n_threads=1, use_mmap=False and flash_attn on/off still crashed; the package index has no
# prebuilt wheel. The build below (these flags on that CPU: AVX-512 with VBMI/VNNI/BF16, no AMX) ran
# there, and `viasd bench --methods ar,llama.cpp` ran end to end with it
# (viasd_core/bench/llama_cpp_proc.py).
#
#   bash scripts/install_llama_cpp.sh                      # llama-cpp-python==0.3.36 from the index
#   bash scripts/install_llama_cpp.sh ./llama_cpp_python-0.3.36.tar.gz   # a source archive
#   LLAMA_CPP_ISA=avx2 LLAMA_CPP_TARGET=/opt/llama-avx2 bash scripts/install_llama_cpp.sh ...
#
# LLAMA_CPP_ISA caps the extensions turned on, to build the baseline of another instruction-set class
# on this CPU (as VIASD_MAX_CPU_ISA caps viasd): avx2 (AVX2+FMA, no AVX-512) or avx512 (AVX-512
# F/BW/VL/DQ/VNNI/VBMI, no BF16). LLAMA_CPP_TARGET installs into that folder instead (pip --target;
# the installed llama-cpp-python stays): put it first on PYTHONPATH to run that build.
#
# The build takes 15-40 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source="${1:-llama-cpp-python==0.3.36}"

if [ "$(uname -m)" != "x86_64" ]; then
    echo "install_llama_cpp.sh: this build is for x86-64 (AVX flags); elsewhere: pip install llama-cpp-python" >&2
    exit 2
fi
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }

args="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_BMI2=$(has bmi2)"
args+=" -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
args+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
args+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
case "${LLAMA_CPP_ISA:-native}" in
    native) ;;
    avx512) args+=" -DGGML_AVX512_BF16=OFF" ;;
    avx2) args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" ;;
    *) echo "install_llama_cpp.sh: LLAMA_CPP_ISA is native, avx512 or avx2, not '$LLAMA_CPP_ISA'" >&2; exit 2 ;;
esac
echo "CMAKE_ARGS=$args"

# uninstalled first (not --force-reinstall, which would reinstall numpy and the other dependencies too);
# no cache, so that a wheel built with other flags is not taken again
target=()
if [ -n "${LLAMA_CPP_TARGET:-}" ]; then
    target=(--target "$LLAMA_CPP_TARGET" --no-deps)
    export PYTHONPATH="$LLAMA_CPP_TARGET${PYTHONPATH:+:$PYTHONPATH}"  # the check below runs this build
else
    python3 -m pip uninstall -y llama-cpp-python
fi
CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    python3 -m pip install --no-cache-dir --no-binary llama-cpp-python "${target[@]}" "$source"

# the crash's own check: a prompt of several tokens through decode, on the embedded GGUF file
python3 - <<'EOF'
from llama_cpp import Llama

from viasd_core.loading.models import embedded_gguf

llm = Llama(str(embedded_gguf()), n_ctx=512, n_threads=2, verbose=False)
text = llm("Write a long story about a cat", max_tokens=16, temperature=0)["choices"][0]["text"]
print(f"llama.cpp runs: {text!r}")
EOF
