"""The help texts say what is true (issue 43): the program's name as it was started, a top
description naming decode and the engine, ``generate``'s required ``--model`` and no random
model, ``run``'s defaults named instead of "the config's", one metavar per kind of value."""

from __future__ import annotations

import argparse
import sys

import pytest

from app.cli import build_parser
from app.commands._help import METAVARS, program_name
from tests.cli.conftest import CliRunner, assert_one_line_usage_error

#: Metavars of values that are their own kind (a list, a pair, a pattern).
OWN_METAVARS = {"IDS", "TEXT", "MAJOR.MINOR", "NOPE,ROPE,V", "PATTERN"}


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


def test_the_program_name_follows_how_it_was_started(monkeypatch: pytest.MonkeyPatch) -> None:
    assert program_name("/usr/local/bin/app") == "app"
    assert program_name("/src/app/__main__.py") == "python -m app"
    assert program_name("-c") == "python -m app"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/app", "--help"])
    assert build_parser().format_usage().startswith("usage: app [-h]")
    monkeypatch.setattr(sys, "argv", ["/src/app/__main__.py", "--help"])
    assert build_parser().format_usage().startswith("usage: python -m app [-h]")


def test_the_top_help_says_what_the_project_is(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("--help")
    assert code == 0
    flat = " ".join(out.split())
    for text in ("prefill and decode backends", "the paged latent KV cache",
                 "an engine that serves requests end to end", "V3.2 and GLM-5",
                 "start here:", "python -m app checkpoint --family v32 DIR"):
        assert text in flat, text
    assert "MLA prefill backends, KV-cache spec bindings and platform hooks" not in flat


def test_generate_requires_a_model_and_names_no_random_one(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("generate", "--help")
    assert code == 0
    usage = " ".join(out.split("\n\n")[0].split())
    assert " --model DIR " in usage and "[--model DIR]" not in usage
    assert "random" not in out
    code, out, err = run_cli("generate", "--prompt-ids", "1,2")
    assert_one_line_usage_error(code, err, "the following arguments are required: --model")


def test_run_help_names_its_defaults_not_the_config(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("run", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "the config's" not in flat
    for text in ("(default: auto, or the --deployment file's)",
                 "(default: 16384, or the --deployment file's [cache])",
                 "(default: 16, or the --deployment file's [cache])",
                 "(default: 65536, or the --deployment file's [attention] context_chunk_tokens)",
                 "(default: auto, or the --deployment file's [cache] kv_cache_dtype)",
                 "the random model's: bfloat16, or the --deployment file's"):
        assert text in flat, text


def test_one_metavar_per_kind_of_value() -> None:
    allowed = set(METAVARS.values()) | OWN_METAVARS
    seen: dict[str, set[str]] = {}
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.nargs is not None:
                continue
            if action.choices is not None and action.metavar is None:
                assert len(action.choices) <= 4, (parser.prog, action.dest)  # listed inline
                continue
            assert action.metavar in allowed, (parser.prog, action.option_strings,
                                               action.metavar)
            if getattr(action.type, "__name__", "") == "int":
                seen.setdefault("int", set()).add(str(action.metavar))
    assert seen["int"] == {"N"}


def test_many_choices_show_one_word_and_list_them(run_cli: CliRunner) -> None:
    code, out, _ = run_cli("run", "--help")
    flat = " ".join(out.split())
    assert code == 0
    assert "[--dtype DTYPE]" in flat and "(one of: bf16, bfloat16," in flat
