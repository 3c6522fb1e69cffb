"""The runners `viasd bench` times, one per method, each called with a prompt's token ids.

A runner has `reset()` (called before every run, so that runs start alike) and returns an
`Output` when called. `EngineRunner` runs our engine; `HFRunner` runs transformers' `generate()`
(plain, assisted by a draft model, or prompt lookup); `full_vocab_assistant` lets a
reduced-vocabulary draft serve as transformers' assistant. `Skip` stands for a method that cannot
run here (reported as skipped), `Broken` for one whose set-up raised (reported as failed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from viasd_core.bench import llama_cpp_proc
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.errors import ViasdError


@dataclass
class Output:
    """What one run produced (the harness adds the wall time and the fidelity)."""

    tokens: list[int]
    finish_reason: str
    target_passes: int
    accepted_lengths: list[int]
    stats: object | None = None  # RunStats for our engine, None for transformers


class Skip(Exception):
    """A method that cannot run in this set-up (reported as skipped with the reason)."""


class Broken:
    """A method whose set-up raised: running it re-raises, so the harness reports it failed."""

    def __init__(self, error: Exception):
        self.error = error

    def reset(self) -> None:
        pass

    def __call__(self, prompt_ids):
        raise self.error


# ---------------------------------------------------------------------- our engine
class EngineRunner:
    def __init__(self, engine: Engine, config: GenerationConfig):
        self.engine = engine
        self.config = config

    def reset(self) -> None:
        self.engine.reset()  # no prefix re-use between runs: every run prefills its prompt
        if self.engine.drafter is not None:  # nor memory of earlier runs (the suffix index's history):
            self.engine.drafter.forget()  # a repeat, or another method on the same prompt, would copy its answer

    def __call__(self, prompt_ids: list[int]) -> Output:
        gen = self.engine.generate(prompt_ids, self.config)
        s = gen.stats
        return Output(list(gen.tokens), gen.finish_reason, s.target_passes, list(s.accepted_lengths), s)


# ---------------------------------------------------------------------- transformers
class FullVocabHead(torch.nn.Module):
    """A draft head with Vd outputs seen as a head over the target's V: the Vd logits are scattered
    to their target ids (`vocab_map`), every other id gets -inf (never proposed)."""

    def __init__(self, head: torch.nn.Module, vocab_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = head
        self.register_buffer("vocab_map", vocab_map.to(torch.long), persistent=False)
        self.vocab_size = int(vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        draft_logits = self.head(hidden)  # [..., Vd]
        if draft_logits.shape[-1] != self.vocab_map.shape[0]:  # padded rows beyond the map
            draft_logits = draft_logits[..., : self.vocab_map.shape[0]]
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.vocab_map, draft_logits)


def full_vocab_assistant(draft_hf, target_hf):
    """An assistant model transformers accepts for `target_hf`, with a generation config of its own
    (transformers adapts `num_assistant_tokens` in place: that must never leak into the config the
    draft was loaded with). The draft itself when its vocabulary is the target's; otherwise a
    shell of the draft's class that shares its decoder (no copy, the draft is not modified) under
    a FullVocabHead, with its own config."""
    target_vocab = target_hf.config.get_text_config().vocab_size
    target_rows = target_hf.get_output_embeddings().out_features
    draft_rows = draft_hf.get_output_embeddings().out_features
    vocab_map = getattr(draft_hf, "viasd_vocab_map", None)
    if vocab_map is None and draft_rows == target_rows and draft_hf.config.get_text_config().vocab_size == target_vocab:
        draft_hf.generation_config = copy.deepcopy(draft_hf.generation_config)
        return draft_hf
    if vocab_map is None:  # same tokenizer, padded differently
        vocab_map = torch.arange(min(draft_rows, target_rows), device=draft_hf.device)
    config = copy.deepcopy(draft_hf.config)
    config.vocab_size = target_vocab
    with torch.device("meta"):
        shell = type(draft_hf)(config)
    prefix = draft_hf.base_model_prefix
    setattr(shell, prefix, getattr(draft_hf, prefix))
    shell.set_output_embeddings(FullVocabHead(draft_hf.get_output_embeddings(), vocab_map, target_rows))
    shell.generation_config = copy.deepcopy(draft_hf.generation_config)
    leftover = [n for n, p in shell.named_parameters() if p.is_meta]
    if leftover:
        raise ViasdError(f"could not wrap the draft for transformers assisted generation (unshared weights: {leftover[:3]})")
    return shell.eval()


def hf_accepted_lengths(prompt_len: int, total_new: int, cache_lens: list[int | None]) -> list[int]:
    """Tokens committed per target pass of transformers' generate(), from the KV-cache length seen
    at the start of each pass (pass i > 0 is fed the last committed token first). [] if unknown."""
    if not cache_lens or any(c is None for c in cache_lens):
        return []
    committed = [prompt_len] + [c + 1 for c in cache_lens[1:]]  # committed tokens before each pass
    committed.append(prompt_len + total_new)
    lengths = [b - a for a, b in zip(committed, committed[1:])]
    return lengths if all(n >= 1 for n in lengths) else []


class HFRunner:
    """transformers `generate()` on the target: greedy, assisted (draft) or prompt lookup."""

    def __init__(self, target_hf, eos: set[int], max_new_tokens: int, pad_token_id: int,
                 assistant=None, prompt_lookup: int | None = None, gamma: int = 5, adaptive: bool = True):
        self.model = target_hf
        self.eos = set(eos)
        self.assistant = assistant
        self.gamma = gamma
        self.adaptive = adaptive
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           eos_token_id=sorted(self.eos) or None,
                           pad_token_id=pad_token_id)
        if prompt_lookup:
            self.kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        self.device = next(target_hf.parameters()).device

    def reset(self) -> None:
        if self.assistant is not None:  # transformers adapts these in place: start every run alike
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = self.gamma
            gc.num_assistant_tokens_schedule = "heuristic" if self.adaptive else "constant"

    @torch.inference_mode()
    def __call__(self, prompt_ids: list[int]) -> Output:
        ids = torch.tensor([prompt_ids], device=self.device)
        cache_lens: list[int | None] = []

        def count(module, args, kwargs):
            # transformers 5.24 passes the cache as `cache` (`past_key_values` before, deprecated since)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            cache_lens.append(int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else None)

        handle = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
            seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs, **extra)
        finally:
            handle.remove()
        produced = seq[0, len(prompt_ids):].tolist()
        tokens, reason = produced, "length"
        for i, t in enumerate(produced):  # same convention as our engine: stop at (and keep) EOS
            if t in self.eos:
                tokens, reason = produced[: i + 1], "eos"
                break
        lengths = hf_accepted_lengths(len(prompt_ids), len(produced), cache_lens)
        if len(tokens) < len(produced) and lengths:  # tokens after EOS were dropped: trim the last passes
            lengths = _trim_lengths(lengths, len(tokens))
        return Output(tokens, reason, len(cache_lens), lengths, None)


def _trim_lengths(lengths: list[int], total: int) -> list[int]:
    out, left = [], total
    for n in lengths:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


# ---------------------------------------------------------------------- llama.cpp
class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on a GGUF file, greedy, on the CPU with torch's thread count:
    what a person running a model on a CPU would otherwise use. Fed the same prompt token ids
    (the GGUF's vocabulary is the target's); its output is scored against the target like any
    other method's (fidelity). In a process of its own unless `own_process` is False
    (llama_cpp_proc.py says why)."""

    def __init__(self, gguf: str, eos: set[int], max_new_tokens: int, n_ctx: int, n_threads: int,
                 own_process: bool = True):
        kwargs = dict(model_path=gguf, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                      n_gpu_layers=0, verbose=False)
        self.llm = (llama_cpp_proc.OwnProcess if own_process else llama_cpp_proc.InProcess)(kwargs)
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.build = self.llm.system_info  # which instruction sets this llama.cpp was built for

    def reset(self) -> None:
        self.llm.reset()

    def __call__(self, prompt_ids: list[int]) -> Output:
        tokens, finish = self.llm.greedy(prompt_ids, self.eos, self.max_new_tokens)
        return Output(tokens, finish, len(tokens), [1] * len(tokens))

    def close(self) -> None:
        self.llm.close()


def llama_cpp_runner(target_ref: str, eos: set[int], max_new_tokens: int, n_ctx: int):
    """The llama.cpp runner for the embedded target's GGUF file, or a Skip saying why not."""
    import importlib.util

    from viasd_core.loading.models import EMBEDDED_ALIASES, embedded_gguf

    if importlib.util.find_spec("llama_cpp") is None:
        return Skip("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from source; "
                    "scripts/install_llama_cpp.sh builds it without the AMX kernels that GCC 12 miscompiles)")
    if target_ref.lower() not in EMBEDDED_ALIASES:
        return Skip("llama.cpp runs a GGUF file: only the embedded target has one (its Q4_1 file)")
    return LlamaCppRunner(str(embedded_gguf()), eos, max_new_tokens, n_ctx, torch.get_num_threads())
