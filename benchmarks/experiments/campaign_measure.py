"""Measurements behind the campaign's choices (docs/campaign.md), on the embedded target, one thread.

    python benchmarks/experiments/campaign_measure.py gen-batch --prompts P.jsonl [P2.jsonl ...] --batches 32 32p 16 48 64
        answer tokens per second of teacher_answers.build_dataset over the same 64 prompts (sampled,
        T = 0.8, 256 new tokens) per batch size; "32p": batch 32 without dropping rows that ended
    python benchmarks/experiments/campaign_measure.py teacher-vs-train --shard S.npz
        one teacher pass (features + top-20) against one training step of the head (3 TTT steps,
        bf16 autocast) on the same 8 sequences: why features are stored, not recomputed per batch

    python benchmarks/experiments/campaign_measure.py batching --shard S.npz
        the teacher pass over 32 sequences with the output layer on every position against from the
        last prompt position on (teacher_pass), interleaved; then a training step on 8 sequences in
        the shard's order against 8 of similar length (what group_by_length batches)
    python benchmarks/experiments/campaign_measure.py train-step --shard S.npz --features DIR [--threads 2] [--bf16]
        a training step on 8 sequences of similar length from a shard's stored features, the output
        layer on the labelled rows only (what training runs) against on every row, interleaved
    python benchmarks/experiments/campaign_measure.py on-policy-check --shard S.npz --features DIR --head DIR [-n 16]
        greedy `sd` with the head in blocks of 4 drafts, run in the engine on the shard's first n
        training prompts (the reference), against the same rejections simulated over the stored
        answers and their bfloat16 features (what the campaign's on-policy stage does)

One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from viasd_core.loading.models import load_model
from viasd_core.loading.prompts import load_prompts
from viasd_core.training import campaign_store as store
from viasd_core.speculation.eagle_files import load_feature_head
from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt, teacher_answers
from viasd_core.training.campaign_eval import head_session
from viasd_core.training.campaign_features import CampaignRecords
from viasd_core.training.on_policy import OnPolicyConfig, sd_rollouts, simulate_blocks


def gen_batch(target, prompts: list[str], batches: list[str]) -> None:
    for spec in batches:
        bs, compact = int(spec.rstrip("p")), not spec.endswith("p")
        plain = teacher_answers.generate_batch
        teacher_answers.generate_batch = lambda *a, **k: plain(*a, compact=compact, **k)
        try:
            t0 = time.perf_counter()
            recs = teacher_answers.build_dataset(target, prompts, 256, batch_size=bs, temperature=0.8, seed=1,
                                                 max_prompt_tokens=1024)
            dt = time.perf_counter() - t0
        finally:
            teacher_answers.generate_batch = plain
        n = sum(r.labels.numel() for r in recs)
        print(json.dumps({"batch": bs, "compact": compact, "seconds": round(dt, 1), "tokens": n,
                          "tokens_per_s": round(n / dt, 1)}), flush=True)


def teacher_vs_train(target, shard: Path) -> None:
    layers = eagle_data.default_feature_layers(target.model.config.num_hidden_layers)
    seqs = store.SequenceShard.load(shard)
    batch = [(s.tolist(), p, "") for s, p in zip(seqs.sequences[:8], seqs.prompt_lens[:8])]
    for _ in range(2):  # the second one is timed
        t0 = time.perf_counter()
        recs = eagle_data.teacher_pass(target.model, batch, layers, batch_size=8)
        teacher = time.perf_counter() - t0
    head = eagle_init.init_head(target.model, layers, torch.arange(8192))
    index = eagle_train.draft_index(head)
    opt = torch.optim.AdamW([p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")], lr=1e-4)
    for _ in range(3):  # the last one is timed
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = eagle_ttt.ttt_loss(head, recs, index, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step = time.perf_counter() - t0
    positions = sum(len(s) for s, _, _ in batch)
    print(json.dumps({"positions": positions, "padded": 8 * max(len(s) for s, _, _ in batch),
                      "teacher_s": round(teacher, 2), "train_step_s": round(step, 2)}))


def batching(target, shard: Path) -> None:
    layers = eagle_data.default_feature_layers(target.model.config.num_hidden_layers)
    seqs = store.SequenceShard.load(shard)
    batch = [(s.tolist(), p, "") for s, p in zip(seqs.sequences[:32], seqs.prompt_lens[:32])]
    every_row = [(s, 0, c) for s, _, c in batch]  # prompt length 0: the output layer on every position
    seconds: dict[str, list[float]] = {"every position": [], "from the prompt's end": []}
    recs = None
    for _ in range(2):
        for name, data in (("every position", every_row), ("from the prompt's end", batch)):
            t0 = time.perf_counter()
            out = eagle_data.teacher_pass(target.model, data, layers, batch_size=8)
            seconds[name].append(time.perf_counter() - t0)
            recs = out if data is batch else recs
    print(json.dumps({"teacher_sequences": len(batch), "positions": sum(len(s) for s, _, _ in batch),
                      "prompt_positions": sum(p for _, p, _ in batch),
                      "teacher_s": {k: [round(x, 2) for x in v] for k, v in seconds.items()}}))
    head = eagle_init.init_head(target.model, layers, torch.arange(8192))
    index = eagle_train.draft_index(head)
    opt = torch.optim.AdamW([p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")], lr=1e-4)
    by_length = sorted(range(len(recs)), key=lambda i: len(recs[i].tokens))
    picks = {"shard order": list(range(8)), "similar length": by_length[12:20]}
    steps: dict[str, list[float]] = {k: [] for k in picks}
    for _ in range(3):  # the first round warms up
        for name, idx in picks.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = eagle_ttt.ttt_loss(head, [recs[i] for i in idx], index, 3)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps[name].append(time.perf_counter() - t0)
    for name, idx in picks.items():
        lengths = [len(recs[i].tokens) for i in idx]
        print(json.dumps({"train_batch": name, "positions": sum(lengths), "padded": 8 * max(lengths),
                          "step_s": [round(x, 2) for x in steps[name][1:]]}))


def train_step(target, shard: Path, features: Path, bf16: bool, rounds: int = 4) -> None:
    layers = eagle_data.default_feature_layers(target.model.config.num_hidden_layers)
    records = CampaignRecords([shard], features, keep=lambda i: True)
    lengths = records.lengths()
    by_length = sorted(range(len(records)), key=lengths.__getitem__)
    picks = [by_length[k : k + 8] for k in range(len(by_length) // 2, len(by_length), len(by_length) // 8)][:rounds]
    head = eagle_init.init_head(target.model, layers, torch.arange(8192))
    index = eagle_train.draft_index(head)
    opt = torch.optim.AdamW([p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")], lr=1e-4)
    seconds: dict[str, list[float]] = {"labelled rows": [], "every row": []}
    for r, idx in enumerate([picks[0]] + picks):  # the first batch warms up, untimed
        recs = [records[i] for i in idx]
        for name, rows_only in (("labelled rows", True), ("every row", False)):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = eagle_ttt.ttt_loss(head, recs, index, 3, rows_only=rows_only)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if r:
                seconds[name].append(time.perf_counter() - t0)
    positions = [sum(lengths[i] for i in idx) for idx in picks]
    print(json.dumps({"threads": torch.get_num_threads(), "bf16": bf16, "positions": positions,
                      "step_s": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
                      "ratio": round(sum(seconds["every row"]) / sum(seconds["labelled rows"]), 3)}))


def on_policy_check(target, shard: Path, features: Path, head_dir: Path, n: int, held_out_every: int = 20) -> None:
    config = OnPolicyConfig()
    records = CampaignRecords([shard], features, keep=lambda i: i % held_out_every != 0)
    picked = [records[k] for k in range(min(n, len(records)))]
    prompts = [r.tokens[: r.prompt_len].tolist() for r in picked]
    session = head_session("smollm2-135m", head_dir, max_context=1024 + config.max_new_tokens + 8)
    t0 = time.perf_counter()
    seqs, ref = sd_rollouts(session.engine, prompts, config)
    sd_s = time.perf_counter() - t0
    head = load_feature_head(head_dir, target.model.config, embed=target.model.get_input_embeddings(), dtype=torch.float32)
    t0 = time.perf_counter()
    sim = simulate_blocks(head, picked, config)
    sim_s = time.perf_counter() - t0
    same_text = [s == r.tokens.tolist() for s, r in zip(seqs, picked)]
    both = [(a, b) for a, b, same in zip(ref, sim, same_text) if same]  # rejections compare on the same text
    inter = sum(len(set(a.rejections) & set(b.rejections)) for a, b in both)
    union = sum(len(set(a.rejections) | set(b.rejections)) for a, b in both)
    tau = lambda ws: round(sum(w.new_tokens for w in ws) / max(sum(w.target_passes for w in ws), 1), 3)
    print(json.dumps({"sequences": len(picked), "same_text": sum(same_text),
                      "identical_rejection_lists": sum(a.rejections == b.rejections for a, b in both),
                      "rejections_sd": sum(len(a.rejections) for a, _ in both),
                      "rejections_simulated": sum(len(b.rejections) for _, b in both),
                      "rejection_jaccard": round(inter / max(union, 1), 4),
                      "tau_sd": tau([a for a, _ in both]), "tau_simulated": tau([b for _, b in both]),
                      "sd_s": round(sd_s, 1), "simulated_s": round(sim_s, 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["gen-batch", "teacher-vs-train", "batching", "on-policy-check", "train-step"])
    ap.add_argument("--prompts", nargs="*", default=[], help="gen-batch: prompt files, the first 64 prompts are used")
    ap.add_argument("--every", type=int, default=1, help="gen-batch: every k-th prompt of the files after the first")
    ap.add_argument("--batches", nargs="*", default=["32", "32p", "16", "48", "64"])
    ap.add_argument("--shard", type=Path, help="teacher-vs-train, batching, on-policy-check: an answer shard")
    ap.add_argument("--features", type=Path, default=Path("out/campaign/features"), help="on-policy-check, train-step")
    ap.add_argument("--head", type=Path, help="on-policy-check: the head folder")
    ap.add_argument("-n", type=int, default=16, help="on-policy-check: training prompts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="train-step: bfloat16 autocast")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("smollm2-135m", dtype="float32")
    if args.what == "gen-batch":
        prompts = [p.text for p in load_prompts(args.prompts[0])]
        for f in args.prompts[1:]:
            prompts += [p.text for p in load_prompts(f)][:: args.every]
        gen_batch(target, prompts[:64], args.batches)
    elif args.what == "on-policy-check":
        on_policy_check(target, args.shard, args.features, args.head, args.n)
    elif args.what == "train-step":
        train_step(target, args.shard, args.features, args.bf16)
    elif args.what == "batching":
        batching(target, args.shard)
    else:
        teacher_vs_train(target, args.shard)


if __name__ == "__main__":
    main()
