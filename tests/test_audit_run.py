"""``python -m plusequals audit run``: the user's program, run as ``__main__`` with its
own argv, every outermost module call audited; rustc's diagnostics, JSON, SARIF (validated
against the SARIF 2.1.0 schema), allows, exit statuses. Programs are written into tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plusequals.cli.run import main as audit_run
from plusequals.cli.run import split
from support.programs import RESIDUAL, python

SCHEMA = Path(__file__).parent / "data" / "sarif-schema-2.1.0.json"

# Net.gate writes into the h Net was given by the program (E0596: the outermost call's argument) and
# still reads (E0382 at `y + h`), and that Linear saved (E0502)
MODEL = """\
import sys

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        h.mul_(torch.sigmoid(self.proj(h)))
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.out = nn.Linear(8, 8)

    def forward(self, h):
        y = self.gate(h)
        return self.out(y + h)


net = Net()
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    net(torch.randn(2, 8))
print("ran with", sys.argv[1:])
"""

CLEAN = """\
import sys
import torch
from torch import nn

net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
print(net(torch.randn(3, 4)).shape, sys.argv[1:])
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return python(tmp_path, "-m", "plusequals", "audit", "run", *args)


def test_split_leaves_the_programs_options_to_the_program():
    assert split(["--format", "json", "s.py", "--format", "x"]) == (["--format", "json"], ["s.py", "--format", "x"])
    assert split(["--backward", "-m", "pkg", "-m", "z"]) == (["--backward"], ["-m", "pkg", "-m", "z"])
    assert split(["--moves", "--", "-weird.py", "a"]) == (["--moves"], ["-weird.py", "a"])


def test_a_script_in_a_subprocess_its_output_and_argv_intact(tmp_path):
    write(tmp_path, "model.py", MODEL)
    proc = run_cli(tmp_path, "model.py", "3")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "ran with ['3']\n"  # the program's stdout is its own
    err = proc.stderr
    for code in ("E0596", "E0382", "E0502"):
        assert f"error[{code}]" in err
    assert "  --> model.py:13:9\n" in err and "13 |         h.mul_(torch.sigmoid(self.proj(h)))" in err
    assert "   |         ^^^^^^ aten.mul_.Tensor" in err
    assert "the same write, seen 3 times" in err  # three calls of the loop: one diagnostic each
    assert "note: read again here, after the write\n  --> model.py:25:29" in err
    assert "help: write `h = h * ...`" in err
    assert err.rstrip().endswith("error: 3 errors (E0596, E0382, E0502) in 3 audited calls")
    assert max(len(line) for line in err.splitlines()) <= 80
    assert "\x1b[" not in err  # no colour off a terminal


def test_a_package_with_dash_m_its_exit_status_wins(tmp_path, capsys):
    write(tmp_path, "audited_pkg/__init__.py", "")
    write(tmp_path, "audited_pkg/__main__.py", CLEAN)
    proc = run_cli(tmp_path, "-m", "audited_pkg", "4")
    assert proc.returncode == 4 and "torch.Size([3, 2]) ['4']" in proc.stdout, proc.stderr
    assert proc.stderr.strip() == "no errors in 1 audited call"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.setattr(sys, "modules", dict(sys.modules))  # audited_pkg is imported: not for later tests
        assert audit_run(["-m", "audited_pkg"]) == 0
    assert capsys.readouterr().out == "torch.Size([3, 2]) []\n"


def test_a_program_that_raises_is_reported_with_its_findings_so_far(tmp_path, capsys):
    write(tmp_path, "boom.py", MODEL.replace('print("ran with", sys.argv[1:])', 'raise RuntimeError("boom")'))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        status = audit_run(["--format", "json", "boom.py", "2"])
    err = capsys.readouterr().err
    assert status == 1
    assert "Traceback" in err and 'raise RuntimeError("boom")' in err and "runpy" not in err
    report = json.loads(err[err.index("{") :])
    assert report["program_exit_status"] == report["audit_exit_status"] == 1
    assert {f["code"] for f in report["findings"]} == {"E0596", "E0382", "E0502"}
    assert all(f["count"] == 2 and f["path"] == "boom.py" for f in report["findings"])


