"""llama.cpp for `viasd bench --methods llama.cpp`: in a process of its own by default.

llama.cpp is native code that can crash the process it runs in. Measured 2026-11-28 on a 2-core Xeon
(Sapphire Rapids under KVM: AVX-512 BF16, AMX): llama-cpp-python 0.3.36 built from source with its
default `-march=native` by Debian's GCC 12.2 ended in a segmentation fault on a prompt of several
tokens (with n_batch = n_ubatch = 1 the same prompt ran). The fault is `ldtilecfg` in llama.cpp's AMX
kernel (ggml_backend_amx_mul_mat): GCC 12.2's `_tile_loadconfig` declares the 64-byte tile
configuration as an 8-byte memory operand, so at -O3 the compiler drops the stores of its rows and
column widths and the CPU loads stack garbage (a general-protection fault, SIGSEGV); the same build
with that `ldtilecfg` given the whole 64-byte struct as its operand ran. A build without the AMX
kernels runs (scripts/install_llama_cpp.sh). In a child process such a crash fails the llama.cpp method
alone, in one line that names the signal and the fix (`crash_line`), instead of killing the whole
`viasd bench` run with the other methods' results; and each library runs its own threads, as a user's
llama.cpp would. The bench times the call from its side, so a pipe message each way per prompt (well
under a millisecond against seconds of generation) is inside llama.cpp's figure.

`InProcess` is the plain reference (the tests drive it with a stand-in module); `OwnProcess` runs
the same `greedy` in a spawned child. Both say which build they run (`system_info`: llama.cpp's own
line of the instruction sets it was compiled for), which the bench keeps beside the method's figures.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import re
import signal
import weakref
from pathlib import Path

from viasd_core.errors import ViasdError

FIX = "scripts/install_llama_cpp.sh rebuilds it without -march=native and the AMX kernels"


def greedy(llm, prompt_ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    """llama.cpp's greedy continuation of `prompt_ids` (token ids of the GGUF's vocabulary), stopped
    like viasd's engine: at an EOS token (kept) or after `max_new_tokens`. (tokens, finish reason)."""
    tokens: list[int] = []
    for tok in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        tokens.append(int(tok))
        if tok in eos:
            return tokens, "eos"
        if len(tokens) >= max_new_tokens:
            break
    return tokens, "length"


class InProcess:
    """llama_cpp.Llama(**kwargs) in this process."""

    def __init__(self, kwargs: dict):
        import llama_cpp

        self.llm = llama_cpp.Llama(**kwargs)
        self.system_info = system_info(llama_cpp)

    def reset(self) -> None:
        self.llm.reset()

    def greedy(self, prompt_ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
        return greedy(self.llm, prompt_ids, eos, max_new_tokens)

    def close(self) -> None:
        pass


def system_info(module) -> str | None:
    """llama.cpp's line of what this build runs ("CPU : SSE3 = 1 | AVX2 = 1 | ..."), None where the
    module has no such call."""
    call = getattr(module, "llama_print_system_info", None)
    if call is None:
        return None
    info = call()
    return (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip(" |\n")


def build_note(lib_dir: Path | None) -> str:
    """Why this llama-cpp-python build is known to crash here, or "": its CPU library has llama.cpp's
    AMX kernels and was compiled by GCC 12 or older (the `_tile_loadconfig` fault in the module's doc)."""
    if lib_dir is None:
        return ""
    for lib in sorted(lib_dir.glob("libggml-cpu*.so*")):
        data = lib.read_bytes()
        gcc = re.search(rb"GCC: \([^)]*\) (\d+)\.(\d+)", data)
        if b"ggml_backend_amx_mul_mat" in data and gcc and int(gcc[1]) <= 12:
            version = f"{int(gcc[1])}.{int(gcc[2])}"
            return (f"its AMX kernels were compiled by GCC {version}, whose _tile_loadconfig drops the "
                    "tile configuration")
    return ""


def library_dir() -> Path | None:
    """llama_cpp's bundled native libraries (llama_cpp/lib), found without loading them."""
    spec = importlib.util.find_spec("llama_cpp")
    places = getattr(spec, "submodule_search_locations", None)
    if not places:
        return None
    return Path(list(places)[0]) / "lib"


def crash_line(exitcode: int | None) -> str:
    """One line for llama.cpp's process ending without an answer: the signal that killed it (a crash
    in the native library, with `build_note` and the fix) or its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            name = f"{-exitcode}, {signal.Signals(-exitcode).name}"
        except ValueError:
            name = str(-exitcode)
        note = build_note(library_dir())
        return (f"llama.cpp crashed (signal {name}) in this build of llama-cpp-python"
                f"{f' ({note})' if note else ''}: {FIX}")
    return f"llama.cpp's process ended without an answer (exit code {exitcode})"


def _serve(conn, kwargs: dict) -> None:
    """The child: one InProcess, answering (prompt_ids, eos, max_new_tokens) until None, or until the
    parent's end of the pipe closes (the parent ended): quietly either way."""
    try:
        local = InProcess(kwargs)
    except Exception as e:  # reported to the parent as one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", local.system_info))
    try:
        while (request := conn.recv()) is not None:
            conn.send(local.greedy(*request))
    except (EOFError, BrokenPipeError):
        return


def _stop(proc, conn) -> None:
    """Ask the child to end (None), wait a little, then kill it; close the parent's end."""
    if proc.is_alive():
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    conn.close()


class OwnProcess:
    """The same calls answered by a spawned child process (see the module's doc). `close` ends it;
    so does dropping the object or the interpreter's exit, for a caller that never closes it."""

    def __init__(self, kwargs: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True, name="viasd-llama.cpp")
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn)
        status, detail = self._receive()
        if status != "ready":
            self.close()
            raise ViasdError(f"llama.cpp did not start: {detail}")
        self.system_info = detail

    def _receive(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise ViasdError(crash_line(self.proc.exitcode)) from None

    def reset(self) -> None:
        pass  # every call starts from an empty context (greedy's reset=True)

    def greedy(self, prompt_ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
        self.conn.send(([int(t) for t in prompt_ids], set(eos), int(max_new_tokens)))
        return self._receive()

    def close(self) -> None:
        self._finalizer()
