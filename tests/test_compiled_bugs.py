"""The seed's bugs under torch.compile (Inductor, default mode, CPU): each strategy's outcome is
derived again and compared with ``compiled.COMPILED``, the table the README's torch.compile
cells are rendered from. Two compiles per strategy (the UNet level under ``no_grad``, the
textual-inversion step), tiny shapes, static shapes; Inductor's cache in conftest's
``inductor_cache_dir``, set per test."""

import re
from pathlib import Path

import pytest
from torch._inductor.utils import clear_caches

from conftest import inductor_cache_dir
from plusequals.cases import compiled as cb
from plusequals.model import bugs
from plusequals.model.blocks import STRATEGIES
from support.docs import guide_block

README = Path(__file__).resolve().parents[1] / "docs/guide/bugs.md"  # the bugs' page of the guide


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory):
    return inductor_cache_dir(tmp_path_factory)


@pytest.fixture
def inductor(inductor_dir, monkeypatch):
    """Inductor's cache in this module's directory (shared by its tests: kernels compiled once),
    the environment restored after; no compiled graph kept between tests."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))
    clear_caches()
    cb.fresh()
    yield
    cb.fresh()
    clear_caches()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_compiled_inference_and_the_unet_skip(strategy, inductor):
    r = cb.inference(strategy)
    want = cb.COMPILED[strategy]
    assert r.same_as_eager, "the compiled UNet level computes what the eager one does, bug for bug"
    assert r.caller_mutated == want.caller_mutated
    assert r.skip_reads_output == want.skip_reads_output
    # compiled or not, the caller sees what eager shows (bugs.EXPECTED, tests/test_bugs.py), and
    # since the compiled level computes what the eager one does, the README's eager skip column
    # (the caller's x written) is what the eager level's skip reads
    assert r.caller_mutated == bugs.EXPECTED[strategy].caller_mutated
    assert r.skip_reads_output == bugs.EXPECTED[strategy].caller_mutated


@pytest.mark.slow  # the strategies that train compile a backward too: 5-25 s each on a loaded 2-core machine
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_compiled_textual_inversion(strategy, inductor):
    r = cb.training(strategy)
    want = cb.COMPILED[strategy]
    assert (r.raises, r.error) == (want.raises, want.error), r
    if want.raises == cb.NEVER:
        assert r.embedding_moved, "training ran but the embedding did not move"
    if want.raises == cb.COMPILE:
        assert r.error_type in {"BackendCompilerFailed", "TorchRuntimeError"}, r.error_type
    # torch.compile refuses exactly what eager refuses, only earlier
    assert (r.error is None) == (bugs.EXPECTED[strategy].training is None)


def test_the_commit_fails_while_compiling_not_in_backward():
    """The story without the table: eager fails in backward, compiled before the first step runs."""
    assert cb.COMPILED["iadd"].raises == cb.COMPILE and cb.eager_raises("iadd") == cb.BACKWARD
    assert cb.COMPILED["iadd"].caller_mutated and cb.COMPILED["iadd_clone"].raises == cb.NEVER


def test_the_readme_table_is_generated_from_the_compiled_table():
    assert guide_block("compiled-bugs", "bugs.md").strip() == cb.markdown()


def test_the_readme_bug_table_has_a_torch_compile_column_from_the_table():
    """The "## The bugs" table's torch.compile column: each cell is ``compiled.bug_cells``'."""
    text = README.read_text()
    table = text[text.index("| bug | PyTorch behaviour") :].split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    col = header.index("torch.compile (Inductor, CPU)")
    cells = {}
    for line in table[2:]:
        row = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        cells[row[0]] = row[col]
    assert cells == cb.bug_cells()
