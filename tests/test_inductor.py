"""What Inductor does with the residual add, read from the code it generates
(``bench.inductor.residual_destination``), held to what the compiled block does to memory and to
the README's bullet. One compile per strategy, tiny shapes; Inductor's cache in conftest's
``inductor_cache_dir``."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import clear_caches

from conftest import inductor_cache_dir
from plusequals.bench import compilers, inductor
from plusequals.bench.analyse import step_ratio
from plusequals.bench.results import Results, fmt
from plusequals.cli.summary import build

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    """Both strategies compiled and read once for the module (Inductor's cache in conftest's
    ``inductor_cache_dir``, the environment restored after)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir(tmp_path_factory)))
        clear_caches()
        out = {}
        for strategy in inductor.STRATEGIES:
            torch._dynamo.reset()
            out[strategy] = inductor.read_small_block(strategy)
        torch._dynamo.reset()
        clear_caches()
    return out


def test_op_plus_x_stores_the_last_sum_in_a_buffer_it_reused_and_only_reads_x(read):
    r, returned_x = read["op_plus_x"]
    assert r.destination == inductor.REUSED and not returned_x
    assert r.defined.startswith(f"{r.returned} = ") and r.defined.endswith("# reuse")
    assert r.kernel.split("(")[1].split(",")[0] == r.returned  # the add kernel's in/out pointer
    assert "add" in r.kernel.split("(")[0] and len(r.fused_adds) >= 3


def test_iadd_stores_the_last_sum_over_the_callers_x(read):
    r, returned_x = read["iadd"]
    assert r.destination == inductor.CALLER and returned_x
    assert r.returned == r.x_arg and r.kernel.rstrip(")").endswith(r.x_arg)
    assert "copy_" in r.kernel.split("(")[0]


def test_the_report_verdict_names_inductor(read):
    v = compilers.verdict(inductor={f"compile/{k}": r.to_json() for k, (r, _) in read.items()})
    assert v["in_place"] == ["compile/iadd"] and v["reuses_buffers"] == ["compile/op_plus_x"]
    assert v["rows"]["compile/op_plus_x"]["kernel"] == read["op_plus_x"][0].kernel


def test_the_readme_bullet_is_the_generated_code(read):
    text = (README.parent / "docs/guide/report.md").read_text()  # the report's page of the guide
    said = text[text.index("<!-- inductor-verdict -->\n") + 26 : text.index("<!-- /inductor-verdict -->")]
    assert said.strip() == inductor.markdown({k: r for k, (r, _) in read.items()})


WRAPPER = """
    def call(self, args):
        arg0_1, arg1_1 = args
        assert_size_stride(arg0_1, (2, 7, 24), (168, 24, 1))
        assert_size_stride(arg1_1, (2, 16, 32), (512, 32, 1))
        {line}
        cpp_fused_add_view_0({out}, arg1_1)
        return ({out}, )
"""


@pytest.mark.parametrize(
    "line, out, destination",
    [
        ("buf1 = empty_strided_cpu((2, 16, 32), (512, 32, 1), torch.float32)", "buf1", inductor.NEW),
        ("buf1 = reinterpret_tensor(buf0, (2, 16, 32), (512, 32, 1), 0); del buf0  # reuse", "buf1", inductor.REUSED),
        ("pass", "arg1_1", inductor.CALLER),
    ],
)
def test_residual_destination_reads_each_kind(line, out, destination):
    r = inductor.residual_destination(WRAPPER.format(line=line, out=out), (2, 16, 32))
    assert (r.destination, r.returned, r.x_arg) == (destination, out, "arg1_1")


def test_residual_destination_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="one input of x's shape"):
        inductor.residual_destination(WRAPPER.format(line="pass", out="arg1_1"), (9, 9))
    with pytest.raises(ValueError, match="cannot tell"):
        inductor.residual_destination(WRAPPER.format(line="buf1 = torch.ones(3)", out="buf1"), (2, 16, 32))


