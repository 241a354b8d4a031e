"""What `pip install <repo>` needs from the repo's own files (README, "Install").

make test's scripts/test_install.sh installs from source with cargo reusing target/'s release
build, so torch-sys's build script, the step that failed in pip's isolated environment, does not
run again there. These tests hold the two things that step needs, and every torch pin to one
version (tch 0.24 refuses any other libtorch)."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"torch==([0-9][0-9.]*)")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def torch_pins(requirements: list) -> list:
    return [m.group(1) for r in requirements if (m := PIN.fullmatch(r.replace(" ", "")))]


def test_pips_isolated_build_gets_the_projects_torch():
    project = pyproject()
    (runtime,) = torch_pins(project["project"]["dependencies"])
    assert torch_pins(project["build-system"]["requires"]) == [runtime]


def test_cargo_itself_tells_torch_sys_to_use_the_pip_torch():
    config = tomllib.loads((REPO / ".cargo" / "config.toml").read_text())
    assert config["env"]["LIBTORCH_USE_PYTORCH"] == "1"


def test_every_torch_the_set_up_installs_is_the_pinned_one():
    (runtime,) = torch_pins(pyproject()["project"]["dependencies"])
    for name in ("Makefile", "scripts/test_install.sh"):
        pins = PIN.findall((REPO / name).read_text())
        assert pins and set(pins) == {runtime}, f"{name} installs torch {pins}, pyproject.toml pins {runtime}"


def test_tchs_version_is_written_once():
    """tch's version has one source, Cargo.toml's `tch = "=X"`: rust/build.rs reads it (and refuses
    a torch-sys or pyo3-tch pin that differs) into the extension's `TCH_VERSION`, which the demo's
    scratch crate and the report use; scripts/gen_clippy_toml.py reads the pin too; the comments,
    clippy.toml's header and the guide that name it are checked here."""
    from plusequals import _rust

    version = _rust.TCH_VERSION
    deps = tomllib.loads((REPO / "Cargo.toml").read_text())["dependencies"]
    assert deps["tch"] == deps["torch-sys"] == deps["pyo3-tch"]["version"] == f"={version}"
    major_minor = ".".join(version.split(".")[:2])
    assert f"tch {major_minor} is compiled against" in (REPO / "pyproject.toml").read_text()
    assert f"tch {major_minor} is built for" in (REPO / "Cargo.toml").read_text()
    assert f"scripts/gen_clippy_toml.py from tch {version}:" in (REPO / "clippy.toml").read_text()
    building = (REPO / "docs" / "guide" / "building.md").read_text()
    assert f"| tch, torch-sys | ={version} | tch {major_minor} is" in building
    assert f"| pyo3-tch | ={version} | pyo3-tch {major_minor} is built on tch {major_minor}" in building
