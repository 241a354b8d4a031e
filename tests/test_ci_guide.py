"""The guide's GitHub Actions workflow (docs/guide/ci.md): it parses as YAML, grants what
``upload-sarif`` needs, uploads even when the audit exits 1, and its audit command, run from a
git repository's root on a program in a subfolder, writes a SARIF 2.1.0 log (validated against
the schema) whose findings lie at repository paths."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())
PYTHONPATH = str(REPO / "python")

TRAIN = """\
import torch
from torch import nn


class Halve(nn.Module):
    def forward(self, x):
        x.mul_(0.5)
        return x


batch = torch.ones(2, 4)
print(Halve()(batch).sum().item())
"""


def _workflow() -> dict:
    text = (REPO / "docs" / "guide" / "ci.md").read_text()
    (block,) = re.findall(r"<!-- ci-workflow -->\n```yaml\n(.*?)```\n<!-- /ci-workflow -->", text, re.S)
    return yaml.safe_load(block)


def _steps(workflow: dict) -> list:
    (job,) = workflow["jobs"].values()
    return job["steps"]


def test_the_workflow_uploads_the_audits_sarif_even_when_the_audit_fails():
    workflow = _workflow()
    assert workflow["permissions"]["security-events"] == "write"  # what upload-sarif needs
    steps = _steps(workflow)
    (audit,) = [s for s in steps if "plusequals audit run" in s.get("run", "")]
    (upload,) = [s for s in steps if s.get("uses", "").startswith("github/codeql-action/upload-sarif@")]
    assert steps.index(audit) < steps.index(upload)
    assert upload["if"] == "always()"  # audit run exits 1 on findings
    command = shlex.split(audit["run"])
    assert command[command.index("--format") + 1] == "sarif"
    assert command[command.index("--output") + 1] == upload["with"]["sarif_file"]


def test_the_workflows_audit_command_writes_valid_sarif_at_repository_paths(tmp_path):
    repo = tmp_path / "repo"
    (audit,) = [s for s in _steps(_workflow()) if "plusequals audit run" in s.get("run", "")]
    command = shlex.split(audit["run"])
    assert command[:2] == ["python", "-m"]
    script = Path(command[-1])
    (repo / script.parent).mkdir(parents=True)
    (repo / script).write_text(TRAIN)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, *command[1:]], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr  # the finding: the upload step runs anyway
    assert proc.stdout == "4.0\n"  # the program's own output
    log = json.loads((repo / command[command.index("--output") + 1]).read_text())
    jsonschema.validate(log, SCHEMA)
    (run,) = log["runs"]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == repo.resolve().as_uri() + "/"
    (result,) = run["results"]
    (location,) = result["locations"]
    artifact = location["physicalLocation"]["artifactLocation"]
    assert artifact == {"uri": script.as_posix(), "uriBaseId": "%SRCROOT%"}  # examples/train.py
    assert result["ruleId"] == "E0596" and location["physicalLocation"]["region"]["startLine"] == 7


@pytest.mark.parametrize("key", ["PLUSEQUALS"])
def test_the_install_step_names_the_wheel_the_guide_builds(key):
    (install,) = [s for s in _steps(_workflow()) if key in s.get("env", {})]
    wheel = install["env"][key]
    assert "pip install torch==2.11.0" in install["run"]  # the torch the wheel is built against
    building = (REPO / "docs" / "guide" / "building.md").read_text()
    assert f"dist/{wheel}" in building  # the wheel `make wheel` writes
