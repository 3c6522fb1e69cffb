"""viasd: multi-tier speculative decoding (VIA-SD) for local LLM generation."""

__version__ = "0.1.0"
