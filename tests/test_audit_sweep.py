"""The false-positive sweep: popular models, a train step (forward and backward) and an eval
forward under ``no_grad``, must give no finding (``plusequals/cases/sweep.py``) and, audited,
compute the same bits and run the same ATen ops as a plain run from the same seed
(``plusequals/cases/paired.py``; the heaviest torchvision models, audited on the meta device, have
no values to compare); each checks its row of the guide's table, which must list every model once.
``make test`` runs one model of each architecture (``sweep.representatives``: each torchvision and
timm code family, every torch.nn, transformers and diffusers model); the others carry the
``sweep`` marker, which ``make test`` leaves out and ``make sweep`` runs, after regenerating the
tables. Plain ``pytest`` runs them all. The heaviest (``sweep.SLOW``) are also marked slow.
"""

from __future__ import annotations

import pytest

from plusequals.cases import sweep
from support.docs import guide_block

pytest.importorskip("torchvision", reason="the sweep needs torchvision (the test extra)")


def entry(family: str, name: str) -> sweep.SweepModel:
    return next(e for e in sweep.entries(family) if e.name == name)


def assert_clean(row: sweep.SweepResult) -> None:
    """No finding and no error in train mode nor in eval mode, and (on the CPU) the audited runs
    computed what the plain ones did, bit for bit, with the same ATen ops."""
    for r in (row.report, row.eval):
        assert r.findings == [] and r.error is None and r.backward_error is None, (row.name, r.findings[:3], r.error)
    assert row.report.backward_skipped is None
    # the forward's ops (backward's C++ formulas are not dispatched); a torch.nn layer is a few
    assert row.report.ops >= (1 if row.family == "torch.nn" else 40) and row.eval.ops >= 1
    assert row.differences == ([] if entry(row.family, row.name).device == "cpu" else None), row.differences


def _models(slow: bool) -> list:
    return [(f, e.name) for f in sweep.families() for e in sweep.entries(f) if ((f, e.name) in sweep.SLOW) == slow]


def check(family: str, name: str) -> None:
    """The model is clean, runs audited as plain, and its guide row is current; three CNNs'
    in-place activations are moves."""
    row = sweep.run(entry(family, name))
    assert_clean(row)
    assert sweep.markdown([row]).splitlines()[-1] in guide_block("audit-sweep").splitlines()
    if (family, name) in sweep.MOVES:  # each in-place activation is a move, not an E0596
        assert sum(m.count for m in row.report.moves) == sweep.MOVES[family, name]
        assert all(m.writer and m.writer.endswith("(inplace=True)") for m in row.report.moves)
    for phase, op in FUSED.get((family, name), ()):  # the fused kernel ran, as often audited as plain
        assert row.ops is not None and row.ops[phase].get(op, 0) >= 1, (phase, op)


# torch.nn's fused kernels and fast paths on the CPU, which the audit must leave as they are (a
# module hook switches the Transformer layers' fast path off)
_LAYER = "aten._transformer_encoder_layer_fwd.default"
FUSED = {
    ("torch.nn", "LSTM"): [("train", "aten.mkldnn_rnn_layer.default"), ("eval", "aten.mkldnn_rnn_layer.default")],
    ("torch.nn", "TransformerEncoderLayer"): [("eval", _LAYER)],
    ("torch.nn", "TransformerEncoderLayer norm_first causal"): [("eval", _LAYER)],
    ("torch.nn", "TransformerEncoder padded"): [("eval", "aten._nested_tensor_from_mask.default"), ("eval", _LAYER)],
    ("torch.nn", "Transformer"): [("eval", _LAYER)],
    ("torch.nn", "MultiheadAttention"): [("eval", "aten._native_multi_head_attention.default")],
}


DEFAULT = _models(slow=False)
SUBSET = [(e.family, e.name) for e in sweep.representatives()]


@pytest.mark.parametrize("family,name", SUBSET, ids=[f"{f}-{n}" for f, n in SUBSET])
def test_a_model_of_each_architecture_is_clean_and_its_readme_row_current(family, name):
    check(family, name)


def test_the_subset_is_one_model_of_each_architecture():
    """make test's subset covers every architecture once, the models whose moves are counted among
    them; the rest of the sweep is every other model."""
    everything = [(f, e.name) for f in sweep.families() for e in sweep.entries(f)]
    arch = {(f, e.name): (f, sweep.architecture(e)) for f in sweep.families() for e in sweep.entries(f)}
    assert sorted(arch[m] for m in SUBSET) == sorted(set(arch.values()))
    assert set(sweep.MOVES) <= set(SUBSET)
    assert sorted(SUBSET + REST) == sorted(everything) and not set(SUBSET) & set(REST)
    assert len({a for f, a in arch.values() if f == "torchvision"}) >= 15


def test_the_readme_table_lists_every_model_of_the_sweep_once():
    """The table's rows (of the installed families) are the sweep's models, in its order: at least
    100 torchvision models (detection, segmentation, video and optical flow among them), 50 timm
    models, torch.nn's recurrent and Transformer layers and 10 transformers architectures; each
    slow one is a model of it."""
    installed = sweep.families()
    rows = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in guide_block("audit-sweep").splitlines()]
    listed = [row for row in rows[2:] if row[0] in installed]
    models = [(f, e.name) for f in installed for e in sweep.entries(f)]
    assert listed == models and set(sweep.SLOW) <= set(rows)
    count = {family: len([f for f, _ in rows if f == family]) for family in ("torchvision", "timm", "transformers")}
    assert count["torchvision"] >= 100 and count["timm"] >= 50 and count["transformers"] >= 10
    kinds = {a.split(".")[0] for e in sweep.entries("torchvision") for a in [sweep.architecture(e)] if "." in a}
    assert kinds == {"detection", "segmentation", "video", "optical_flow"}
    layers = {n.split()[0] for f, n in rows if f == "torch.nn"}
    assert {"RNN", "LSTM", "GRU", "TransformerEncoderLayer", "Transformer", "MultiheadAttention"} <= layers
    assert set(sweep.MOVES) <= set(DEFAULT) and len(DEFAULT) >= 60


def test_the_meta_device_gives_what_cpu_tensors_give():
    """The sweep runs torchvision on the meta device: on real CPU tensors resnet18 gives the same
    (no finding, the same moves at the same lines)."""
    cpu, meta = (sweep.run(entry("torchvision", "resnet18"), device) for device in ("cpu", "meta"))
    assert_clean(cpu)
    assert [m.key() + (m.count,) for m in cpu.report.moves] == [m.key() + (m.count,) for m in meta.report.moves]
    assert len(cpu.report.moves) == sweep.MOVES["torchvision", "resnet18"]


REST = [m for m in DEFAULT + _models(slow=True) if m not in SUBSET]


@pytest.mark.sweep
@pytest.mark.parametrize(
    "family,name",
    [pytest.param(*m, marks=[pytest.mark.slow] if m in sweep.SLOW else []) for m in REST],
    ids=[f"{f}-{n}" for f, n in REST],
)
def test_every_other_model_is_clean_and_its_readme_row_current(family, name):
    check(family, name)
