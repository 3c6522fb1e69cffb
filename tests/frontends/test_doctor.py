"""`viasd doctor`: its checks pass on a sound engine and fail, with exit code 1, on a broken one."""

import importlib.util
import json
import os

import pytest

import torch
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.machine import compile as compile_choice
from viasd_core.runtime import attention, packed_cpu, short_products
from viasd_kernels import cpu_int4_widen, instruction_set
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.frontends.doctor import environment, run_doctor
from viasd_core.frontends.doctor_checks import FAIL, PASS, SKIP, check_exact_mode
from viasd_core.loading.options import ModelOptions
from viasd_core.session import build_session
from conftest import needs_torchao


def doctor(*args):
    return CliRunner().invoke(get_app(), ["doctor", *map(str, args)])


class CorruptingDrafter:
    """A drafter that overwrites the last committed token in the engine's buffer: the target then
    reads a context that is not the text. `sd` can no longer equal `ar`, and doctor must say so."""

    def __init__(self, inner):
        self.inner = inner
        self.model = inner.model

    def propose(self, ids, n, gamma, params, sampler, host_tokens=None, **options):
        proposal = self.inner.propose(ids, n, gamma, params, sampler, host_tokens, **options)
        ids[n - 1] = (ids[n - 1] + 7) % 200 + 8
        return proposal

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_doctor_reports_and_passes_on_a_sound_engine(tiny_dirs, viasd_home, monkeypatch):
    # --compile auto on a CPU: doctor times eager against compiled (here a stand-in saying eager wins)
    timings = []
    monkeypatch.setattr(compile_choice, "time_compiled", lambda model: timings.append(model) or {"eager": 0.02, "compiled": 0.03})
    # one thread both times: the compile verdict is cached per thread count, and `auto` threads follow
    # the machine's load, which may differ between the two runs
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 2, "-n", 12, "--threads", 1, "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True
    env = report["environment"]
    assert env["device"] == "cpu" and env["dtype"] == "float32" and env["compiled"] == []
    assert env["cuda_graphs"] is False and env["cuda_graphs_recorded"] == 0 and env["torch"] == torch.__version__
    # attention row by row exactly where the passes are row-invariant, which is what makes them bit-exact
    assert (env["row_attention"] is not None) == env["exactness"].startswith("bit-exact")
    assert env["exactness_reason"]
    assert env["float32_products"] == short_products.invariant_way()  # float32 short passes: row-invariant products
    assert env["instruction_set"] == instruction_set.describe_isa()
    assert env["int4_widening"] is None  # no int4 weights to widen
    assert env["packed_products"] is None  # nor int8/int4 products
    # the norms and RoPE of its passes: one C call each where the kernels build (they must in CI), and
    # its float32 layers' calls up to the MLP in one C call
    assert env["layer_kernels"] == ("RMSNorm in one C call; RoPE and cache writes in one C call; "
                                    "a float32 layer's calls up to its MLP in one C call") or (
        not os.environ.get("CI") and "through" in env["layer_kernels"])
    assert len(timings) == 1 and env["compile_reason"].startswith("auto: eager, compiled is not 5% faster here")
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"compiled == eager": SKIP, "sd == ar (greedy)": PASS, "exact == ar (greedy)": PASS,
                      "sd with trees of 10 == ar (greedy)": SKIP}  # a draft model grows no trees
    assert report["tree"]["shape"] is None and "grows no trees" in report["tree"]["reason"]
    # its chains measured all the same: sd's first block without -g comes from them
    chains = [o for o in report["tree"]["options"] if o["name"].startswith("chain of")]
    assert len(chains) == 5 and 2 <= report["first_block"]["gamma"] <= 5
    assert report["format_curves"] is None  # --quant auto has no formats to choose between for this model
    assert report["speed"]["ar"]["tokens_per_s"] > 0 and report["speed"]["sd"]["tokens_per_target_pass"] >= 1
    table = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 1, "-n", 8, "--threads", 1, "--no-speed")
    assert table.exit_code == 0 and "sd == ar (greedy)" in table.stdout and "pass" in table.stdout
    assert len(timings) == 1 and "(cached)" in table.stdout  # --no-speed measures nothing: the verdict is read
    # whether bfloat16 products pay: measured (the speed probe refreshes it), shown with its timings
    products = env["bf16_products"]
    assert isinstance(products["pays"], bool) and products["bf16_ms"] > 0 and products["fp32_ms"] > 0
    assert "bf16_products" in table.stdout
    from viasd_cli.doctor import _shown

    assert _shown("bf16_products", {"pays": False, "bf16_ms": 192.779, "fp32_ms": 2.383}) == \
        "do not pay: int8/int4 prefill and training use float32 (a product: 192.779 ms bfloat16, 2.383 ms float32)"
    assert _shown("bf16_products", {"pays": True}) == "pay"  # a GPU: no timing
    # which way the int8/int4 short-pass products run (machine/packed_way.py; the suite pins it)
    from viasd_kernels import cpu_packed_mm
    from viasd_core.runtime import cpu_kernels

    built = cpu_packed_mm.ways(cpu_kernels.folder())
    assert env["packed_way"] == ({"portable": False, "pinned": "VIASD_PACKED_WAY=bf16"} if len(built) == 2 else
                                 {"portable": True, "only": built[0], "pinned": "VIASD_PACKED_WAY=bf16"})
    assert "packed_way" in table.stdout
    assert _shown("packed_way", {"portable": True, "bf16_ms": 3.269, "portable_ms": 2.598}) == \
        "portable (3.269 ms BF16 pair dot products, 2.598 ms portable)"