def test_a_forward_that_raises_is_named_and_the_summary_is_not_clean(tmp_path, capsys):
    write(
        tmp_path,
        "fails.py",
        """\
        import torch
        from torch import nn

        class Bad(nn.Module):
            def forward(self, x):
                return x @ torch.ones(3, 3)

        Bad()(torch.ones(2, 2))
        """,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        status = audit_run(["fails.py"])
    err = capsys.readouterr().err
    assert status == 1 and "note: the forward of `Bad` raised RuntimeError" in err
    assert err.rstrip().endswith("no errors before the program raised in 1 audited call")


def test_json_has_the_findings_and_what_was_watched(tmp_path):
    write(tmp_path, "model.py", MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["--format", "json", "--output", "out.json", "model.py", "2"]) == 1
    report = json.loads((tmp_path / "out.json").read_text())
    f = {f["code"]: f for f in report["findings"]}
    assert set(f) == {"E0596", "E0382", "E0502"}
    keys = {"code", "module", "path", "line", "column", "read_at", "op", "message", "count"}
    assert all(keys <= set(x) for x in f.values())
    assert (f["E0596"]["path"], f["E0596"]["line"], f["E0596"]["column"]) == ("model.py", 13, 9)
    assert f["E0382"]["read_at"] == "model.py:25" and f["E0596"]["module"] == "gate" and f["E0596"]["count"] == 2
    watched = report["watched"]
    assert watched["calls"] == 2 and watched["module_calls"] == 8 and watched["ops"] > 0


def test_sarif_is_valid_sarif_2_1_0(tmp_path):
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra (jsonschema) validates SARIF")
    write(tmp_path, "model.py", MODEL.replace("(self.proj(h)))", "(self.proj(h)))  # plusequals: allow(E0596, E0499)"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["--format", "sarif", "-o", "out.sarif", "model.py"]) == 1
    log = json.loads((tmp_path / "out.sarif").read_text())
    jsonschema.validate(log, json.loads(SCHEMA.read_text()))
    (run,) = log["runs"]
    assert run["tool"]["driver"]["name"] == "plusequals"
    rules = {r["id"]: r for r in run["tool"]["driver"]["rules"]}
    assert {"E0596", "E0382", "E0502"} <= set(rules) and all(rules[c]["help"]["text"] for c in ("E0596", "E0502"))
    results = {r["ruleId"]: r for r in run["results"]}
    assert set(results) == {"E0382", "E0502", "unused-allow"}  # E0596 allowed; E0499 silenced nothing
    e0382 = results["E0382"]
    assert e0382["level"] == "error" and e0382["message"]["text"]
    location = e0382["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "model.py" and location["region"]["startLine"] == 13
    related = e0382["relatedLocations"][0]["physicalLocation"]
    assert related["region"] == {"startLine": 25, "startColumn": 29, "endColumn": 30}
    assert results["unused-allow"]["level"] == "warning" and "E0499" in results["unused-allow"]["message"]["text"]


# out = self.relu(out) with nn.ReLU(inplace=True): the write into the conv's temporary is a move
MOVES = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.conv(x)
        out = self.relu(out)
        return out


block = Block()
for _ in range(2):
    print(tuple(block(torch.randn(1, 3, 8, 8)).shape))
"""


def test_a_move_is_no_finding_and_moves_lists_it_with_its_writer(tmp_path, capsys):
    """The move rule in `audit run`: an in-place ReLU on a temporary nobody reads again exits 0
    with no error; `--moves` lists it (text and JSON), once with its count, naming the writer."""
    write(tmp_path, "cnn.py", MOVES)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["cnn.py"]) == 0
        plain = capsys.readouterr()
        assert audit_run(["--moves", "cnn.py"]) == 0
        listed = capsys.readouterr().err
        assert audit_run(["--moves", "--format", "json", "cnn.py"]) == 0
        report = json.loads(capsys.readouterr().err)
    assert plain.out == "(1, 4, 8, 8)\n" * 2 and plain.err.strip() == "no errors in 2 audited calls"
    assert "note: `Block.relu` moved its argument (nn.ReLU(inplace=True))\n  --> cnn.py:12:15\n" in listed
    assert "aten.relu_.default: a write into a temporary nothing else holds" in listed
    assert "seen 2 times" in listed and "error" not in listed.replace("no errors", "")
    assert report["findings"] == [] and report["program_exit_status"] == report["audit_exit_status"] == 0
    assert report["moves"] == [
        {
            "module": "relu",
            "where": "cnn.py:12",
            "op": "aten.relu_.default",
            "count": 2,
            "writer": "nn.ReLU(inplace=True)",
        }
    ]


TRAIN = """\
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h += self.b(h)  # b saved h for backward (only when grad is on)
        return h


class Outer(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.inner, self.reentrant = Inner(), reentrant

    def forward(self, x):
        if self.reentrant:  # forward under no_grad, recomputed (and saved) in backward
            return checkpoint(self.inner, x, use_reentrant=True)
        return self.inner(x).relu()


with torch.random.fork_rng():
    torch.manual_seed(0)
    model, x = Outer(reentrant=REENTRANT), torch.randn(2, 4, requires_grad=True)
out = model(x)
if not REENTRANT:
    out.sum().backward()
    print("grad", x.grad.sum().item(), model.inner.a.weight.grad.sum().item())
"""


def test_backward_finds_what_a_recomputation_writes_and_leaves_the_program_alone(tmp_path, capsys):
    import runpy

    write(tmp_path, "clean.py", "REENTRANT = False\n" + TRAIN.replace("h += self.b(h)", "h = h + self.b(h)"))
    write(tmp_path, "ckpt.py", "REENTRANT = True\n" + TRAIN)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        runpy.run_path("clean.py", run_name="__main__")
        alone = capsys.readouterr().out
        assert audit_run(["--backward", "clean.py"]) == 0
        audited = capsys.readouterr()
        assert audit_run(["ckpt.py"]) == 0  # the forward ran under no_grad: nothing saved
        assert "no errors in 1 audited call" in capsys.readouterr().err
        assert audit_run(["--backward", "ckpt.py"]) == 1
        err = capsys.readouterr().err
    assert alone.startswith("grad ") and audited.out == alone  # the same gradients, accumulated once
    assert "no errors in 1 audited call" in audited.err
    assert "error[E0502]" in err and "  --> ckpt.py:14:9" in err and "AddmmBackward0" in err


def test_the_old_audit_subcommand_still_parses():
    from plusequals.cli import main

    with pytest.raises(SystemExit) as e:
        main(["audit", "--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        main(["audit", "run"])
    assert e.value.code == 2


def _between(text: str, marker: str) -> str:
    block = text[text.index(f"<!-- {marker} -->") : text.index(f"<!-- /{marker} -->")]
    return block[block.index("```") : block.rindex("```")].split("\n", 1)[1]


def test_the_readme_example_is_a_real_run(tmp_path, capsys):
    """README's "Audit your model": its model.py, run by `audit run`, prints the excerpt shown
    (each of its paragraphs is one of the output's, and the output has no other errors)."""
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    write(tmp_path, "model.py", _between((repo / "docs/guide/audit.md").read_text(), "audit-run-example"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["model.py"]) == 1
    out = capsys.readouterr().err
    paragraphs = out.strip().split("\n\n")
    excerpt = _between(readme, "audit-run-output").strip().split("\n\n")
    assert all(p in paragraphs for p in excerpt), out
    # h is Net's own temporary, read again: E0382 (not E0596, which is for memory others hold)
    assert [p.split(":")[0] for p in paragraphs] == ["error[E0382]", "error[E0502]", "error"]


SKIP = (
    RESIDUAL
    + """\


block = Residual()
with torch.no_grad():
    for _ in range(2):
        x = torch.randn(2, 4)
        h = x
        x = block(x)
        print((x + h).shape)
"""
)


def test_a_read_at_the_programs_level_after_the_outermost_call_wrote_is_E0382(tmp_path, capsys):
    """The UNet skip in the program itself: `h` still holds what the block wrote into; `x` is
    bound again before it is read (no finding for it); a program that never reads `h` again has
    E0596 only."""
    write(tmp_path, "skip.py", SKIP)
    write(tmp_path, "noread.py", SKIP.replace("print((x + h).shape)", "del h\n        print(x.shape)"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["--format", "json", "skip.py"]) == 1
        found = json.loads(capsys.readouterr().err)["findings"]
        assert audit_run(["--format", "json", "noread.py"]) == 1
        alone = json.loads(capsys.readouterr().err)["findings"]
    assert [(f["code"], f["count"]) for f in found] == [("E0596", 2), ("E0382", 2)]
    assert found[1]["read_at"] == "skip.py:21" and "`h` is read" in found[1]["message"]
    assert [f["code"] for f in alone] == ["E0596"]


def test_audit_with_a_script_hints_at_run_and_help_leads_with_run(capsys):
    from plusequals.cli import main

    assert main(["audit", "train.py", "--epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: train.py --epochs 3" in err
    assert err.rstrip().endswith("hint: to audit your program, run: python -m plusequals audit run train.py --epochs 3")
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: python -m plusequals audit run [options] (SCRIPT | -m MODULE) [ARGS...]\n")
    assert help_text.split("\n\n")[1].startswith("python -m plusequals audit run [options] SCRIPT")


def test_json_and_sarif_name_the_programs_exit_status_and_the_audits(tmp_path, capsys):
    """The program exits 0 and the audit 1 (it found errors); the clean program's own 3 is both."""
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "clean.py", CLEAN)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["--format", "json", "model.py"]) == 1
        found = json.loads(capsys.readouterr().err)
        assert audit_run(["--format", "sarif", "model.py"]) == 1
        (invocation,) = json.loads(capsys.readouterr().err)["runs"][0]["invocations"]
        assert audit_run(["--format", "json", "clean.py", "3"]) == 3
        clean = json.loads(capsys.readouterr().err)
    assert (found["program_exit_status"], found["audit_exit_status"]) == (0, 1) and "exit_status" not in found
    assert invocation["exitCode"] == 1 and invocation["properties"] == {"programExitCode": 0}
    assert (clean["program_exit_status"], clean["audit_exit_status"]) == (3, 3)


TRANSFORMS = """\
import torch
from torch import nn
from torchvision.transforms import v2

transform = v2.Compose([v2.ToDtype(torch.float32), v2.Normalize([0.5], [0.25])])
samples = torch.stack([transform(torch.full((1, 2, 2), float(i))) for i in range(4)])
print(nn.Linear(2, 2)(samples).shape)
"""


def test_per_sample_torchvision_transforms_are_counted_apart_from_model_calls(tmp_path, capsys):
    pytest.importorskip("torchvision.transforms.v2", reason="torchvision's v2 transforms are nn.Modules")
    write(tmp_path, "data.py", TRANSFORMS)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert audit_run(["data.py"]) == 0
        err = capsys.readouterr().err
        assert audit_run(["--format", "json", "data.py"]) == 0
        found = json.loads(capsys.readouterr().err)
    assert err == (
        "note: of these calls, 4 were torchvision transforms (per sample), 1 model call\nno errors in 5 audited calls\n"
    )
    assert found["transform_calls"] == 4 and found["watched"]["calls"] == 5
