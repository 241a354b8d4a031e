"""Runs diffusers' own UNet2DConditionModel tests twice, plainly and with every UNet swapped, and
compares them test by test.

    python scripts/diffusers_suite.py TESTS [--deps DIR] [--out DIR] [-k EXPR] [-n N] [--run both|plain|swapped|none]

TESTS is the ``tests`` folder of a diffusers checkout (not shipped in the wheel: take it from the
repository, at the version installed). Its test modules import ``parameterized`` and
``requests_mock``, which plusequals does not need: ``--deps`` is a folder they are installed in
(``uv pip install --target DIR --no-deps parameterized requests_mock``), put on ``PYTHONPATH``.

The swapped run loads this file as a pytest plugin: every ``UNet2DConditionModel`` a test builds
(``model_class(**init_dict)``, ``from_pretrained``) has its transformer blocks swapped for Rust ones
right after ``__init__`` (``plusequals.swap_transformer_blocks``). A UNet the swap refuses (a block
of another kind) stays as it was; each build is logged, so the summary says how many tests ran on
swapped blocks at all. Prints the counts (passed, failed, skipped, errors) of both runs, and every
test whose outcome differs, with the swapped run's message. Exit status 1 when a test passes plainly
and fails swapped, else 0.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Tuple

SWAP_LOG = "PLUSEQUALS_SWAP_LOG"  # set in the swapped run only: where each build is logged
TEST_FILE = "models/unets/test_models_unet_2d_condition.py"

# --------------------------------------------------------------------------------------------
# The plugin (the swapped run: -p diffusers_suite)
# --------------------------------------------------------------------------------------------


def _log(entry: dict) -> None:
    entry["test"] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    with open(os.environ[SWAP_LOG], "a") as f:
        f.write(json.dumps(entry) + "\n")


def _swap(unet) -> None:  # noqa: ANN001
    from plusequals import swap_transformer_blocks
    from plusequals.errors import UnsupportedBlockError

    try:
        handle = swap_transformer_blocks(unet)
    except UnsupportedBlockError as e:
        _log({"swapped": 0, "refused": str(e).splitlines()[-1].strip()})
        return
    except ValueError as e:  # no BasicTransformerBlock at all
        _log({"swapped": 0, "refused": str(e)})
        return
    _log({"swapped": len(handle)})


def pytest_configure(config) -> None:  # noqa: ANN001
    if not os.environ.get(SWAP_LOG):
        return
    from diffusers import UNet2DConditionModel

    init = UNet2DConditionModel.__init__

    @functools.wraps(init)  # diffusers reads the config's names from the signature (__wrapped__)
    def swapped_init(self, *args, **kwargs) -> None:  # noqa: ANN001
        init(self, *args, **kwargs)
        if type(self) is UNet2DConditionModel:
            _swap(self)

    UNet2DConditionModel.__init__ = swapped_init


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------


def _outcomes(xml: Path) -> Dict[str, Tuple[str, str]]:
    """test id -> (outcome, first line of its message) from a JUnit XML report."""
    out: Dict[str, Tuple[str, str]] = {}
    if not xml.exists():
        return out
    for case in ET.parse(xml).iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        out[test] = (outcome, message)
    return out


def _run(tests: Path, args: argparse.Namespace, name: str, swap: bool) -> Dict[str, Tuple[str, str]]:
    out = Path(args.out)
    xml = out / f"{name}.xml"
    env = dict(os.environ)
    paths = [str(Path(__file__).resolve().parent)] + ([str(Path(args.deps).resolve())] if args.deps else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop(SWAP_LOG, None)
    cmd = [sys.executable, "-m", "pytest", str(tests / TEST_FILE), "-q", "-p", "no:cacheprovider"]
    cmd += ["-n", str(args.n), f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    if args.k:
        cmd += ["-k", args.k]
    if swap:
        log = out / "swaps.jsonl"
        log.unlink(missing_ok=True)
        env[SWAP_LOG] = str(log)
        cmd += ["-p", "diffusers_suite"]
    print(f"{name}: {' '.join(cmd)}", flush=True)
    with open(out / f"{name}.log", "w") as f:
        subprocess.run(cmd, cwd=tests.parent, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    return _outcomes(xml)


def _counts(results: Dict[str, Tuple[str, str]]) -> str:
    c = collections.Counter(outcome for outcome, _ in results.values())
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped")) + f" ({len(results)} tests)"


def _swaps(log: Path) -> str:
    """How many UNets were built, swapped and refused, and in how many tests."""
    if not log.exists():
        return "no UNet was built"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    swapped = [e for e in entries if e["swapped"]]
    refused = collections.Counter(e["refused"] for e in entries if not e["swapped"])
    tests = {e["test"] for e in swapped}
    lines = [f"{len(entries)} UNets built: {len(swapped)} swapped (in {len(tests)} tests), {sum(refused.values())} not"]
    lines += [f"  not swapped x{n}: {why[:200]}" for why, n in refused.most_common()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tests", help="the tests folder of a diffusers checkout")
    ap.add_argument("--deps", help="a folder holding parameterized and requests_mock")
    ap.add_argument("--out", default="target/diffusers-suite", help="where the reports and logs go")
    ap.add_argument("-k", help="pytest's -k, to run part of the suite")
    ap.add_argument("-n", type=int, default=1, help="pytest-xdist workers (default 1)")
    ap.add_argument(
        "--run",
        choices=("both", "plain", "swapped", "none"),
        default="both",
        help="run one of the two only (in parallel, say), or none, and compare with the reports in --out",
    )
    args = ap.parse_args()
    tests = Path(args.tests).resolve()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    runs = {name: args.run in ("both", name) for name in ("plain", "swapped")}
    plain = _run(tests, args, "plain", swap=False) if runs["plain"] else _outcomes(out / "plain.xml")
    swapped = _run(tests, args, "swapped", swap=True) if runs["swapped"] else _outcomes(out / "swapped.xml")
    print(f"plain:   {_counts(plain)}\nswapped: {_counts(swapped)}")
    print(_swaps(Path(args.out) / "swaps.jsonl"))
    lost: List[str] = []
    both = set(plain) & set(swapped)
    if len(both) < len(set(plain) | set(swapped)):
        print(f"compared: the {len(both)} tests both runs ran (-k, or one run's report from an earlier call)")
        print(f"plain on those: {_counts({t: plain[t] for t in both})}")
    for test in sorted(both):
        a, b = plain[test], swapped[test]
        if a[0] != b[0]:
            print(f"  {test}: {a[0]} plain, {b[0]} swapped{': ' + b[1] if b[1] else ''}")
            if a[0] == "passed":
                lost.append(test)
    print(f"{len(lost)} tests pass plainly and not swapped")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
