"""mypy's cache for the tests that type-check code with it (the README's call), kept with the
build caches every clone on this machine shares (``build_cache()``, the Makefile's CACHE): mypy
checks each cached module against its source's hash, so a hit is the same analysis, and
typeshed's stubs are not analysed again in every run (3 s to 0.2 s). Not stubtest's: it needs
every stub's functions whole, which a module read from the cache does not have."""

from __future__ import annotations

from pathlib import Path

from plusequals.cli.demo import build_cache


def mypy_cache(name: str) -> Path:
    """A cache directory of its own for each of the tests' mypy configurations (one configuration
    rewriting another's cache would leave both cold)."""
    return build_cache() / "mypy" / name
