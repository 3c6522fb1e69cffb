"""The EAGLE-3 head's training campaign for the embedded target (viasd_core/training/campaign.py).

    python recipes/eagle_campaign.py run      # run or resume every stage (hours on a CPU)
    python recipes/eagle_campaign.py run --until answers
    python recipes/eagle_campaign.py status   # how far it got, from the files alone
    python recipes/eagle_campaign.py answer-speed --specs int4:32 none:32   # answer tokens/s by format and batch
    python recipes/eagle_campaign.py answer-agreement --quant int4 --shard S.npz -n 32   # stored answers vs the deployed target
    python recipes/eagle_campaign.py run --slice --data out/slice/data --work out/slice/work   # a small end-to-end run

Committed data goes to --data (default data/campaign-smollm2-135m: prompts, answer token ids, the
evaluation report); features, the on-policy rejections, checkpoints and heads go to --work (default
out/campaign, not committed). Run it niced, one thread, in the background (`--threads 2` with
OMP_NUM_THREADS=2 while the machine has nothing else to do; a run may resume at another count):

    nohup nice -n 19 env OMP_NUM_THREADS=1 python3 recipes/eagle_campaign.py run >> out/campaign.log 2>&1 &

The campaign for the target as deployed (int4 weights, bfloat16 activations), on the first
campaign's prompts:

    python recipes/eagle_campaign.py run --quant int4 --prompts-from data/campaign-smollm2-135m/prompts.jsonl \
        --data data/campaign-smollm2-135m-int4 --work out/campaign-int4 --until answers
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from viasd_core.errors import UsageError
from viasd_core.training.campaign import STAGES, CampaignConfig, run_campaign, status
from viasd_core.training.campaign_answers import AnswerConfig
from viasd_core.training.campaign_eval import EvalConfig
from viasd_core.training.campaign_prompts import PromptConfig, RequestRound
from viasd_core.training.campaign_train import TrainConfig
from viasd_core.training.on_policy import OnPolicyConfig

ROOT = Path(__file__).resolve().parents[1]
EVALUATION = [ROOT / "benchmarks/data/spec_bench_dev.jsonl", ROOT / "docs/results/cpu-prompts.jsonl",
              ROOT / "viasd_core/data/prompts.jsonl"]  # never trained on: nothing near them is kept

# the first round kept 32 writing and 58 reasoning prompts (their templates collapse as near-duplicates)
# and 4,165 prompts in all: 670 sequences short of 9,000. A second round asks the target for those two.
THIN = RequestRound("thin", 1200, seed=1, mix="thin")


def log(msg: str) -> None:
    print(time.strftime("%Y-%m-%d %H:%M:%S"), msg, file=sys.stderr, flush=True)


def config(args) -> CampaignConfig:
    cfg = CampaignConfig(
        target=args.target, data=Path(args.data), work=Path(args.work), threads=args.threads,
        prompts=PromptConfig(extra=[ROOT / "viasd_core/data/distill_prompts.jsonl"], evaluation=EVALUATION,
                             more=[THIN]),
        evaluation=EvalConfig(prompts=ROOT / "docs/results/cpu-prompts.jsonl"),
        ship_to=None if args.slice else ROOT / "viasd_core/data/drafts/smollm2-135m-eagle3",
        quant=args.quant, prompts_from=Path(args.prompts_from) if args.prompts_from else None)
    if args.train_steps or args.on_policy_steps or args.extend_to:
        t = cfg.train
        data = replace(t.data, steps=args.train_steps) if args.train_steps else t.data
        if args.extend_to:
            data = replace(data, steps=args.extend_to, extend=True, lr=args.extend_lr)
        tuned = replace(t.on_policy, steps=args.on_policy_steps) if args.on_policy_steps else t.on_policy
        cfg = replace(cfg, train=replace(t, data=data, on_policy=tuned))
    if args.skip_on_policy:
        cfg = replace(cfg, on_policy_stage=False)
    if args.slice:  # every stage on a few prompts: checks the pipeline end to end in minutes
        t = TrainConfig()
        cfg = replace(cfg, prompts=replace(cfg.prompts, requests=48, shard_size=24, extra=[], more=[]),
                      answers=AnswerConfig(max_new_tokens=48, shard_size=12),
                      train=replace(t, data=replace(t.data, steps=20, eval_every=10, checkpoint_every=5),
                                    on_policy=replace(t.on_policy, steps=10, eval_every=5, checkpoint_every=5)),
                      on_policy=OnPolicyConfig(max_new_tokens=48),
                      evaluation=replace(cfg.evaluation, answer_tokens=48, tau_tokens=32))
    return cfg


def answer_speed(args) -> None:
    """Answer tokens/s of the answer stage's generation (teacher_answers.build_dataset, greedy) on the
    same prompts for each `FORMAT:BATCH` in --specs (`FORMAT:BATCH:plain`: packed weights widened at
    every pass, as before build_dataset held them); one JSON line each on stdout."""
    import contextlib
    import json

    import torch

    from viasd_core.loading.models import load_model
    from viasd_core.loading.prompts import load_prompts
    from viasd_core.training import teacher_answers

    torch.set_num_threads(args.threads)
    prompts = [p.text for p in load_prompts(args.prompts)][:: args.every][: args.n]
    models: dict = {}
    for spec in args.specs:
        quant, batch, *rest = spec.split(":")
        if quant not in models:
            models[quant] = load_model(args.target, dtype="float32" if quant == "none" else None, quant=quant)
        held = teacher_answers._widened_once
        if rest == ["plain"]:
            teacher_answers._widened_once = lambda model: contextlib.nullcontext()
        try:
            t0 = time.perf_counter()
            recs = teacher_answers.build_dataset(models[quant], prompts, args.new_tokens, batch_size=int(batch),
                                                 max_prompt_tokens=1024)
            dt = time.perf_counter() - t0
        finally:
            teacher_answers._widened_once = held
        n = sum(r.labels.numel() for r in recs)
        print(json.dumps({"spec": spec, "prompts": len(prompts), "seconds": round(dt, 1), "tokens": n,
                          "tokens_per_s": round(n / dt, 1)}), flush=True)


def answer_agreement(args) -> None:
    """How often stored greedy answers are the deployed target's greedy choice: each of a shard's
    first -n sequences is fed through viasd's own pass (FastModel) with the target at --quant, the
    answer in passes of --rows tokens after the prompt's prefill (1: as decoding feeds it), and the
    positions whose argmax is the stored token are counted; with --teacher-quant, also the positions
    where the feature stage's label (teacher_pass's top-1 at that format) is that argmax. One JSON
    line on stdout."""
    import json

    import torch

    from viasd_core.runtime.model import FastModel
    from viasd_core.loading.models import load_model
    from viasd_core.training import campaign_store as store

    from viasd_core.training import eagle_data

    def load(quant: str):
        return load_model(args.target, device="cpu", quant=quant, dtype="float32" if quant == "none" else None)

    torch.set_num_threads(args.threads)
    loaded = load(args.quant)
    fm = FastModel(loaded.model, max_len=4096)
    layers = eagle_data.default_feature_layers(loaded.model.config.num_hidden_layers)
    teachers = {q: load(q).model for q in args.teacher_quant}
    hits = total = whole = count = 0
    labels = {q: 0 for q in teachers}
    for shard in args.shard:
        seqs = store.SequenceShard.load(Path(shard))
        pairs = list(zip(seqs.sequences, seqs.prompt_lens))[: args.n]
        # the feature stage's labels (teacher_pass's top-1, batches of 8) at each --teacher-quant
        taught = {q: eagle_data.teacher_pass(m, [(s.tolist(), p, "") for s, p in pairs], layers, batch_size=8)
                  for q, m in teachers.items()}
        for k, (seq, plen) in enumerate(pairs):
            fed = torch.from_numpy(seq.astype("int64"))
            answer = fed[plen:]
            fm.reset()
            fm.forward(fed[: plen - 1], 0)
            starts = range(plen - 1, len(fed) - 1, args.rows)
            pred = torch.cat([fm.forward(fed[i : min(i + args.rows, len(fed) - 1)], i, min(args.rows, len(fed) - 1 - i)).argmax(-1)
                              for i in starts])
            same = int((pred == answer).sum())
            hits, total, whole, count = hits + same, total + len(answer), whole + (same == len(answer)), count + 1
            for q, recs in taught.items():
                labels[q] += int((recs[k].top_ids[plen - 1 : len(fed) - 1, 0] == pred).sum())
    print(json.dumps({"shards": args.shard, "quant": args.quant, "rows_a_pass": args.rows, "sequences": count,
                      "positions": total, "agreement": round(hits / total, 4), "sequences_all_equal": whole,
                      **({"feature_labels_agreement": {q: round(n / total, 4) for q, n in labels.items()}} if labels else {})}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["run", "status", "answer-speed", "answer-agreement"])
    ap.add_argument("--shard", nargs="+", default=[], help="answer-agreement: answer shards (.npz) to teacher-force")
    ap.add_argument("--rows", type=int, default=1, help="answer-agreement: answer tokens a pass after the prefill")
    ap.add_argument("--teacher-quant", nargs="*", default=[],
                    help="answer-agreement: also the feature stage's labels (teacher_pass's top-1) made at these formats "
                         "against the deployed target's greedy token")
    ap.add_argument("--specs", nargs="+", default=["int4:32", "none:32"],
                    help="answer-speed: FORMAT:BATCH[:plain] to time, in order")
    ap.add_argument("--prompts", default=str(ROOT / "data/campaign-smollm2-135m/prompts.jsonl"),
                    help="answer-speed: the prompts (every --every-th, the first -n of those)")
    ap.add_argument("--every", type=int, default=79)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default=str(ROOT / "data/campaign-smollm2-135m"))
    ap.add_argument("--work", default=str(ROOT / "out/campaign"))
    ap.add_argument("--until", choices=STAGES, default=None, help="stop after this stage")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quant", choices=["none", "int8", "int4"], default="none",
                    help="the target's weight format for the answers and features: the one the head will draft "
                         "for (none: float32, the first campaign's); recorded in the data and work folders")
    ap.add_argument("--prompts-from", default=None,
                    help="use another campaign's prompts.jsonl (recorded by path and checksum in "
                         "<data>/campaign.json) instead of a prompt stage")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="steps of the data training (default: TrainConfig's); a checkpoint resumes only at its own")
    ap.add_argument("--extend-to", type=int, default=None,
                    help="continue a finished data training to this many steps in all (a warm restart; "
                         "the head it had made is kept as heads/data-<steps>)")
    ap.add_argument("--extend-lr", type=float, default=5e-4, help="the extension's peak learning rate")
    ap.add_argument("--on-policy-steps", type=int, default=None, help="steps of the on-policy fine-tune")
    ap.add_argument("--skip-on-policy", action="store_true",
                    help="evaluate the data head without the on-policy fine-tune (a later run can add it)")
    ap.add_argument("--slice", action="store_true", help="a small run of every stage (use other --data/--work)")
    args = ap.parse_args()
    if args.action == "answer-speed":
        answer_speed(args)
        return
    if args.action == "answer-agreement":
        answer_agreement(args)
        return
    cfg = config(args)
    if args.action == "status":
        print("\n".join(status(cfg)))
        return
    try:
        report = run_campaign(cfg, until=args.until, log=log)
    except UsageError as e:  # e.g. a checkpoint planned for another --train-steps: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if report.get("decision"):
        log(report["decision"])


if __name__ == "__main__":
    main()
