"""Which token ids every model of a session may read and emit.

Embedding row counts need not match the tokenizer: Qwen2.5-7B has 152064 rows, its 0.5B draft
151936, their tokenizer 151665 tokens. The rows past the tokenizer are padding; an id there is
no token, and one past the draft's rows crashes the draft (IndexError; a device assert on CUDA).
So every model of a session has its logits masked (FastModel.vocab_limit) below the smallest
row count in play: it can then never emit such an id.
"""

from __future__ import annotations

from viasd_core.runtime.model import FastModel


def token_rows(hf_model) -> int:
    """Token ids a model can both read and score: min(input embedding rows, lm_head rows)."""
    return min(hf_model.get_input_embeddings().num_embeddings, hf_model.get_output_embeddings().out_features)


def tokenizer_size(tokenizer) -> int | None:
    """One past the largest token id of the tokenizer (len() unless its ids have gaps); None without one."""
    if tokenizer is None:
        return None
    ids = tokenizer.get_vocab().values()
    return max(len(tokenizer), max(ids) + 1 if ids else 0)


def emittable(fast: FastModel) -> int:
    """The number of leading ids `fast` may emit (its logit width when unmasked)."""
    return fast.shape.vocab_size if fast.vocab_limit is None else fast.vocab_limit


def cap_vocab(fast: FastModel, limit: int | None) -> None:
    """Mask `fast`'s logits from id `limit` on, unless it is already masked as low or has no such id."""
    if limit is not None and limit < emittable(fast):
        fast.vocab_limit = int(limit)
