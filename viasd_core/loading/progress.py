"""What loading shows the user: transformers' own bars and advice kept off stderr, and whether a
`progress` callback wants bars and spinners."""

from __future__ import annotations

import contextlib


def quiet_transformers() -> None:
    """Keep transformers' progress bars and advice off stderr (our statistics live there), and
    bitsandbytes' per-call notices (one per 8-bit matmul: thousands per answer)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def shows_progress(progress) -> bool:
    """Whether a `progress` callback wants bars and spinners (None, or one marked `quiet`, does not)."""
    return progress is not None and not getattr(progress, "quiet", False)


def loading_status(progress, text: str):
    """A context manager under which a model loads: the callback's `status(text)` where it has one
    (the CLI's spinner on a terminal: cli/options.StderrLog), else nothing."""
    status = getattr(progress, "status", None)
    return status(text) if callable(status) and shows_progress(progress) else contextlib.nullcontext()
