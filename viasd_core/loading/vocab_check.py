"""Target and draft must share one tokenizer: compare two vocabularies, naming both models on a mismatch.

Speculative decoding compares token ids, so a draft is only usable when it maps every token to
the same id as the target. `viasd pull` checks the tokenizers saved with a pulled pair
(`check_same_tokenizer`); loading checks those of the loaded models (`check_vocabularies`).
"""

from __future__ import annotations

from pathlib import Path

from viasd_core.errors import ViasdError

SAME_FAMILY_FIX = "pick a draft from the same model family (see `viasd models`)"


def check_same_tokenizer(
    target_path: str | Path,
    draft_path: str | Path,
    target_name: str | None = None,
    draft_name: str | None = None,
) -> None:
    """Raise a ViasdError naming both models when the tokenizers saved in two folders differ."""
    target_name = target_name or str(target_path)
    draft_name = draft_name or str(draft_path)
    check_vocabularies(_load_vocab(target_path, target_name), _load_vocab(draft_path, draft_name), target_name, draft_name)


def check_vocabularies(target_vocab: dict[str, int], draft_vocab: dict[str, int], target_name: str, draft_name: str,
                       fix: str = SAME_FAMILY_FIX) -> None:
    """Raise a ViasdError naming both models (and `fix`) when two vocabularies (token -> id) differ.

    Speculative decoding compares token ids, so target and draft must map every token to the
    same id. Only the tokenizers are compared: a model whose embedding matrix has padding rows
    beyond the tokenizer (config vocab_size larger, like Qwen2.5-7B's 152064 for 151665 tokens)
    is fine.
    """
    if target_vocab == draft_vocab:
        return
    differing = sorted(
        (tok for tok in set(target_vocab) | set(draft_vocab) if target_vocab.get(tok) != draft_vocab.get(tok)),
        key=lambda tok: (min(target_vocab.get(tok, 1 << 62), draft_vocab.get(tok, 1 << 62)), tok),
    )
    example = differing[0]
    raise ViasdError(
        f"target {target_name} and draft {draft_name} use different tokenizers "
        f"({len(target_vocab)} vs {len(draft_vocab)} tokens, {len(differing)} differ, e.g. {example!r}: "
        f"id {target_vocab.get(example)} vs {draft_vocab.get(example)}); {fix}"
    )


def _load_vocab(path: str | Path, name: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ViasdError(f"cannot load the tokenizer of {name} from {path} ({first_line})") from None
    return dict(tokenizer.get_vocab())
