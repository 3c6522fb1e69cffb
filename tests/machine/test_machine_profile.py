"""The machine profile (viasd_core/machine/profile.py): one table of decisions, each with its version,
resolved by a session in the documented order; bumping one decision's version measures that
decision again and no other."""

import dataclasses
import re

import pytest
import torch

from viasd_core.loading.options import ModelOptions
from viasd_core.machine import bf16, profile
from viasd_core.machine import compile as compile_choice
from viasd_core.machine import tree as tree_choice
from viasd_core.machine.record import machine_records
from viasd_core.session import build_session, choose_first_block, choose_tree

CPU = torch.device("cpu")
DOCUMENTED = ["format", "threads", "short-rows", "compile", "tree", "first-block"]


def test_the_order_is_the_documented_one_and_every_stored_decision_has_a_version():
    assert [d.name for d in profile.ORDER] == DOCUMENTED
    # the module's own documentation states the same order
    assert " -> ".join(DOCUMENTED) in re.sub(r"\s+", " ", profile.__doc__)
    names = [d.name for d in profile.ORDER + profile.MACHINE_WIDE]
    assert len(set(names)) == len(names) and set(profile.LABELS) == set(DOCUMENTED)
    for d in profile.ORDER + profile.MACHINE_WIDE:
        assert callable(d.measure) and d.explain
    assert {d.name for d in profile.ORDER + profile.MACHINE_WIDE if d.stored} == {
        "format", "short-rows", "compile", "tree", "bf16-products", "packed-way"}
    with pytest.raises(ValueError, match="not stored"):
        profile.ORDER[1].record(CPU, {})  # threads: measured every session, never stored


def test_a_decision_resolved_after_a_later_one_is_refused():
    machine = profile.MachineProfile(CPU)
    machine.resolve(compile_choice.DECISION, lambda: "c", lambda r: (r, "why"))
    with pytest.raises(ValueError, match="'threads' resolved after 'compile': the order is format -> threads"):
        machine.resolve(profile.ORDER[1], lambda: pytest.fail("not run"), lambda r: (r, ""))
    machine.resolve(compile_choice.DECISION, lambda: "again", lambda r: (r, "why"))  # again: a refresh
    assert machine.result("compile") == "again" and machine.result("threads") is None
    with pytest.raises(ValueError, match="no session decision"):
        machine.resolve(bf16.DECISION, lambda: None, lambda r: ("", ""))


@pytest.fixture
def thread_count():
    """The sessions here run one thread; the process's count is given back after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _session(tiny_dirs, refresh=False):
    opts = ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), threads="1", max_context=64)
    session = build_session(opts, mode="sd", refresh=refresh, long_lived=True)
    choose_tree(session)
    choose_first_block(session, 8)
    session.machine.bf16_products()
    return session


def test_a_session_resolves_in_order_and_a_bumped_version_measures_that_decision_only(tiny_dirs, viasd_home,
                                                                                       monkeypatch, thread_count):
    measured = []
    monkeypatch.setattr(compile_choice, "time_compiled",
                        lambda model: measured.append("compile") or {"eager": 0.02, "compiled": 0.03})
    monkeypatch.setattr(tree_choice, "measure_verify_curve",
                        lambda engine, widths=tree_choice.CURVE_WIDTHS, **kw: measured.append("tree") or
                        {w: 0.01 * w for w in widths})
    real_bf16 = bf16.measure
    monkeypatch.setattr(bf16, "measure", lambda device: measured.append("bf16") or real_bf16(device))

    first = _session(tiny_dirs, refresh=True)  # doctor's session: the stored decisions measured
    assert list(first.machine.resolved) == DOCUMENTED
    assert [row[0] for row in first.choices()][:7] == ["weights", "draft", "threads", "short passes", "compile", "tree",
                                                       "first block"]
    picture = first.machine.picture()
    assert [d["decision"] for d in picture["decisions"]] == ["bf16-products"] + DOCUMENTED
    assert picture["identity"]["isa_class"] and all(d["value"] for d in picture["decisions"])
    assert sorted(measured) == ["bf16", "compile", "tree"]
    stored = {p.name: p.read_bytes() for p in machine_records(CPU)}
    assert sorted(name.split("-")[0] for name in stored) == ["bf16", "compile", "short", "tree"]

    measured.clear()
    bumped = dataclasses.replace(tree_choice.DECISION, version=tree_choice.DECISION.version + 1)
    monkeypatch.setattr(tree_choice, "DECISION", bumped)
    again = _session(tiny_dirs)
    assert list(again.machine.resolved) == DOCUMENTED
    assert measured == ["tree"]  # the bumped decision alone is measured again
    assert again.compile.reason.endswith("(cached)") and not again.tree.reason.endswith("(cached)")
    now = {p.name: p.read_bytes() for p in machine_records(CPU)}
    (new,) = set(now) - set(stored)
    assert new.startswith("tree-") and {name: now[name] for name in stored} == stored  # the others untouched
