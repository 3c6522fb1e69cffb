"""GPU timings of the fused routing kernel against its PyTorch reference.

For every vocabulary size V and block size G it times one call of
`route_block_triton` and of `route_block_reference` on the same [G + 1, V] logits (the
last row is the bonus position), after checking that both give the same routing. It
prints one JSON line per configuration on stdout:

- `*_gpu_ms_p20/p50/p80`: device time from triton.testing.do_bench (warm-up first,
  L2 flushed before every run; p50 is the median).
- `*_wall_us`: host wall time per call, torch.cuda.synchronize() around a loop of
  calls, so launch overhead is included (what the engine's decode loop pays).

Needs a CUDA GPU and triton; exits with a message otherwise.

    python benchmarks/experiments/bench_kernels.py                      # bf16, all sizes
    python benchmarks/experiments/bench_kernels.py --dtype fp32 --vocab 151936 --gamma 4 8
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[100, 8193, 49152, 151936])
    parser.add_argument("--gamma", type=int, nargs="+", default=[1, 4, 8, 16], help="block sizes G")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--theta-accept", type=float, default=0.6)
    parser.add_argument("--theta-slim", type=float, default=0.15)
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up time")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench timed duration")
    parser.add_argument("--wall-iters", type=int, default=200, help="calls per wall-time loop")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def wall_us_per_call(fn, iters: int) -> float:
    for _ in range(3):  # warm-up
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def check_same_routing(fused, reference, context: str) -> None:
    for name in ("argmax", "tiers", "n_match", "first_non_accept"):
        if not torch.equal(getattr(fused, name), getattr(reference, name)):
            raise SystemExit(
                f"bench_kernels.py: triton and reference disagree on {name} ({context})"
            )
    for name in ("lse", "token_logprob", "gate"):
        torch.testing.assert_close(
            getattr(fused, name), getattr(reference, name), rtol=1e-5, atol=1e-5
        )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_kernels.py: no CUDA device is available; these timings need an NVIDIA GPU. "
            "(Correctness on CPU: TRITON_INTERPRET=1 pytest tests/kernels/test_kernels_routing.py)"
        )
    try:
        import triton.testing
    except ImportError as error:
        raise SystemExit(
            f"bench_kernels.py: triton does not import ({error}); pip install triton"
        ) from error

    from viasd_kernels import route_block_reference, route_block_triton

    device_name = torch.cuda.get_device_name()
    dtype = DTYPES[args.dtype]
    thetas = (args.temperature, args.theta_accept, args.theta_slim)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    for vocab_size in args.vocab:
        for num_draft in args.gamma:
            logits = (
                torch.randn(num_draft + 1, vocab_size, device="cuda", generator=generator) * 4
            ).to(dtype)
            draft_tokens = logits[:num_draft].float().argmax(dim=-1)  # an all-accepted block
            run_name = f"route_block-{args.dtype}-V{vocab_size}-G{num_draft}-T{args.temperature}"

            fused = functools.partial(route_block_triton, logits, draft_tokens, *thetas)
            reference = functools.partial(route_block_reference, logits, draft_tokens, *thetas)

            check_same_routing(fused(), reference(), run_name)
            record = {
                "run": run_name,
                "device": device_name,
                "vocab": vocab_size,
                "G": num_draft,
                "rows": num_draft + 1,
                "dtype": args.dtype,
            }
            for label, fn in (("triton", fused), ("reference", reference)):
                p20, p50, p80 = triton.testing.do_bench(
                    fn, warmup=args.warmup_ms, rep=args.rep_ms, quantiles=[0.2, 0.5, 0.8]
                )
                record.update(
                    {
                        f"{label}_gpu_ms_p20": p20,
                        f"{label}_gpu_ms_p50": p50,
                        f"{label}_gpu_ms_p80": p80,
                        f"{label}_wall_us": wall_us_per_call(fn, args.wall_iters),
                    }
                )
            record["speedup_gpu_p50"] = record["reference_gpu_ms_p50"] / record["triton_gpu_ms_p50"]
            record["speedup_wall"] = record["reference_wall_us"] / record["triton_wall_us"]
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