def test_doctor_says_how_the_int_formats_attend_row_by_row_and_widen_for_prefill(tiny_dirs, viasd_home, monkeypatch):
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--quant", "int4", "--prompts", 1, "-n", 8,
               "--threads", 1, "--no-speed", "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["environment"]["row_attention"] == attention.by_row_way()
    assert report["environment"]["row_attention"].startswith(("viasd_kernels' row-invariant kernel", "one call a position: "))
    assert {c["name"]: c["status"] for c in report["checks"]}["sd == ar (greedy)"] == PASS
    # how an int4 prefill widens its weights: the one-pass kernel where it builds, else the operators and why
    assert report["environment"]["int4_widening"] == packed_cpu.int4_widening_way()
    assert report["environment"]["int4_widening"].startswith(("viasd_kernels' one-pass kernel", "PyTorch's operators: "))
    # how its short passes multiply: viasd_kernels' packed products where they run, else PyTorch's and why
    assert report["environment"]["packed_products"] == packed_cpu.short_products_way()
    assert report["environment"]["packed_products"].startswith(("viasd_kernels' packed products", "PyTorch's kernels: "))
    assert packed_cpu.short_products_way(packed_kernel=False) == "PyTorch's kernels (the packed products are turned off)"
    monkeypatch.setattr(cpu_int4_widen, "widen", lambda *a, **kw: None)
    assert packed_cpu.int4_widening_way().startswith("PyTorch's operators: ")
    assert attention.by_row_way(row_kernel=False) == "one call a position (the kernel is turned off)"


def test_doctor_compares_the_compiled_pass_with_eager(tiny_dirs, viasd_home, monkeypatch):
    # --compile auto on a CPU where compiled passes time faster (a stand-in timing): doctor's session
    # compiles, as a server's would, and checks the compiled pass
    monkeypatch.setattr(compile_choice, "time_compiled", lambda model: {"eager": 0.03, "compiled": 0.02})
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]),
                                         compile="auto", max_context=128), mode="sd", refresh=True, long_lived=True)
    assert session.engine.compiled and session.compile_seconds > 0
    assert session.compile.reason.startswith("auto: compiled, over 5% faster here")
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]], max_new_tokens=10, speed=False)
    checks = {c.name: c for c in report.checks}
    assert checks["compiled == eager"].status == PASS, checks["compiled == eager"].detail
    assert report.environment["compiled"] == ["target", "draft"] and report.ok


def test_doctor_fails_on_a_broken_drafter(tiny_dirs, viasd_home, monkeypatch):
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    session.engine.drafter = CorruptingDrafter(session.engine.drafter)
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13]], max_new_tokens=16, speed=False)
    checks = {c.name: c for c in report.checks}
    assert checks["sd == ar (greedy)"].status == FAIL and "differs from ar" in checks["sd == ar (greedy)"].detail
    assert not report.ok

    import viasd_cli.doctor as cli_doctor

    def broken_session(opts, **kwargs):
        s = build_session(opts, **kwargs)
        s.engine.drafter = CorruptingDrafter(s.engine.drafter)
        return s

    monkeypatch.setattr(cli_doctor, "build_session", broken_session)
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 1, "-n", 16, "--no-speed", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False