# ----------------------------------------------------------------------------- in the quick CPU report
def test_the_quick_report_times_both_compiled_strategies_paired_with_their_compile_seconds(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    cfg = data["config"]
    assert cfg["torch_compile"] and cfg["torch_compile_batches"] == [2] and cfg["inductor_cache"]
    rows = {(r["batch"], r["shape"], r["variant"]): r for r in data["results"]}
    labels = [s["label"] for s in cfg["shapes"]]
    for shape in labels:
        op, ia = rows[2, shape, "compile/op_plus_x"], rows[2, shape, "compile/iadd"]
        assert op["compile_s"] > 0 and ia["compile_s"] > 0
        assert ia["reset_probe"] == "reset:compile/iadd" and "subtracted" in ia["note"]
        assert (16, shape, "compile/iadd") not in rows  # the quick CPU run compiles the seed's batch only
    paired = {(p["batch"], p["shape"], p["variant"], p["vs"]) for p in data["paired"]}
    assert all((2, sh, "compile/iadd", "compile/op_plus_x") in paired for sh in labels)


def test_the_quick_report_names_inductor_in_the_compiler_verdict_and_the_seeds_ratio(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    rows = data["compiler_verdict"]["rows"]
    assert rows["compile/op_plus_x"]["residual_destination"] == inductor.REUSED
    assert rows["compile/iadd"]["residual_destination"] == inductor.CALLER
    assert "compile/iadd" in data["compiler_verdict"]["in_place"]
    assert "compile/op_plus_x" in data["compiler_verdict"]["reuses_buffers"]
    ratio = step_ratio(Results.load(data), 2, "compile/iadd", "compile/op_plus_x")
    said = {v["question"]: v for v in build(data, quick_report)["verdicts"]}  # the summary's verdicts
    assert f"`compile/iadd` / `compile/op_plus_x` per step: {fmt(ratio)}" in said["The seed's ~7%?"]["text"]
    assert "Is `+=` faster compiled?" in said
    assert rows["compile/op_plus_x"]["kernel"] in said["Which compiler makes the residual add in place?"]["text"]


def test_the_report_keeps_inductors_cache_under_target_unless_one_is_named(monkeypatch, tmp_path):
    """torch's own default in the environment (it writes it there on first use) is no choice: the
    report then uses target/inductor-cache; a named directory wins; the environment is restored."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from plusequals.bench import measure
    from plusequals.cli.report import INDUCTOR_CACHE, inductor_cache

    monkeypatch.chdir(tmp_path)
    plan = measure.plan("cpu", True, unet=False, compilers_flag=False)
    for named, want in ((default_cache_dir(), INDUCTOR_CACHE), (str(tmp_path / "mine"), tmp_path / "mine")):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", named)
        with inductor_cache(plan) as p:
            assert p.inductor_cache == str(want) and p.inductor_cache_warm is False
            assert cache_dir() == str(Path(want).absolute())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == named


def test_the_readme_states_the_compiled_ratio_once_the_committed_report_has_it():
    """docs/report-cpu is regenerated after this change: until then it has no compiled row and
    the README claims none; after, the README's numbers block gives `compile/iadd` /
    `compile/op_plus_x` at batch 2 as the committed results.json has it."""
    from plusequals.bench.comparisons import compare

    data = json.loads((README.parent / "docs/report-cpu/results.json").read_text())
    text = README.read_text()
    numbers = text[text.index("What the committed CPU report says") :]
    numbers = " ".join(numbers[: numbers.index("<!-- /numbers -->")].split())
    c = compare(Results.load(data), 2, "compile/iadd", "compile/op_plus_x")
    assert ("`compile/iadd` / `compile/op_plus_x`" in numbers) == (c is not None)
    if c is not None:
        assert f"`compile/iadd` / `compile/op_plus_x` is {fmt(c.lo)} to {fmt(c.hi)}" in numbers


def test_step_ratio_is_the_per_step_ratio_the_report_already_gives():
    """``step_ratio(v, vs)`` (the compiled seed ratio's arithmetic) against the committed report's
    per-step ``vs_reference``, computed by other code, for every variant paired in every shape."""
    data = json.loads((README.parent / "docs/report-cpu/results.json").read_text())
    results = Results.load(data)
    checked = 0
    for (batch, variant), step in results.per_step.items():
        if step.vs_reference is not None and variant != results.reference:
            assert step_ratio(results, batch, variant, results.reference) == pytest.approx(step.vs_reference, rel=1e-12)
            checked += 1
    assert checked > 10


def test_a_passed_isa_check_is_remembered_and_a_failed_one_runs_again(monkeypatch, tmp_path):
    """``isa_checks_remembered``: a check that passed passes at once after, in this process and
    in the next (remembered in the Inductor cache dir in use), keyed by the check's code and the
    ISA's flags; one that failed runs again each time; another cache dir checks again; outside
    the context the check is torch's own."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    runs = []

    def check(isa, code):
        runs.append((str(isa), code))
        return code != "fails"

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check)
    avx2, avx512 = cpu_vec_isa.VecAVX2(), cpu_vec_isa.VecAVX512()
    with temporary_cache_dir(str(tmp_path / "a")):
        with inductor.isa_checks_remembered():
            assert cpu_vec_isa.VecISA.check_build is not check
            assert avx2.check_build("passes") and avx2.check_build("passes")
            assert not avx2.check_build("fails") and not avx2.check_build("fails")
            assert avx512.check_build("passes")
        assert cpu_vec_isa.VecISA.check_build is check
        with inductor.isa_checks_remembered():  # as the next process: from the cache dir
            assert avx2.check_build("passes") and avx512.check_build("passes")
    with temporary_cache_dir(str(tmp_path / "b")), inductor.isa_checks_remembered():
        assert avx2.check_build("passes")
    assert runs == [("avx2", "passes"), ("avx2", "fails"), ("avx2", "fails"), ("avx512", "passes"), ("avx2", "passes")]
