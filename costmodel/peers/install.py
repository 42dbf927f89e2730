"""The installed peer releases: where each lives, importing one, and the command that installs a missing one
(nothing here installs anything)."""

from __future__ import annotations

import contextlib
import os
import re
import sys

# ---- the installed peer ----------------------------------------------------------------------------------------

# The releases the rows of benchmarks/peer/*.csv are modelled with (``resolve_version`` of each row; a test holds the
# list to the CSVs), which scripts/setup.sh installs under ``default_peer_root()``.
RELEASES_USED = ("0.2.1", "0.3.0", "0.4.0", "0.5.5", "0.6.0", "0.6.2", "0.7.0", "0.8.0", "0.8.1", "0.8.2")


def default_peer_root() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megakernels", "peers")


def peer_dir(version: str, peer_path: str | None) -> str | None:
    """Where liger-kernel ``version`` is installed: ``peer_path/liger-kernel-<version>`` or
    ``peer_path/liger-<version>`` (``pip install --no-deps --target DIR liger-kernel==<version>``), or
    ``peer_path`` itself when it holds that version; None when not found."""
    for root in [peer_path, default_peer_root()] if peer_path else [default_peer_root()]:
        for d in (os.path.join(root, f"liger-kernel-{version}"), os.path.join(root, f"liger-{version}"), root):
            if os.path.isdir(os.path.join(d, "liger_kernel")) and _installed_version(d) == version:
                return d
    return None


def _installed_version(d: str) -> str | None:
    for name in os.listdir(d):
        m = re.fullmatch(r"liger_kernel-(.+)\.dist-info", name)
        if m:
            return m.group(1)
    return None


def install_hint(version: str, peer_path: str | None) -> str:
    """Why a row naming liger-kernel ``version`` is not modelled, with the command that installs that release (the
    model never installs anything itself; scripts/setup.sh installs ``RELEASES_USED``)."""
    root = peer_path or default_peer_root()
    return (
        f"liger-kernel {version} is not installed: pip install --no-deps --target "
        f"{os.path.join(root, 'liger-kernel-' + version)} liger-kernel=={version}"
    )


@contextlib.contextmanager
def imported(path: str):
    """liger_kernel imported from ``path`` (and forgotten afterwards, so another version can be imported)."""

    def forget():
        for k in [k for k in sys.modules if k == "liger_kernel" or k.startswith("liger_kernel.")]:
            del sys.modules[k]

    from megakernels.triton.launch import without_interpreter

    forget()
    sys.path.insert(0, path)
    try:
        with without_interpreter():  # @triton.jit must build JIT functions, to be compiled
            yield
    finally:
        sys.path.remove(path)
        forget()