def test_doctor_bad_option_is_one_line(tiny_dirs, viasd_home):
    r = doctor("-m", tiny_dirs["target"], "--prompts", 0)
    assert r.exit_code == 2 and r.stdout == ""
    assert "--prompts and --max-new-tokens must be at least 1" in r.stderr and r.stderr.count("\n") == 1


# --- what "equal to ar" means per dtype ------------------------------------------------------

def test_spacing_is_the_distance_between_neighbouring_numbers_of_the_dtype():
    from viasd_core.frontends.doctor_checks import spacing

    assert spacing(torch.bfloat16, 9.4) == 0.0625 and spacing(torch.bfloat16, -9.4) == 0.0625
    assert spacing(torch.bfloat16, 1.0) == 2**-7 and spacing(torch.bfloat16, 0.99) == 2**-8
    assert spacing(torch.float16, 26.0) == 2**-6 and spacing(torch.float32, 1.0) == 2**-23
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor(26.0, dtype=dtype)  # the next number up is exactly one spacing away
        assert float(torch.nextafter(x, torch.tensor(100.0, dtype=dtype)) - x) == spacing(dtype, 26.0)
    assert 0 < spacing(torch.bfloat16, 0.0) < 1e-30


def test_rounding_rule_on_synthetic_logits():
    from viasd_core.frontends.doctor_checks import RESOLUTION_FACTOR, judge_divergence

    assert RESOLUTION_FACTOR == 8
    # Largest |logit| 26: a bf16 spacing of 0.125 there, so flips up to 8 x 0.125 = 1.0 are rounding.
    ref = torch.tensor([26.0, 25.9375, 25.0, 24.875, 3.0, -5.0, float("-inf"), 1.0])
    tie = judge_divergence(ref, 0, 1, torch.bfloat16)
    assert tie == {"ar_token": 0, "token": 1, "margin": 0.0625, "limit": 1.0, "scale": 26.0, "tolerated": True}
    assert judge_divergence(ref, 0, 2, torch.bfloat16)["tolerated"]  # margin 1.0 == limit
    over = judge_divergence(ref, 0, 3, torch.bfloat16)
    assert over["margin"] == 1.125 and not over["tolerated"]  # one bf16 spacing past the limit
    clear = judge_divergence(ref, 0, 4, torch.bfloat16)
    assert clear["margin"] == 23.0 and not clear["tolerated"]
    # float16 is 8x finer: the same near-tie is within 8 x 2**-6 = 0.125, margin 1.0 is not.
    assert judge_divergence(ref, 0, 1, torch.float16)["limit"] == 0.125
    assert judge_divergence(ref, 0, 1, torch.float16)["tolerated"] and not judge_divergence(ref, 0, 2, torch.float16)["tolerated"]
    # float32 is strict: even a tie (margin 0) fails, and there is no limit.
    strict = judge_divergence(torch.tensor([2.0, 2.0, 1.0]), 0, 1, torch.float32)
    assert strict["margin"] == 0.0 and strict["limit"] is None and not strict["tolerated"]
    # The scale is the row's largest |logit|, negative ones included.
    assert judge_divergence(torch.tensor([3.0, 2.96875, -40.0]), 0, 1, torch.bfloat16)["limit"] == 2.0
    # A masked token (-inf) or logits that are not ar's own choice are never a rounding flip.
    masked = judge_divergence(ref, 0, 6, torch.bfloat16)
    assert masked["margin"] is None and not masked["tolerated"] and "rule the token out" in masked["why"]
    assert not judge_divergence(ref, 1, 0, torch.bfloat16)["tolerated"]


