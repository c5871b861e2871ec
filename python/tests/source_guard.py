"""Keeps the suite off the source tree's `baton` package, which has no compiled `_baton`.

`python -m pytest` run inside `python/` puts that directory first on `sys.path`, so
`import baton` would find `python/baton/` — the Python half of the package without the
extension module — and fail with `No module named 'baton._baton'`. `use_installed_baton`
takes the source directory off `sys.path` (unless an extension was built into it, as
`maturin develop` does) and says clearly what to do when no installed package is left.
"""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path
from typing import List, Optional


def _has_extension(package: Path) -> bool:
    return any(
        (package / f"_baton{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def use_installed_baton(source: Path, path: List[str]) -> Optional[str]:
    """Removes `source` (the directory holding the source package `baton/`) from `path`
    (`sys.path`, changed in place) unless its package has a built extension; returns
    `None` if a usable `baton` is found on `path` then, else the message to stop with."""
    source = source.resolve()
    if not _has_extension(source / "baton"):
        path[:] = [p for p in path if Path(p or os.getcwd()).resolve() != source]
    importlib.invalidate_caches()
    spec = importlib.machinery.PathFinder.find_spec("baton", path)
    if spec is None:
        return (
            "the baton package is not installed in this Python "
            f"(only its source tree, {source / 'baton'}, which has no compiled _baton): "
            "run `bash python/run-tests.sh` (a fresh venv with the dev wheel), or "
            "`pip install ./python` (or `maturin develop -m python/Cargo.toml`) first"
        )
    return None
