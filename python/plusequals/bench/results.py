"""results.json, as typed rows: what a report run writes and what REPORT.md is rendered from.

Each row is a dataclass whose fields are its results.json keys: ``to_json`` writes it, keys in
results.json's order, ``from_json`` reads it back. :class:`ResultsFile` keeps the document in
memory and rewrites the file after every change, so that an interrupted run keeps what it
measured. :class:`Results` is a whole results.json read back: its rows, each kind indexed by
what the analysis looks it up by.
:func:`fmt` is how any of its numbers is printed.

The measuring side (:mod:`.measure`, :mod:`.unet`) writes these rows; the analysing side
(:mod:`.analyse`, :mod:`.render`) reads them. This module imports neither.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, TypeVar

R = TypeVar("R", bound="Record")


def fmt(v: Any) -> str:
    """The one number format of REPORT.md and the verdicts (tests check each printed number
    against results.json)."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2g}"


# A number as ``fmt`` prints it (the tests find REPORT.md's numbers with it).
NUMBER = re.compile(r"\d+(?:\.\d+)?")


class Record:
    """A results.json object as a dataclass: its fields are the object's keys, in order."""

    def to_json(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[R], d: Mapping[str, Any]) -> R:
        """The row a results.json object holds (keys it lacks take their field's default)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- measured
@dataclass(frozen=True, kw_only=True)
class Timing(Record):
    """One variant's times over one cell's rounds, its reset subtracted in each round: the
    per-round times, their median and IQR, and what a time includes. (Host-cost rows of older
    results.json files have only variant, median_ms, iqr_ms, rounds, rounds_ms and note.)"""

    variant: str
    family: Optional[str] = None
    median_ms: float
    iqr_ms: float
    q1_ms: Optional[float] = None
    q3_ms: Optional[float] = None
    rounds: int
    rounds_ms: list[float]
    calls_per_sample: Optional[int] = None
    forwards_per_call: int = 1
    reset_probe: Optional[str] = None
    reset_ms: float = 0.0
    note: str


@dataclass(frozen=True, kw_only=True)
class CellTiming(Timing):
    """One variant in one (batch, shape) cell: its ``Timing``; for a call of one forward, its
    peak device memory and host time per call (None where not measurable); for torch.compile,
    its compile seconds."""

    batch: int
    shape: str
    peak_mb: Optional[float] = None
    host_ms: Optional[float] = None
    compile_s: Optional[float] = None

    def to_json(self) -> dict:
        out = {"batch": self.batch, "shape": self.shape} | super().to_json()  # the cell first
        if self.forwards_per_call != 1:
            del out["peak_mb"], out["host_ms"]
        if self.compile_s is None:
            del out["compile_s"]
        return out


@dataclass(frozen=True)
class Cell(Record):
    """One (batch, shape) cell's rounds: their seed and orders, calls per sample, every raw
    sample (ms per call, per probe and round) and the seconds they took."""

    batch: int
    shape: str
    seed: int
    rounds: int
    orders: list[list[str]]
    calls_per_sample: dict[str, int]
    raw_ms: dict[str, list[float]]
    seconds: float


@dataclass(frozen=True)
class Boundary(Record):
    """The crossing into Rust and back with no op, in one cell (us, median and IQR over rounds)."""

    batch: int
    shape: str
    donation_check_us: float
    donation_check_iqr_us: float
    ownership_check_us: float
    ownership_check_iqr_us: float
    echo_us: float
    echo_iqr_us: float
    echo_checked_us: float
    echo_checked_iqr_us: float
    checked_over_echo: float
    rounds: int


@dataclass(frozen=True)
class TopOp(Record):
    op: str
    count_per_call: float
    ms_per_call: float


@dataclass(frozen=True)
class Profile(Record):
    """Where one call's time goes, per torch.profiler (``setup.profile_ops``)."""

    batch: int
    shape: str
    variant: str
    aten_ops_per_call: float
    self_cpu_ms_per_call: float
    self_cuda_ms_per_call: Optional[float]
    top: list[TopOp]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Profile:
        return replace(super().from_json(d), top=[TopOp.from_json(t) for t in d["top"]])