def test_doctor_bfloat16_tolerates_rounding_and_fails_a_broken_mode(tiny_dirs, viasd_home, monkeypatch):
    """bfloat16 follows the engine's promise for the model: bit-exact where its passes are
    row-invariant (no divergence at all), else near-ties within the rounding limit; a broken mode
    fails either way."""
    args = ("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--dtype", "bfloat16", "--quant", "none",
            "--prompts", 3, "-n", 16, "--no-speed", "--json")
    sound = doctor(*args)
    assert sound.exit_code == 0, sound.stdout + sound.stderr
    report = json.loads(sound.stdout)
    assert report["ok"] is True and report["environment"]["dtype"] == "bfloat16"
    exact = report["environment"]["exactness"].startswith("bit-exact")
    for check in report["checks"][1:3]:  # sd, exact (the tree check is skipped: a draft model)
        assert check["status"] == PASS and check["facts"]["rule"] == ("bit-exact" if exact else "rounding")
        assert check["facts"]["factor"] == 8 and check["facts"]["promise"] == ("bit-exact" if exact else "up to rounding")
        assert not (exact and check["facts"]["divergences"])
        for d in check["facts"]["divergences"]:  # any flip there is within the rounding limit
            assert d["tolerated"] and 0 <= d["margin"] <= d["limit"]

    import viasd_cli.doctor as cli_doctor

    def broken_session(opts, **kwargs):
        """Verification reads negated logits: sd and exact emit the target's least likely token."""
        s = build_session(opts, **kwargs)
        extend = s.engine.target.extend

        def inverted(ids, end, n_logits=1):
            logits = extend(ids, end, n_logits)
            return torch.where(torch.isfinite(logits), -logits, logits) if n_logits > 1 else logits

        s.engine.target.extend = inverted
        return s

    monkeypatch.setattr(cli_doctor, "build_session", broken_session)
    r = doctor(*args)
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    assert report["ok"] is False
    for check in report["checks"][1:3]:  # sd, exact (the tree check is skipped: a draft model)
        assert check["status"] == FAIL and "differs from ar at new token 0" in check["detail"]
        first = check["facts"]["divergences"][0]
        assert first["prompt"] == 1 and first["new_token"] == 0 and not first["tolerated"]
        assert first["margin"] > 0 and first["scale"] > 0 and first["token"] != first["ar_token"]
        if exact:
            assert first["limit"] is None and "bfloat16 must match exactly" in check["detail"]
        else:
            assert first["margin"] > first["limit"] > 0 and " > " in check["detail"]


def test_doctor_float32_fails_any_divergence(tiny_dirs, viasd_home):
    """In float32 a divergence fails even where bf16's rule would call it a near-tie."""
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    engine = session.engine
    ids = [8, 9, 10, 11, 12, 13]
    ar = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=4)).tokens
    engine.reset()
    generate = engine.generate

    def off_by_a_hair(prompt_ids, config, **kwargs):
        """sd emits ar's runner-up as its third token."""
        gen = generate(prompt_ids, config, **kwargs)
        if config.mode == "sd":
            logits = engine.target.forward(torch.tensor(prompt_ids + gen.tokens[:2]), 0, 1)[0]
            gen.tokens[2] = int(logits.topk(2).indices[1])
        return gen

    engine.generate = off_by_a_hair
    check = check_exact_mode(session, "sd", [ids], max_new_tokens=4)
    d = check.facts["divergences"][0]
    assert check.status == FAIL and check.facts["rule"] == "bit-exact" and "float32 must match exactly" in check.detail
    assert d["new_token"] == 2 and d["ar_token"] == ar[2] and d["limit"] is None and d["margin"] > 0


# --- measured, not assumed -------------------------------------------------------------------

class FakeNode:
    def __init__(self, *children):
        self.children = {"f": list(children)} if children else {}


def test_cuda_graphs_recorded_counts_the_cuda_graph_trees(monkeypatch):
    from torch._inductor import cudagraph_trees

    from viasd_core.frontends.doctor_checks import cuda_graphs_recorded

    class Manager:
        roots = {"f": [FakeNode(FakeNode(), FakeNode(FakeNode()))], "g": [FakeNode()]}

    asked = []

    def get_manager(index, create_if_none_exists=True):
        asked.append((index, create_if_none_exists))
        return manager

    monkeypatch.setattr(cudagraph_trees, "get_manager", get_manager)
    manager = Manager()
    assert cuda_graphs_recorded(torch.device("cuda", 0)) == 5 and asked == [(0, False)]  # never creates one
    manager = None
    assert cuda_graphs_recorded(torch.device("cuda", 1)) == 0
    manager = object()  # a torch whose trees look otherwise
    assert cuda_graphs_recorded(torch.device("cuda", 0)) is None
    assert cuda_graphs_recorded(torch.device("cpu")) == 0 and len(asked) == 3  # CPU: nothing asked


def test_doctor_reports_cuda_graphs_from_the_measurement(tiny_dirs, viasd_home, monkeypatch):
    import viasd_core.frontends.doctor as core_doctor

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    for m in session.engine.all_models():
        m.compile_mode = "reduce-overhead"  # the requested mode says CUDA graphs; none was recorded
    measured = {"count": 0}
    monkeypatch.setattr(core_doctor, "cuda_graphs_recorded", lambda device: measured["count"])
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13]], max_new_tokens=4, speed=False)
    assert report.environment["cuda_graphs"] is False and report.environment["cuda_graphs_recorded"] == 0
    measured["count"] = 3
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13]], max_new_tokens=4, speed=False)
    assert report.environment["cuda_graphs"] is True and report.environment["cuda_graphs_recorded"] == 3
    measured["count"] = None  # this torch's trees could not be read
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13]], max_new_tokens=4, speed=False)
    assert report.environment["cuda_graphs"] is None and report.ok


