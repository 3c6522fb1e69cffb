"""llama.cpp for `viasd bench --methods llama.cpp`: in a process of its own by default.

llama.cpp is native code that can crash the process it runs in: measured 2026-11-28, llama-cpp-python
0.3.36 built with `-march=native` on a 2-core Xeon (AVX-512 BF16, AMX) ended in a segmentation fault
on any prompt of more than a few tokens, which killed the whole `viasd bench` run with the other
methods' results. In a child process a crash fails the llama.cpp method alone (the harness records
its one line) and each library runs its own threads, as a user's llama.cpp would. The bench times
the call from its side, so a pipe message each way per prompt (well under a millisecond against
seconds of generation) is inside llama.cpp's figure.

`InProcess` is the plain reference (the tests drive it with a stand-in module); `OwnProcess` runs
the same `greedy` in a spawned child.
"""

from __future__ import annotations

import multiprocessing


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

    def reset(self) -> None:
        self.llm.reset()

    def greedy(self, prompt_ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
        return greedy(self.llm, prompt_ids, eos, max_new_tokens)

    def close(self) -> None:
        pass


def _serve(conn, kwargs: dict) -> None:
    """The child: one InProcess, answering (prompt_ids, eos, max_new_tokens) until None."""
    try:
        local = InProcess(kwargs)
    except Exception as e:  # reported to the parent as one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while (request := conn.recv()) is not None:
        conn.send(local.greedy(*request))


class OwnProcess:
    """The same calls answered by a spawned child process (see the module's doc)."""

    def __init__(self, kwargs: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True, name="viasd-llama.cpp")
        self.proc.start()
        child.close()
        status, detail = self._receive()
        if status != "ready":
            self.close()
            raise RuntimeError(f"llama.cpp did not start: {detail}")

    def _receive(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"llama.cpp's process ended (exit code {self.proc.exitcode})") from None

    def reset(self) -> None:
        pass  # every call starts from an empty context (greedy's reset=True)

    def greedy(self, prompt_ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
        self.conn.send(([int(t) for t in prompt_ids], set(eos), int(max_new_tokens)))
        return self._receive()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
        self.conn.close()
