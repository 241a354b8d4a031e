"""SARIF for code scanning: URIs relative to the repository's root (``%SRCROOT%``: ``git
rev-parse --show-toplevel``, or ``--root``), never an absolute ``file://`` URI; a write inside
an installed library is reported at the user's line that called into it, the library's line
named in a related location, and an allow on the user's line silences it. Each log validates
against SARIF 2.1.0's schema."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from plusequals.cli.run import main as audit_run

SCHEMA = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())

LIBRARY = """\
from torch import nn


class Scale(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x
"""

PROGRAM = """\
import torch
from torch import nn

from fakelib import Scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale()

    def forward(self, x):
        return self.scale(x) + 1


Net()(torch.ones(2))
"""


@pytest.fixture
def repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git work tree with the program in ``src/`` and a library installed in its own
    ``site-packages`` (as a virtual environment inside the repository is)."""
    repo = tmp_path / "repo"
    library = repo / ".venv" / "lib" / "site-packages"
    (library / "fakelib").mkdir(parents=True)
    (library / "fakelib" / "__init__.py").write_text(LIBRARY)
    (repo / "src").mkdir()
    (repo / "src" / "model.py").write_text(PROGRAM)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # fakelib is imported: not for later tests
    monkeypatch.chdir(repo / "src")
    return repo


def _sarif(capsys: pytest.CaptureFixture, *options: str) -> dict:
    assert audit_run(["--format", "sarif", *options, "model.py"]) in (0, 1)
    log = json.loads(capsys.readouterr().err)
    jsonschema.validate(log, SCHEMA)
    return log


def _uris(value: object) -> list:
    if isinstance(value, dict):
        return [v for k, v in value.items() if k == "uri"] + [u for v in value.values() for u in _uris(v)]
    return [u for v in value for u in _uris(v)] if isinstance(value, list) else []


def test_uris_are_relative_to_the_repository_and_a_library_write_is_at_the_users_line(repository, capsys):
    log = _sarif(capsys)
    (run,) = log["runs"]
    assert run["originalUriBaseIds"] == {"%SRCROOT%": {"uri": repository.resolve().as_uri() + "/"}}
    (result,) = run["results"]
    assert result["ruleId"] == "E0596"
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"] == {"uri": "src/model.py", "uriBaseId": "%SRCROOT%"}
    assert location["region"]["startLine"] == 13  # return self.scale(x) + 1
    (related,) = result["relatedLocations"]
    assert related["message"]["text"] == "the write, in the library: fakelib/__init__.py:6"
    # the base is the only absolute URI: none for the library, wherever it is installed
    assert [u for u in _uris(log) if u.startswith("file:")] == [repository.resolve().as_uri() + "/"]


def test_root_option_sets_the_base(repository, capsys):
    (run,) = _sarif(capsys, "--root", str(repository / "src"))["runs"]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == (repository / "src").resolve().as_uri() + "/"
    location = run["results"][0]["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "model.py"


def test_an_allow_on_the_users_line_silences_a_library_write(repository, capsys):
    program = repository / "src" / "model.py"
    program.write_text(PROGRAM.replace("+ 1\n", "+ 1  # plusequals: allow(E0596)\n"))
    assert audit_run(["model.py"]) == 0
    assert capsys.readouterr().err.strip() == "no errors in 1 audited call"
    assert _sarif(capsys)["runs"][0]["results"] == []


def test_text_and_json_still_name_the_librarys_line(repository, capsys):
    assert audit_run(["--format", "json", "model.py"]) == 1
    (finding,) = json.loads(capsys.readouterr().err)["findings"]
    assert (finding["code"], finding["where"]) == ("E0596", "fakelib/__init__.py:6")
    assert textwrap.dedent(LIBRARY).splitlines()[5].strip() == "x.mul_(2)"