def test_compiled_names_the_models_that_compiled(tiny_dirs, viasd_home, monkeypatch):
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    engine = session.engine
    assert engine.compiled_models == () and environment(session)["compiled"] == []
    monkeypatch.setattr(engine.target, "compile", lambda mode="default": False)  # the target cannot compile here
    assert engine.compile() is True  # the draft did
    assert engine.compiled_models == ("draft",) and environment(session)["compiled"] == ["draft"]


def test_doctor_says_the_context_cap_on_one_stderr_line(tiny_dirs, viasd_home, monkeypatch):
    from viasd_core import session as session_module

    per_position = 2 * 4 * 2 * 16 * 4 * 3  # K and V x layers x KV heads x head dim x float32 x (target, slim, draft)
    monkeypatch.setattr(session_module, "free_memory_bytes", lambda device: 4 * 100 * per_position)
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 1, "-n", 4, "--no-speed", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["environment"]["max_context"] == 100
    assert ("context: 100 positions (what a quarter of the 1 MiB free on cpu holds; the model's own is 512): "
            "raise it with --max-context") in r.stderr.splitlines()


def test_compiled_against_eager_allows_rounding_only(tiny_dirs, viasd_home, monkeypatch):
    from viasd_core.frontends.doctor_checks import check_compiled_matches_eager, rounding_limit, spacing

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft="none", dtype="bfloat16",
                                         quant="none", max_context=64), mode="ar")
    target = session.engine.target
    session.engine.compiled = True  # compared as if compiled: the same eager pass, then perturbed below
    forward = target.forward
    shift = {"by": 0.0}
    monkeypatch.setattr(target, "forward", lambda ids, start, n=1: forward(ids, start, n) + shift["by"])
    probe = list(range(8, 28))
    same = check_compiled_matches_eager(session, probe)
    passes = same.facts["passes"]
    assert same.status == PASS and same.facts["largest_difference"] == 0.0
    assert [(p["start"], p["length"]) for p in passes] == [(0, 14), (14, 1), (15, 1), (16, 4)]
    want = forward(torch.tensor(probe[:14]), 0, 1)  # the first pass's logits: its limit is bf16's rule on them
    assert passes[0]["limit"] == rounding_limit(torch.bfloat16, want) == 8 * spacing(torch.bfloat16, float(want.abs().max()))
    low, high = min(p["limit"] for p in passes), max(p["limit"] for p in passes)
    for by, status in ((0.5 * low, PASS), (2 * high, FAIL), (float("nan"), FAIL)):
        shift["by"] = by
        assert check_compiled_matches_eager(session, probe).status == status, by


@needs_torchao
def test_doctor_shows_the_verify_curve_of_each_format_auto_chooses_between(tiny_dirs, viasd_home, monkeypatch):
    from viasd_core.runtime.weight_format import INT4, NONE
    from viasd_core.frontends import doctor as core_doctor
    from viasd_core.machine.tree import CURVE_WIDTHS

    monkeypatch.setattr(core_doctor, "auto_candidates", lambda model, device, dtype: ((NONE, INT4), None))
    args = ("-m", tiny_dirs["target"], "-d", "ngram", "--prompts", 1, "-n", 4, "--threads", 1)
    r = doctor(*args, "--json")
    assert r.exit_code == 0, r.stderr
    curves = json.loads(r.stdout)["format_curves"]
    assert list(curves) == ["none", "int4"]
    assert all([int(w) for w in curve] == list(CURVE_WIDTHS) and all(0 < s < 5 for s in curve.values())
               for curve in curves.values())
    table = doctor(*args)
    assert table.exit_code == 0 and "verify curve per format" in table.stdout and "int4 ms" in table.stdout


# --- which promise applies: bit-exact or up to rounding ---------------------------------------

