"""`python -m plusequals report --quick --device cpu`: files, numbers traceable to results.json,
and results written as they come."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from plusequals.report import NUMBER, fmt


def _tokens_of_results(obj, out: set) -> set:
    """Every number results.json can justify: each numeric leaf as REPORT.md formats it, and the
    digits inside its strings (versions, shape labels, notes)."""
    if isinstance(obj, dict):
        for v in obj.values():
            _tokens_of_results(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _tokens_of_results(v, out)
    elif isinstance(obj, bool) or obj is None:
        pass
    elif isinstance(obj, (int, float)):
        out.update(NUMBER.findall(fmt(obj)))
    elif isinstance(obj, str):
        out.update(NUMBER.findall(obj))
    return out


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run(
        [sys.executable, "-m", "plusequals", "report", "--quick", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_writes_report_results_and_plots(quick_report):
    assert (quick_report / "REPORT.md").stat().st_size > 1000
    assert (quick_report / "time_per_shape.png").stat().st_size > 10_000
    data = json.loads((quick_report / "results.json").read_text())
    assert data["complete"] is True
    variants = {r["variant"] for r in data["results"]}
    for v in ["eager/op_plus_x", "eager/iadd", "eager/iadd_clone", "eager/first_out_of_place", "eager/copy_iadd",
              "eager/preallocated", "eager/x_plus_op", "rust/forward", "rust/forward_owned",
              "rust/forward_owned_donate", "rust/loop"]:  # fmt: skip
        assert v in variants
    assert len(data["results"]) == len(variants) * len(data["config"]["shapes"]) * len(data["config"]["batches"])
    for r in data["results"]:
        assert r["median_ms"] > 0 and r["iqr_ms"] >= 0 and r["runs"] >= 1, r
    assert data["ceilings"]["gemm_tflops"] > 0 and data["ceilings"]["copy_gbps"] > 0
    assert {t["target"] for t in data["targets"]} and all(t["status"] for t in data["targets"])


def test_every_number_in_the_report_is_in_results_json(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    allowed = _tokens_of_results(data, set())
    text = (quick_report / "REPORT.md").read_text()
    stray = [n for n in NUMBER.findall(text) if n not in allowed]
    assert not stray, f"numbers in REPORT.md not in results.json: {sorted(set(stray))[:20]}"


def test_the_check_catches_an_invented_number(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    allowed = _tokens_of_results(data, set())
    assert "31415.9" not in allowed


def test_results_are_written_as_they_come(tmp_path):
    """Interrupt a run once it has measured something: results.json holds those rows."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plusequals", "report", "--quick", "--device", "cpu", "--out", str(tmp_path), "--no-unet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = tmp_path / "results.json"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if path.exists():
                try:
                    rows = json.loads(path.read_text()).get("results", [])
                except json.JSONDecodeError:  # pragma: no cover - replaced atomically
                    rows = []
                if len(rows) >= 3:
                    break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    data = json.loads(path.read_text())
    assert data["complete"] is False
    assert len(data["results"]) >= 3
