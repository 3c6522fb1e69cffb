"""Prompt sets (JSONL with `turns` or `prompt`, or plain text) and the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from viasd_core.errors import UsageError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


PROBE_PROMPTS = 2  # the shipped prompts a measured choice (--tree auto: machine/tree.py) probes acceptance on


def default_prompts() -> list[Prompt]:
    """The small prompt set shipped in the package (our own text, Spec-Bench categories)."""
    text = resources.files("viasd_core").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    return _parse_jsonl(text.splitlines(), "the shipped prompt set")


def load_prompts(path: str | Path | None, limit: int | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (`turns` or `prompt` field, optional `category`), or plain text
    (one prompt per non-empty line); the shipped default set when path is None."""
    if path is None:
        prompts = default_prompts()
    else:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"prompt file '{path}' not found")
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise UsageError(f"prompt file '{path}' is not UTF-8 text")
        first = next((line for line in lines if line.strip()), "")
        if first.lstrip().startswith("{"):
            prompts = _parse_jsonl(lines, f"'{path}'")
        else:
            prompts = [Prompt(str(i), "text", line.strip()) for i, line in enumerate(lines) if line.strip()]
    if categories:
        wanted = {c.strip() for c in categories}
        prompts = [p for p in prompts if p.category in wanted]
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise UsageError(f"no prompts in {path or 'the shipped set'}" + (f" for categories {categories}" if categories else ""))
    return prompts


def _parse_jsonl(lines: list[str], where: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} line {n} is not valid JSON ({e.msg}): fix the line or use plain text, one prompt per line")
        if not isinstance(row, dict):
            raise UsageError(f"{where} line {n}: expected a JSON object with a 'turns' or 'prompt' field")
        if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
            text = row["turns"][0]
        elif isinstance(row.get("prompt"), str):
            text = row["prompt"]
        else:
            raise UsageError(f"{where} line {n}: needs a 'turns' list of strings or a 'prompt' string")
        if not text.strip():
            raise UsageError(f"{where} line {n}: the prompt is empty")
        out.append(Prompt(str(row.get("question_id", row.get("id", n))), str(row.get("category", "text")), text))
    return out


def encode(tokenizer, messages_or_text, raw: bool = False, system: str | None = None,
           template_kwargs: dict | None = None) -> list[int]:
    """Token ids for a prompt: the chat template for instruct models, plain text with `raw`.
    `template_kwargs`: extra variables for the template (Qwen3's `enable_thinking`, ...)."""
    if isinstance(messages_or_text, str):
        if not messages_or_text.strip():
            raise UsageError("the prompt is empty: give some text")
        messages = [{"role": "user", "content": messages_or_text}]
    else:
        messages = list(messages_or_text)
    if system:
        messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
    if raw or not getattr(tokenizer, "chat_template", None):
        text = "\n".join(m["content"] for m in messages)
        return tokenizer(text).input_ids
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False).input_ids


def probe_prompts(tokenizer, n: int = PROBE_PROMPTS) -> list[list[int]]:
    """The prompts `--tree auto` measures acceptance on: the first shipped ones, encoded."""
    return [encode(tokenizer, p.text) for p in default_prompts()[:n]]