def width_dependent_head(session, near: float = 0.1):
    """Make the target's output head width-dependent, as a product that rounds by pass width would
    be: in a pass of r > 1 rows a row whose two best logits are within `near` of each other gets
    them swapped (the runner-up ends 0.01 * r above), the way such rounding flips a near-tie; a
    1-row pass (ar's) is untouched. The eager passes' bound head call is wrapped (FastModel binds
    its calls once: kernel_binding.py), as a product bound that way would behave."""
    target = session.engine.target
    inner = target._head

    def forward(x):
        y = inner(x)
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return y
        y = y.clone()
        flat = y.view(-1, y.shape[-1])
        top = flat.float().topk(2, dim=-1)
        for r in range(flat.shape[0]):
            first, second = top.values[r].tolist()
            if first - second < near:
                flat[r, top.indices[r, 1]] = first + 0.01 * rows
        return y

    target._head = forward
    return session


@needs_torchao
def test_doctor_is_strict_where_the_int_formats_promise_bit_exact_passes(tiny_dirs, viasd_home, monkeypatch):
    """int8/int4 on a CPU are promised bit-exact: a width-dependent product fails doctor, even where
    its flips are near-ties that bfloat16's rounding rule would have tolerated; the real code passes."""
    from viasd_core.frontends.doctor_checks import RESOLUTION_FACTOR, spacing

    args = ("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--quant", "int8", "--prompts", 3, "-n", 32,
            "--threads", 1, "--no-speed", "--json")
    sound = doctor(*args)
    assert sound.exit_code == 0, sound.stdout + sound.stderr
    report = json.loads(sound.stdout)
    assert report["ok"] is True and report["environment"]["exactness"].startswith("bit-exact")
    for check in report["checks"][1:3]:  # sd, exact
        assert check["status"] == PASS and check["facts"]["promise"] == "bit-exact" and not check["facts"]["divergences"]
        assert "(int8: bit-exact)" in check["detail"]

    import viasd_cli.doctor as cli_doctor

    monkeypatch.setattr(cli_doctor, "build_session", lambda opts, **kw: width_dependent_head(build_session(opts, **kw)))
    broken = doctor(*args)
    assert broken.exit_code == 1, broken.stdout + broken.stderr
    report = json.loads(broken.stdout)
    sd = report["checks"][1]
    assert sd["status"] == FAIL and "int8 must match exactly (promised bit-exact here)" in sd["detail"]
    flips = sd["facts"]["divergences"]
    assert flips and all(d["limit"] is None and not d["tolerated"] for d in flips)
    # the flips are near-ties: the bfloat16 rule (8 spacings at the row's largest |logit|) would have passed them
    assert any(d["margin"] is not None and d["margin"] <= RESOLUTION_FACTOR * spacing(torch.bfloat16, d["scale"])
               for d in flips)


def test_doctor_says_which_promise_applies(tiny_dirs, viasd_home):
    from viasd_core.speculation.exactness import Promise
    from viasd_core.frontends.doctor_checks import exactness, promise_words, rounding_dtype

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), quant="none"),
                            mode="sd")
    target = session.engine.target
    env = environment(session)
    assert env["exactness"] == promise_words(exactness(target)) and env["exactness_reason"] == exactness(target).why
    assert rounding_dtype(target) == torch.float32
    assert promise_words(Promise(False, "x")) == \
        "up to rounding: sd and exact equal ar up to the kernel's rounding (a near-tie may flip)"
    check = check_exact_mode(session, "sd", [[8, 9, 10, 11, 12, 13]], max_new_tokens=8)
    assert check.status == PASS and check.facts["promise"] == ("bit-exact" if exactness(target).exact else "up to rounding")
    assert check.facts["why"] == exactness(target).why


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_doctor_reports_bitsandbytes_as_equal_up_to_rounding(tiny_dirs, viasd_home, quant):
    """bitsandbytes' CPU kernels round a row by its pass's width: promised up to rounding, not bit-exact,
    with near-ties judged at float16's resolution (the kernels compute in it)."""
    from viasd_core.frontends.doctor_checks import exactness, rounding_dtype

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), quant=quant),
                            mode="sd")
    target = session.engine.target
    assert target.quantized and not exactness(target).exact and "bitsandbytes" in exactness(target).why
    assert environment(session)["exactness"].startswith("up to rounding: sd and exact equal ar up to the kernel's rounding")
    assert rounding_dtype(target) in (torch.float16, torch.bfloat16)
    check = check_exact_mode(session, "sd", [[8, 9, 10, 11, 12, 13]], max_new_tokens=8)
    assert check.facts["promise"] == "up to rounding" and check.facts["rule"] == "rounding"
    assert check.status == PASS and "equal to ar up to the kernel's rounding" in check.detail
