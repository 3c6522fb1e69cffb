"""An EAGLE-3 head folder through the session and the CLI: a draft for `generate` equal to ar, the
first block and trees measured on this machine (--tree auto, `doctor`), a head that does not fit
as a one-line error, and a head beside a packed CPU target (split from test_feature_drafter.py)."""

from __future__ import annotations

import pytest
import torch

from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.training import eagle_init


# ---------------------------------------------------------------------- through the session and the CLI
@pytest.fixture(scope="module")
def head_dir(tiny_dirs, tmp_path_factory):
    """An EAGLE-3 head for the tiny target folder, written in the published layout."""
    from transformers import AutoModelForCausalLM

    from viasd_core.speculation.eagle_files import save_feature_head

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])
    head = eagle_init.init_head(target, (0, 1, 2), torch.arange(0, 256, 2), seed=1)
    return save_feature_head(head, tmp_path_factory.mktemp("heads") / "head")


def test_a_head_folder_is_a_draft_for_generate_sd_equal_to_ar(tiny_dirs, head_dir, viasd_home):
    import json

    from typer.testing import CliRunner

    from viasd_cli.app import get_app
    from viasd_core.session import build_session
    from viasd_core.loading.options import ModelOptions

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=f"{head_dir}+ngram"), mode="sd")
    assert isinstance(session.engine.drafter, HybridDrafter)
    assert isinstance(session.engine.drafter.model_drafter, FeatureDrafter)
    outs = {}
    for mode in ("ar", "sd"):
        r = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3 w4 w5 w6", "-m", str(tiny_dirs["target"]), "-d", str(head_dir),
                                           "-n", "16", "--mode", mode, "--json", "-q"])
        assert r.exit_code == 0, r.stderr
        outs[mode] = json.loads(r.stdout)
    assert outs["sd"]["text"] == outs["ar"]["text"]
    assert outs["sd"]["stats"]["draft_tokens"] > 0
    # --tree: a node count, auto (measured once, cached) and a bad value (one line, before loading)
    for tree in ("5", "auto"):
        r = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3 w4 w5 w6", "-m", str(tiny_dirs["target"]), "-d",
                                           str(head_dir), "-n", "16", "--tree", tree, "--json"])
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["text"] == outs["ar"]["text"]
        assert tree != "5" or "draft trees of 5 tokens (--tree 5)" in r.stderr
    assert list((viasd_home / "cache" / "machine").glob("tree-*.json"))
    r = CliRunner().invoke(get_app(), ["generate", "x", "-m", str(tiny_dirs["target"]), "--tree", "wide"])
    assert r.exit_code != 0 and r.stderr.count("\n") == 1 and "--tree must be" in r.stderr


