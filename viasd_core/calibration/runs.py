"""The runs calibration makes on its prompts: plain generations (the calibration text, the held-out
validation) and the recording runs whose blocks the threshold fit replays."""

from __future__ import annotations

from dataclasses import dataclass

from viasd_core.calibration.recording import BlockRecorder
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.fidelity import fidelity
from viasd_core.speculation.router import BlockRecord
from viasd_core.speculation.stats import RunStats


@dataclass
class RunSummary:
    stats: RunStats
    fidelity: float | None  # token-weighted over prompts; None: not measured


def run_prompts(engine: Engine, hf_model, prompts_ids: list[list[int]], config: GenerationConfig,
                measure_fidelity: bool = True, progress=None, outputs: list | None = None) -> RunSummary:
    total = RunStats(mode=config.mode)
    agree = count = 0
    for ids in prompts_ids:
        engine.reset()
        gen = engine.generate(ids, config)
        total.merge(gen.stats)
        if outputs is not None:
            outputs.append(ids + gen.tokens)
        if measure_fidelity and gen.tokens:
            f = fidelity(hf_model, ids, gen.tokens)
            agree += f * len(gen.tokens)
            count += len(gen.tokens)
        if progress:
            progress()
    total.fidelity = agree / count if count else None  # None: not measured (or no token)
    return RunSummary(total, total.fidelity)


def collect_blocks(engine: Engine, prompts_ids: list[list[int]], config: GenerationConfig, progress=None) -> list[list[BlockRecord]]:
    """Run exact sd with the slim verifier recording; one list of BlockRecords per prompt."""
    per_prompt = []
    for ids in prompts_ids:
        per_prompt.append(record_blocks(engine, ids, config))
        if progress:
            progress()
    return per_prompt


def record_blocks(engine: Engine, prompt_ids: list[int], config: GenerationConfig) -> list[BlockRecord]:
    """The BlockRecords of one exact sd run on `prompt_ids` (the slim verifier's gates and the
    target's teacher-forced labels, per drafted block), recorded by an engine observer."""
    engine.reset()
    recorder = BlockRecorder()
    engine.observers.append(recorder)
    try:
        engine.generate(prompt_ids, GenerationConfig(mode="sd", max_new_tokens=config.max_new_tokens, gamma=config.gamma,
                                                     adaptive=config.adaptive, gamma_max=config.gamma_max))
        return recorder.blocks
    finally:
        engine.observers.remove(recorder)
