"""`viasd generate --json-schema / --grammar / --regex`: constrained output from the command line,
checked before any model loads, exact in sd as unconstrained generation is."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from support.grammar_tiny import save_byte_model_dir
from viasd_cli.app import get_app
from viasd_core.speculation.grammar import Grammar, grammar_option
from viasd_core.errors import UsageError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def run(*args):
    return CliRunner().invoke(get_app(), ["generate", *map(str, args)])


@pytest.fixture(scope="module")
def byte_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte")
    return save_byte_model_dir(root / "target"), save_byte_model_dir(root / "draft", n_layers=1, seed=5)


def test_the_option_parser_reads_files_and_text_and_refuses_in_one_line(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert grammar_option(json_schema=str(schema_file)) == Grammar.json_schema(SCHEMA)
    assert grammar_option(json_schema=json.dumps(SCHEMA)) == Grammar.json_schema(SCHEMA)
    assert grammar_option(regex="[0-9]+") == Grammar("regex", "[0-9]+")
    (tmp_path / "g.lark").write_text('start: "yes" | "no"\n')
    assert grammar_option(grammar=str(tmp_path / "g.lark")).format == "lark"
    assert grammar_option() is None
    for kwargs, message in [
        (dict(json_schema="{bad"), "--json-schema is not JSON"),
        (dict(json_schema=str(tmp_path / "missing.json")), "--json-schema: cannot read"),
        (dict(regex="a", grammar="g.gbnf"), "--grammar and --regex each constrain the output: give one"),
        (dict(grammar=str(tmp_path / "none.gbnf")), "--grammar: cannot read"),
        (dict(regex="(unclosed"), "the regex grammar is not valid"),
    ]:
        with pytest.raises(UsageError, match=message) as err:
            grammar_option(**kwargs)
        assert "\n" not in str(err.value)


def test_bad_grammar_options_exit_2_in_one_line_before_any_model_loads(viasd_home):
    r = run("-m", "/nonexistent/model", "--json-schema", "{bad", "hello")
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--json-schema is not JSON" in lines[0]


def test_json_schema_output_validates_and_sd_emits_ars_tokens(byte_dirs, viasd_home):
    import jsonschema

    target, draft = byte_dirs
    out = {}
    for mode in ("ar", "sd"):
        r = run("-m", target, "-d", draft, "--mode", mode, "-n", 60, "--json", "--quant", "none",
                "--json-schema", json.dumps(SCHEMA), "Describe someone")
        assert r.exit_code == 0, r.stderr
        out[mode] = json.loads(r.stdout)
    assert out["sd"]["text"] == out["ar"]["text"]
    assert out["ar"]["finish_reason"] == "eos"  # the grammar closed the object and ended the answer
    jsonschema.validate(json.loads(out["ar"]["text"]), SCHEMA)
