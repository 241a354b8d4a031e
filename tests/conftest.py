import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # compvis_reference

from plusequals import BasicTransformerBlock, RustBlock  # noqa: E402
from plusequals.model.blocks import randomize_  # noqa: E402,F401  (tests import it from here)

# SD v1 block shapes (tokens, dim, heads, head dim; context 77 x 768) scaled down for 2 CPU cores:
# widths / 4, tokens / 16, same head count, same tokens-per-width ordering.
SHAPES = [(256, 80, 8, 10), (64, 160, 8, 20), (16, 320, 8, 40), (4, 320, 8, 40)]
CONTEXT = (77, 192)
BATCH = 2

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def make_block(dim=80, heads=8, d_head=10, context_dim=CONTEXT[1], seed=0, **kw) -> BasicTransformerBlock:
    return randomize_(BasicTransformerBlock(dim, heads, d_head, context_dim=context_dim, **kw), seed).eval()


def make_inputs(tokens=256, dim=80, context=True, batch=BATCH, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, dim, generator=g).to(device, dtype)
    c = torch.randn(batch, CONTEXT[0], CONTEXT[1], generator=g).to(device, dtype) if context else None
    return x, c


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def block():
    return make_block()


@pytest.fixture
def rust(block):
    return RustBlock.from_torch(block)


@pytest.fixture(scope="session")
def quick_report_run(tmp_path_factory):
    """One `python -m plusequals report --quick --device cpu --json` for the whole session
    (test_report.py, test_summary.py): its directory, stdout (the summary's JSON) and stderr."""
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run(
        [sys.executable, "-m", "plusequals", "report", "--quick", "--device", "cpu", "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=1800,  # a hang, not a slow machine: the report takes minutes beside cargo (make test)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return SimpleNamespace(out=out, stdout=proc.stdout, stderr=proc.stderr)


@pytest.fixture(scope="session")
def quick_report(quick_report_run):
    return quick_report_run.out