@dataclass(frozen=True)
class PerShape(Record):
    """The work of one block call in a cell: blocks of its shape per UNet step, GFLOP, and the
    MB a perfectly fused block must move."""

    batch: int
    shape: str
    blocks_per_step: int
    gflop: float
    min_mb: float


@dataclass(frozen=True)
class CompilerInfo(Record):
    """What the JAX and ONNX Runtime builders reported in one cell (``compilers.compiler_variants``)."""

    batch: int
    shape: str
    info: dict[str, Any]


@dataclass(frozen=True)
class StepTiming(Record):
    """A whole step run one way (``name``): its time over the rounds, and its ratio to the eager
    step's, paired per round (median and quartiles; ``within_noise``: they contain 1)."""

    name: str
    median_ms: float
    iqr_ms: float
    vs_eager: float
    vs_eager_q1: float
    vs_eager_q3: float
    within_noise: bool


@dataclass(frozen=True)
class UnetRow(StepTiming):
    """One implementation of the whole UNet step (eager, compiled, the swapped blocks, ...)."""


@dataclass(frozen=True)
class AuditRow(StepTiming):
    """One way of running a model family's train step in the audit's cost cell: one of
    ``AUDIT_PROBES`` (a row's ``name``)."""


# The audit's cost cell's probes (bench/audit_cost.py), by the row names results.json gives them.
EAGER, ANOMALY, AUDITED = "eager", "anomaly mode", "plusequals.audit"
BARE = "a TorchDispatchMode that does nothing (forward)"  # the floor under any dispatch mode
# the floor under any audit that sees what the audit sees: every op of the forward and every module call
OBSERVED = "a TorchDispatchMode and global module hooks that do nothing (forward)"
AUDIT_PROBES = (EAGER, ANOMALY, AUDITED, BARE, OBSERVED)


@dataclass(frozen=True)
class UnetStep(Record):
    """What REPORT.md shows of results.json's ``unet_step`` (written by :mod:`.unet`)."""

    what: str = ""
    rows: list[UnetRow] = field(default_factory=list)
    max_rel_err_rust: Optional[float] = None
    block_share: Optional[float] = None
    block_share_method: Optional[str] = None
    audit: Optional[str] = None  # what plusequals.audit found in the step (its summary line)
    skipped: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UnetStep:
        return replace(super().from_json(d), rows=[UnetRow.from_json(r) for r in d.get("rows", [])])


@dataclass(frozen=True)
class AuditFamily(Record):
    """One model family's train step in the audit's cost cell (written by :mod:`.audit_cost`):
    each probe's time and paired ratio to eager, what the audit found, or why it was skipped."""

    family: str  # the kind of model ("a CNN with in-place activations")
    model: str  # the model's short name, as the targets name it ("resnet18")
    what: str = ""
    rows: list[AuditRow] = field(default_factory=list)
    audit: Optional[str] = None  # the audit's summary of the step, and its moves
    rounds: Optional[dict[str, Any]] = None  # as ``Rounds.record``
    skipped: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AuditFamily:
        return replace(super().from_json(d), rows=[AuditRow.from_json(r) for r in d.get("rows", [])])

    def row(self, name: str) -> Optional[AuditRow]:
        return next((r for r in self.rows if r.name == name), None)


# What a results.json written before the cell had families timed: resnet18 alone, its rows the cell's.
LEGACY_FAMILY = ("a CNN with in-place activations", "resnet18")


