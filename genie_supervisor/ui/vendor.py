"""The page's charting library, uPlot, fetched from the npm registry into ``static/vendor/`` (git-ignored).

    python -m genie_supervisor.ui.vendor     # what `make deps` runs; does nothing when the pinned version is there

The pinned release's tarball is downloaded from the npm registry (``$GENIE_NPM_REGISTRY``, default
https://registry.npmjs.org; no npm needed); its SHA-512 must equal the registry's integrity
value written here, else nothing is written. Three files are kept: the minified script, its
stylesheet and the MIT license. setuptools ships them in wheels (package data) when they are there
at build time. Without them the page works and says that the charts are unavailable.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

PACKAGE = "uplot"
"""npm package name."""
VERSION = "1.6.32"
"""Pinned release."""
INTEGRITY = "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="
"""The registry's ``dist.integrity`` of that release (``npm view uplot@1.6.32 dist.integrity``)."""
FILES = {
    "package/dist/uPlot.iife.min.js": "uPlot.iife.min.js",
    "package/dist/uPlot.min.css": "uPlot.min.css",
    "package/LICENSE": "uPlot.LICENSE",
}
"""Tarball member -> file name under ``static/vendor/``."""
VENDOR = Path(__file__).resolve().parent / "static" / "vendor"
"""Where the files go (inside the package, so wheels carry them)."""
REGISTRY = os.environ.get("GENIE_NPM_REGISTRY", "https://registry.npmjs.org")
"""The npm registry (a mirror can be named with ``GENIE_NPM_REGISTRY``)."""
STAMP = "uPlot.VERSION"
"""File holding the version that is there."""


class VendorError(Exception):
    """The library could not be fetched or did not match its pinned hash."""


def installed(dest: Path = VENDOR) -> bool:
    """Whether the pinned version's files are all there."""
    stamp = dest / STAMP
    return (
        all((dest / name).is_file() for name in FILES.values())
        and stamp.is_file()
        and stamp.read_text(encoding="utf-8").strip() == VERSION
    )


def check_integrity(data: bytes, integrity: str = INTEGRITY) -> None:
    """Raise VendorError unless `data` has the SHA-512 of `integrity` (npm's ``sha512-<base64>``)."""
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode("ascii")
    if got != want:
        raise VendorError(f"{PACKAGE}@{VERSION}: the tarball's {algo} is {got}, expected {want}; nothing written")


def tarball_url(registry: str = REGISTRY) -> str:
    """The pinned release's tarball address in the npm registry (its ``dist.tarball``)."""
    return f"{registry.rstrip('/')}/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"


def fetch(dest: Path = VENDOR, registry: str = REGISTRY) -> None:
    """Download the pinned release's tarball, check it and write its files to `dest`."""
    url = tarball_url(registry)
    try:
        with urllib.request.urlopen(url, timeout=120) as response:  # noqa: S310 (a fixed https address)
            data = response.read()
    except (urllib.error.URLError, TimeoutError) as exc:
        raise VendorError(f"could not download {url}: {exc}; the page will say charts are unavailable") from exc
    check_integrity(data)
    contents: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member, name in FILES.items():
            f = tar.extractfile(member)
            if f is None:
                raise VendorError(f"{PACKAGE}@{VERSION}: {member} is not in the tarball")
            contents[name] = f.read()
    dest.mkdir(parents=True, exist_ok=True)
    for name, body in contents.items():
        (dest / name).write_bytes(body)
    (dest / STAMP).write_text(VERSION + "\n", encoding="utf-8")


def main() -> int:
    """Fetch unless present; exit 1 with one line on failure."""
    if installed():
        print(f"{PACKAGE} {VERSION}: present in {VENDOR}")
        return 0
    try:
        fetch()
    except (VendorError, OSError, tarfile.TarError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{PACKAGE} {VERSION}: fetched into {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
