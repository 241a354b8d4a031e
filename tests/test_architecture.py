"""The house shows its design: dependencies point one way, down the layers; functions stay
untangled; the stubs match the built extension; errors are classes with attributes.

* No import cycle among the package's modules, imports inside functions included (``from .. import
  _rust`` is an edge to the submodule; taking names from a package's ``__init__`` is an edge to it).
* Every import points down docs/architecture.md's layers (:data:`LAYERS`), and ``model`` and the
  audit import nothing else of the package.
* No function over ruff's complexity cap (C901, pyproject.toml), and no cap on lines: a long function
  or module that reads as one concept stays one (Rust: tests/architecture.rs).
* ``_rust.pyi`` matches ``plusequals._rust`` (mypy's stubtest).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "plusequals"
# docs/architecture.md's layers, bottom first: a module imports only from its own layer or one below.
# The package itself (its __init__, re-exporting) and __main__ are the top.
LAYERS = ("_rust", "errors", "model", "twin", "auditing", "cases", "bench", "cli")
ALONE = ("model", "auditing")  # import nothing of the package but themselves


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found["plusequals._rust"] = PACKAGE / "_rust.pyi"
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in the file (functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            submodules = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            out |= submodules
            if base in known and len(submodules) < len(node.names):  # names taken from the module itself
                out.add(base)
    return out - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, set(known)) for name, path in known.items() if path.suffix == ".py"}


def test_no_import_cycles():
    graph = import_graph()
    assert {"plusequals.twin.ops", "plusequals.errors"} <= graph["plusequals.twin.block"], graph[
        "plusequals.twin.block"
    ]
    assert cycles(graph) == [], cycles(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer(module: str) -> int:
    """The layer of a module of the package (its subpackage or top-level module)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up the layers, or out of a layer that imports nothing else."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if layer(b) > layer(a) or (layer(a) < len(LAYERS) and LAYERS[layer(a)] in ALONE and layer(b) != layer(a)):
                out.append(f"{a} -> {b}")
    return out


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert {"plusequals.auditing", "plusequals.model.blocks"} <= graph["plusequals.cases.project"]
    assert against_the_layers(graph) == []


def test_the_layer_check_finds_an_import_up_or_out():
    graph = {
        "plusequals.model.blocks": {"plusequals.twin.block"},  # up
        "plusequals.auditing.scope": {"plusequals.errors"},  # down, but the audit imports nothing else
        "plusequals.cli.demo": {"plusequals.twin.block", "plusequals.cli.terminal"},  # down, and within
        "plusequals.twin.block": {"plusequals"},  # the package's __init__ is the top
    }
    assert against_the_layers(graph) == [
        "plusequals.auditing.scope -> plusequals.errors",
        "plusequals.model.blocks -> plusequals.twin.block",
        "plusequals.twin.block -> plusequals",
    ]


def test_no_tangled_functions():
    """ruff's C901 (pyproject.toml: max-complexity) caps a function's branches, not its lines; no
    file is exempt."""
    pytest.importorskip("ruff", reason="needs ruff (make venv installs it)")
    root = PACKAGE.parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "C901", "python", "tests", "scripts"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_the_public_api_is_what_the_readme_and_the_guide_use():
    """``plusequals.__all__`` is at most 15 names, each used in README.md or docs/guide/; the rest is
    imported from its subpackage."""
    import plusequals

    root = PACKAGE.parents[1]
    docs = (root / "README.md").read_text() + "".join(p.read_text() for p in (root / "docs" / "guide").glob("*.md"))
    assert len(plusequals.__all__) <= 15, plusequals.__all__
    assert [n for n in plusequals.__all__ if not re.search(rf"\b{re.escape(n)}\b", docs)] == []
    assert all(getattr(plusequals, n) is not None for n in plusequals.__all__)


def test_the_stub_matches_the_built_extension(tmp_path):
    """Every name, signature and class of the built module is in ``_rust.pyi`` and no more. torch's
    own types are skipped (Any to mypy): a runtime signature of the extension carries names, kinds
    and defaults, never a Tensor's type, and reading torch would be most of this test's time; so is
    the rest of plusequals, which mypy would otherwise check from the package's ``__init__`` (4.8 s
    to 2.0 s; a name missing from the stub is still found).
    Without mypy's cache, as stubtest runs: a stub read from the cache has no arguments to
    compare (stubtest then fails with "attribute 'arguments' of 'FuncItem' undefined")."""
    pytest.importorskip("mypy", reason="needs the test extra (mypy's stubtest)")
    config = "[mypy]\n[mypy-torch.*,numpy.*,plusequals.*]\nfollow_imports = skip\n"
    (tmp_path / "mypy.ini").write_text(config + "[mypy-plusequals._rust]\nfollow_imports = normal\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "plusequals._rust", "--mypy-config-file", str(tmp_path / "mypy.ini")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_errors_are_classes_made_in_rust_and_re_exported():
    import plusequals
    from plusequals import _rust, errors

    names = ("OwnershipError", "UnsupportedBlockError", "StaleBlock", "WeightsChanged", "DonationConsumed")
    for name in (*names, "UseAfterDonation"):
        cls = getattr(plusequals, name)
        assert cls is getattr(_rust, name) is getattr(errors, name)
        assert cls.__module__ == "plusequals", cls.__module__
    assert issubclass(plusequals.OwnershipError, ValueError) and issubclass(plusequals.WeightsChanged, RuntimeError)


def test_the_weight_keys_come_from_rust_and_are_the_pytorch_blocks_state_dict():
    from plusequals import _rust
    from plusequals.model.blocks import BasicTransformerBlock
    from plusequals.twin.config import BlockConfig

    for gated in (True, False):
        config = BlockConfig(32, 4, 8, 24, gated, "sdpa")
        assert list(config.keys) == _rust.Config(**config._asdict()).weight_keys()
        block = BasicTransformerBlock(32, 4, 8, context_dim=24, gated_ff=gated)
        assert sorted(config.keys) == sorted(block.state_dict())
    lora = (("attn1.to_q", 4, 1.0, False, False), ("ff.net.2", 2, 0.5, True, True), ("attn1.to_q", 3, 1.0, True, False))
    terms = [
        int(k.split(".lora.")[1].split(".")[0]) for k in BlockConfig(32, 4, 8, 24, True, "sdpa", lora=lora).keys[20:]
    ]
    assert terms == [0, 0, 1, 1, 1, 1, 2, 2, 2], terms  # in BlockConfig.lora order, each term's weights together


def test_importing_plusequals_leaves_dynamo_unimported_and_the_trace_check_marked_as_torch_marks():
    """``import plusequals`` (every audited program, DataLoader worker and child process pays it)
    does not import Dynamo; the trace-time check carries exactly the mark that
    ``torch.compiler.assume_constant_result`` gives, so torch.compile still treats it as constant."""
    code = "import sys, plusequals, plusequals.auditing; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
    from plusequals import RustBlock

    def marked():
        return 0

    torch_marks = vars(torch.compiler.assume_constant_result(marked))
    ours = RustBlock._check_for_trace
    assert torch_marks and all(getattr(ours, k, object()) == v for k, v in torch_marks.items()), torch_marks