@dataclass(frozen=True)
class AuditCost(Record):
    """What ``plusequals.audit`` costs on a train step of each model family (written by
    :mod:`.audit_cost`): how the steps are timed, the target, and one :class:`AuditFamily` each."""

    what: str = ""
    threads: int = 1
    target: float = 1.25
    families: list[AuditFamily] = field(default_factory=list)
    skipped: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AuditCost:
        if "families" in d:
            families = [AuditFamily.from_json(f) for f in d["families"]]
        elif d.get("rows"):  # one resnet18 step, its rows and rounds at the top
            family, model = LEGACY_FAMILY
            families = [AuditFamily.from_json({**d, "family": family, "model": model})]
        else:
            families = []
        return replace(super().from_json(d), families=families)

    def family(self, model: str) -> Optional[AuditFamily]:
        return next((f for f in self.families if f.model == model), None)


@dataclass(frozen=True)
class HostCost(Record):
    """The host-cost cell: its shape (``Shape.record``), context, thread count, rounds (as
    ``Rounds.record``), one ``Timing`` per variant and (once analysed) their paired ratios."""

    batch: int
    shape: dict[str, Any]
    context: list[int]
    threads: int
    rust_loop_n: int
    cell: dict[str, Any]
    rows: list[Timing]
    paired: Optional[list[Paired]] = None
    differences: Optional[list[Difference]] = None

    def to_json(self) -> dict:
        out = super().to_json()
        for key in ("paired", "differences"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HostCost:
        paired = [Paired.from_json(p) for p in d["paired"]] if "paired" in d else None
        diffs = [Difference.from_json(p) for p in d["differences"]] if "differences" in d else None
        rows = [Timing.from_json(r) for r in d["rows"]]
        return replace(super().from_json(d), rows=rows, paired=paired, differences=diffs)


# ----------------------------------------------------------------------------- analysed
@dataclass(frozen=True)
class Paired(Record):
    """``variant / vs`` in one cell: the ratio within each round, and its median and quartiles."""

    batch: int
    shape: str
    variant: str
    vs: str
    median: float
    q1: float
    q3: float
    iqr: float
    rounds: int
    within_noise: bool
    ratios: list[float]


@dataclass(frozen=True, kw_only=True)
class Difference(Record):
    """``variant - vs`` in µs per call, within each round of one cell, its median and quartiles,
    and the budget it is held to (the crossing's: RustBlock's checks and the crossing over the raw
    extension call, or over a loop inside Rust)."""

    variant: str
    vs: str
    median_us: float
    q1_us: float
    q3_us: float
    iqr_us: float
    rounds: int
    budget_us: float
    within_budget: bool
    differences_us: list[float]


@dataclass(frozen=True)
class Drift(Record):
    """The reference's time in each round of one cell, in time order."""

    batch: int
    shape: str
    variant: str
    rounds_ms: list[float]
    max_over_min: float


@dataclass(frozen=True)
class Step(Record):
    """One variant's transformer blocks per UNet step: the sum of its medians, and the paired
    ratios to the reference weighted by each shape's share of the reference's step (None, and
    absent from results.json, where a shape has no ratio)."""

    batch: int
    variant: str
    blocks_ms_per_step: float
    blocks_only_it_per_s: float
    vs_reference: Optional[float] = None

    def to_json(self) -> dict:
        out = super().to_json()
        if self.vs_reference is None:
            del out["vs_reference"]
        return out


@dataclass(frozen=True)
class Floor(Record):
    """The roofline floor of one cell: the slower of its GEMM work and its bytes at the device's ceilings."""

    batch: int
    shape: str
    roofline_ms: float


@dataclass(frozen=True)
class SameWork(Record):
    """The eager strategies that do op_plus_x's work, at one batch: their paired ratios' range,
    and in how many cells they are inside the band and within noise."""

    batch: int
    cells: int
    min: float
    max: float
    inside_band: int
    within_noise: int
    outside_noise: list[str]


@dataclass(frozen=True)
class Target(Record):
    """One of the report's performance targets, with its measured value and status."""

    target: str
    value: Optional[float]
    limit: float
    unit: str
    status: str
    detail: str


# ----------------------------------------------------------------------------- files
class ResultsFile:
    """Holds results.json in memory and rewrites it after every change."""

    def __init__(self, out: Path, data: dict) -> None:
        self.path = out / "results.json"
        self.data = data
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def add(self, key: str, *rows: Record) -> None:
        """Appends ``rows`` to the list under ``key``."""
        self.data.setdefault(key, []).extend(r.to_json() for r in rows)
        self.flush()

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def finish(self, elapsed_s: float) -> None:
        """Marks the run complete: results.json then holds every number REPORT.md shows."""
        self.data["elapsed_s"] = elapsed_s
        self.data["complete"] = True
        self.flush()


Key = tuple[int, str]  # (batch, shape label): one cell


@dataclass(frozen=True)
class Results:
    """A results.json read back: its settings as they are, its rows typed and indexed; the
    analysed parts (paired ratios onward) empty until the analysis has run."""

    config: dict[str, Any]
    environment: dict[str, Any]
    ceilings: dict[str, Any]
    rows: dict[tuple[int, str, str], CellTiming]  # (batch, shape, variant), in the order measured
    cells: dict[Key, Cell]
    per_shape: dict[Key, PerShape]
    boundary: list[Boundary]
    profile: list[Profile]
    host_cost: Optional[HostCost]
    unet_step: Optional[UnetStep]
    audit_cost: Optional[AuditCost]
    compiler_verdict: Optional[dict[str, Any]]
    elapsed_s: float
    paired: dict[tuple[int, str, str, str], Paired]  # (batch, shape, variant, vs)
    drift: dict[Key, Drift]
    per_step: dict[tuple[int, str], Step]  # (batch, variant)
    roofline: dict[Key, Floor]
    same_work: dict[int, SameWork]  # by batch
    targets: list[Target]

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> Results:
        def listed(key: str, row: type[R]) -> list[R]:
            return [row.from_json(d) for d in data.get(key, [])]

        return cls(
            config=data["config"],
            environment=data["environment"],
            ceilings=data["ceilings"],
            rows={(r.batch, r.shape, r.variant): r for r in listed("results", CellTiming)},
            cells={(c.batch, c.shape): c for c in listed("cells", Cell)},
            per_shape={(p.batch, p.shape): p for p in listed("per_shape", PerShape)},
            boundary=listed("boundary", Boundary),
            profile=listed("profile", Profile),
            host_cost=HostCost.from_json(data["host_cost"]) if "host_cost" in data else None,
            unet_step=UnetStep.from_json(data["unet_step"]) if "unet_step" in data else None,
            audit_cost=AuditCost.from_json(data["audit_cost"]) if "audit_cost" in data else None,
            compiler_verdict=data.get("compiler_verdict"),
            elapsed_s=data.get("elapsed_s", 0.0),
            paired={(p.batch, p.shape, p.variant, p.vs): p for p in listed("paired", Paired)},
            drift={(d.batch, d.shape): d for d in listed("drift", Drift)},
            per_step={(s.batch, s.variant): s for s in listed("per_step", Step)},
            roofline={(f.batch, f.shape): f for f in listed("roofline", Floor)},
            same_work={w.batch: w for w in listed("same_work", SameWork)},
            targets=listed("targets", Target),
        )

    @property
    def batches(self) -> list[int]:
        return self.config["batches"]

    @property
    def shapes(self) -> list[str]:
        """The shapes' labels, in the order of the config."""
        return [s["label"] for s in self.config["shapes"]]

    @property
    def blocks(self) -> dict[str, int]:
        """Blocks of each shape per UNet step."""
        return {s["label"]: s["blocks"] for s in self.config["shapes"]}

    @property
    def reference(self) -> str:
        return self.config["reference"]

    @property
    def variants(self) -> list[str]:
        """The variants in the order they were measured."""
        return list(dict.fromkeys(v for _, _, v in self.rows))

    def row(self, batch: int, shape: str, variant: str) -> Optional[CellTiming]:
        return self.rows.get((batch, shape, variant))
