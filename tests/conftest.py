import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # conftest and support, for the test modules

from plusequals import BasicTransformerBlock, RustBlock  # noqa: E402
from plusequals.model.blocks import randomize_  # noqa: E402,F401  (tests import it from here)

# SD v1 block shapes (tokens, dim, heads, head dim; context 77 x 768) scaled down for 2 CPU cores:
# widths / 4, tokens / 16, same head count, same tokens-per-width ordering.
SHAPES = [(256, 80, 8, 10), (64, 160, 8, 20), (16, 320, 8, 40), (4, 320, 8, 40)]
CONTEXT = (77, 192)
BATCH = 2

# Hypothesis profiles (HYPOTHESIS_PROFILE): "ci", what `make test` runs, keeps every test's own
# budget; "dev" (`make check`) runs a quarter of each, for a quick loop. A test writes its budget
# at the ci scale through examples(n).
settings.register_profile("ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> int:
    """``n`` examples in the ci profile, scaled by the loaded profile (at least 1)."""
    return max(1, n * settings.default.max_examples // 100)


# The tests' report: every section at the quick shapes, timed with the fewest rounds (--smoke). No
# test reads which way a measured number fell, so a real run's rounds would only cost time.
SMOKE_REPORT = [sys.executable, "-m", "plusequals", "report", "--quick", "--smoke", "--device", "cpu"]
QUICK_REPORT = [*SMOKE_REPORT, "--json", "--out"]
_STARTED = "PLUSEQUALS_TEST_QUICK_REPORT"  # where the controller's early quick report writes


def pytest_configure(config):
    """Under pytest-xdist each worker holds libtorch to its share of the cores (OMP threads
    sharing a core wait at every op's barrier); a test that changes the count puts it back.
    The children a test starts inherit the share through OMP_NUM_THREADS. The controller starts
    the quick report at once, beside the workers (it is the suite's longest chain: the report,
    then the tests that read it); quick_report_run waits for it.

    torch._dynamo is imported here, once for the session (import plusequals does not import it):
    pytester's in-process runs drop the modules first imported inside them, and torch._inductor's
    test library, which Dynamo imports, cannot be defined a second time in one process. Here and
    not at the top: the child processes that import this module as a library (test_boundary.py's
    fuzzers and leak check) need no Dynamo.

    Inductor, as make test runs it however pytest is started (the workers and every child inherit
    both): its kernels from the cache make keeps (CACHE/inductor, the Makefile's), and its C++
    compiled in the process that compiles. Its default, a pool of compile workers started for each
    compile, costs a Python start per worker (about 2 s of CPU each), which a warm cache never uses:
    test_compiled_bugs.py alone took 70 s of CPU with the pool, 35 s without. Neither changes a
    kernel: the cache is keyed by the graph, Inductor's config and torch's version. Inductor's
    vector-ISA checks (ten Python starts, 11 s of CPU in each process that compiles) are remembered
    once passed, as the report does (plusequals.bench.inductor.isa_checks_remembered).

    JAX's compiled executables, kept the same way (CACHE/jax): every compile, however short (by
    default JAX keeps only those that took a second or more, and the tests' are all shorter), so
    test_jax.py takes 20 s of CPU instead of 43. JAX keys an entry by the computation, the compile
    options, the device and jaxlib's version: a hit is the same executable.

    OpenMP's threads wait for each other asleep (OMP_WAIT_POLICY=PASSIVE), read by libgomp when
    libtorch loads: in the workers and children, not in this process. By default they spin first,
    and a test that runs two intra-op threads on a core the other worker holds (test_threads.py,
    test_layerwise_casting.py) spent its time spinning at each op's barrier: a bf16 UNet step took
    20 s there against 2 s alone. The wait changes no result."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from plusequals.cli.demo import build_cache

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(build_cache() / "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(build_cache() / "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    import torch._dynamo  # noqa: F401
    import torch._inductor.config

    torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    from plusequals.bench.inductor import isa_checks_remembered

    config._isa_checks = contextlib.ExitStack()
    config._isa_checks.enter_context(isa_checks_remembered())

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)
    elif config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER") and _whole(config):
        out = Path(tempfile.mkdtemp(prefix="plusequals-quick-report-"))
        script = '"$@" >stdout 2>stderr; echo $? >rc.part && mv rc.part rc'  # rc appears whole, once done
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a worker's share, as where it ran before
        command = ["sh", "-c", script, "sh", *QUICK_REPORT, str(out / "report")]
        config._quick_report = subprocess.Popen(command, cwd=out, env=env, start_new_session=True)
        os.environ[_STARTED] = str(out)  # the workers, started after this hook, inherit it


def _whole(config) -> bool:
    """A run of the whole suite (no paths but tests/, no -k): one that reads the quick report."""
    here = Path(__file__).resolve().parent
    return not config.option.keyword and all(Path(a).resolve() == here for a in config.args)


def pytest_unconfigure(config):
    if hasattr(config, "_isa_checks"):
        config._isa_checks.close()
    proc = getattr(config, "_quick_report", None)
    if proc is not None:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        shutil.rmtree(os.environ.pop(_STARTED), ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """The tests that read the quick report run on one xdist worker (--dist loadgroup): a session
    fixture is made once per worker, and the report is the suite's longest fixture. The cuda
    tests are skipped without a device."""
    for item in items:
        if {"quick_report", "quick_report_run"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("quick_report"))
        if not CUDA and item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda  # skipped without a device (below); scripts/gpu_check.sh runs `-m cuda`


def make_block(dim=80, heads=8, d_head=10, context_dim=CONTEXT[1], seed=0, **kw) -> BasicTransformerBlock:
    return randomize_(BasicTransformerBlock(dim, heads, d_head, context_dim=context_dim, **kw), seed).eval()


def make_inputs(tokens=256, dim=80, context=True, batch=BATCH, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, dim, generator=g).to(device, dtype)
    c = torch.randn(batch, CONTEXT[0], CONTEXT[1], generator=g).to(device, dtype) if context else None
    return x, c


def outcome(f):
    """What ``f()`` gives under ``no_grad``: its result, or the exception it raised (a test that
    compares a twin with its library sorts them)."""
    try:
        with torch.no_grad():
            return f()
    except Exception as e:  # noqa: BLE001 - the caller sorts them
        return e


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inductor_cache_dir(tmp_path_factory) -> Path:
    """Where Inductor's compiled kernels go for a test module that compiles: the directory the
    environment names (make test: CACHE/inductor, kept between runs and clones, as ccache keeps
    torch-sys's objects; a hit is the same kernel, keyed by the graph, the config and torch's
    version), else a fresh one of this session's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and named != default_cache_dir():
        return Path(named)
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture
def block():
    return make_block()


@pytest.fixture
def rust(block):
    return RustBlock.from_torch(block)


@pytest.fixture
def swapping():
    """torch.__future__'s swap_module_params_on_conversion on, put back as it was after."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)


@pytest.fixture(scope="session")
def diffusers():
    """diffusers, with the submodules the tests name loaded (its submodules are lazy); the test
    skipped without it."""
    module = pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
    import diffusers.models.attention  # noqa: F401
    import diffusers.models.attention_processor  # noqa: F401

    return module


@pytest.fixture(scope="session")
def tiny_unet(diffusers):
    """``tiny_unet(seed=0)``: a fresh deep copy of the project's tiny UNet, its transformer blocks
    randomised, built once per seed in the session (support.unet)."""
    from support.unet import TinyUnets

    return TinyUnets()


@pytest.fixture(scope="session")
def quick_report_run(tmp_path_factory):
    """One `python -m plusequals report --quick --device cpu --json` for the whole session
    (test_report.py, test_summary.py, test_inductor.py): its directory, stdout (the summary's
    JSON) and stderr. Under xdist the controller started it (pytest_configure): wait for it."""
    started = os.environ.get(_STARTED)
    if started:
        out = Path(started)
        rc = wait_for_exit_status(out)
        stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
        out = out / "report"
    else:
        out = tmp_path_factory.mktemp("report")
        proc = subprocess.run([*QUICK_REPORT, str(out)], capture_output=True, text=True)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    return SimpleNamespace(out=out, stdout=stdout, stderr=stderr)


def wait_for_exit_status(out: Path) -> int:
    """The exit status of the controller's report, once it has ended (pytest-timeout bounds a hang)."""
    import time

    while not (out / "rc").exists():
        time.sleep(0.5)
    return int((out / "rc").read_text())


@pytest.fixture(scope="session")
def quick_report(quick_report_run):
    return quick_report_run.out