def test_sd_starts_from_the_measured_chain_unless_given_a_block(tiny_dirs, head_dir, viasd_home, monkeypatch):
    import json

    from typer.testing import CliRunner

    from viasd_cli.app import get_app
    from viasd_core.machine import tree as tree_choice
    from viasd_core.machine.first_block import first_block
    from viasd_core.speculation.engine import Engine

    seen = []
    generate = Engine.generate

    def spy(self, ids, config, *args, **kwargs):
        seen.append((config.mode, config.gamma, config.gamma_floor, config.tree))
        return generate(self, ids, config, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", spy)
    # a CPU-like verify curve (each row costs a 1-token pass): chains win over trees
    monkeypatch.setattr(tree_choice, "measure_verify_curve", 
                        lambda engine, widths=tree_choice.CURVE_WIDTHS, **kw: {w: 0.01 * w for w in widths})
    base = ["generate", "w1 w2 w3", "-m", str(tiny_dirs["target"]), "-d", str(head_dir), "-n", "8", "--verbose"]
    r = CliRunner().invoke(get_app(), base + ["--tree", "auto"])
    assert r.exit_code == 0, r.stderr
    record = json.loads(next((viasd_home / "cache" / "machine").glob("tree-*.json")).read_text())
    chains = [o for o in record["options"] if o["shape"] is None and o["width"] > 1]
    fastest = max(chains, key=lambda o: o["tokens_per_s"])["width"] - 1
    start, why = first_block(fastest, 12)
    assert record["shape"] is None and record["verify_seconds"]["16"] == pytest.approx(0.16)
    assert seen[-1] == ("sd", start, start, None) and f"first block: {start} drafts ({why})" in r.stderr
    assert "exactness: bit-exact (row-invariant passes" in r.stderr and "\ninstruction set: " in r.stderr
    assert "note: sd may differ" not in r.stderr
    seen.clear()
    for extra in (["--tree", "off"], ["--tree", "off", "-g", "4"]):
        r = CliRunner().invoke(get_app(), base + extra)
        assert r.exit_code == 0, r.stderr
    # --tree off measures nothing: the unmeasured start; -g is taken as given
    assert seen == [("sd", 5, 2, None), ("sd", 4, 2, None)]  # and the floor of 2


def test_doctor_checks_trees_and_shows_the_verify_curve(tiny_dirs, head_dir, viasd_home):
    import json

    from typer.testing import CliRunner

    from viasd_cli.app import get_app
    from viasd_core.machine.tree import CURVE_WIDTHS

    # eager passes: compiling them (doctor's compiled == eager check, tested in tests/frontends/test_doctor.py)
    # took ~95% of this test's 3 minutes on a 2-core CPU
    args = ["doctor", "-m", str(tiny_dirs["target"]), "-d", str(head_dir), "--prompts", "1", "-n", "8", "--compile", "off"]
    r = CliRunner().invoke(get_app(), args + ["--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status["sd with trees of 10 == ar (greedy)"] == "pass"
    assert [int(w) for w in report["tree"]["verify_seconds"]] == list(CURVE_WIDTHS)
    assert len(report["tree"]["options"]) == 9 and "auto:" in report["tree"]["reason"]
    assert 2 <= report["first_block"]["gamma"] <= 5 and "fastest chain" in report["first_block"]["reason"]
    r = CliRunner().invoke(get_app(), args)
    assert r.exit_code == 0 and "verify curve" in r.stdout and "--tree auto" in r.stdout


@pytest.mark.parametrize("damage, message", [
    ("hidden", "hidden size 32 does not match the target's"),
    ("truncate", "model.safetensors"),
])
def test_a_head_that_does_not_fit_is_a_one_line_error(tiny_dirs, head_dir, viasd_home, tmp_path, damage, message):
    import json
    import shutil

    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    if damage == "hidden":
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(cfg | {"hidden_size": 32, "target_hidden_size": 32}))
    else:
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = CliRunner().invoke(get_app(), ["generate", "w1 w2", "-m", str(tiny_dirs["target"]), "-d", str(bad), "-n", "4"])
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_head_beside_a_packed_cpu_target_runs_int8_products_and_stays_exact(tiny_dirs, head_dir, viasd_home, quant):
    """Where the target runs int8/int4 on a CPU the head's layer and output products are packed int8
    (drafter_factory.HEAD_FORMAT), fc is not, and greedy sd still equals ar token for token."""
    from viasd_core.speculation.engine import GenerationConfig
    from viasd_core.runtime.weight_formats import PackedLinear
    from viasd_core.loading.options import ModelOptions
    from viasd_core.session import build_session

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(head_dir), quant=quant,
                                         tree="off"), mode="sd")
    head = session.engine.drafter.head
    packed = {n: m.kind for n, m in head.named_modules() if isinstance(m, PackedLinear)}
    assert packed["lm_head"] == "int8" and packed["midlayer.mlp.down_proj"] == "int8"
    assert type(head.fc) is torch.nn.Linear and "fc" not in packed
    assert set(packed.values()) == {"int8"}
    ids = session.tokenizer("w1 w2 w3 w4 w5 w6 w1 w2")["input_ids"]
    out = {mode: session.engine.generate(list(ids), GenerationConfig(mode=mode, max_new_tokens=16)) for mode in ("ar", "sd")}
    assert out["sd"].tokens == out["ar"].tokens
    assert out["sd"].stats.draft_tokens > 0
