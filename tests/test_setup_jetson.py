"""deploy/setup-jetson.sh on a fake Jetson root: --dry-run changes nothing, a real run installs
everything with the right modes, a second run changes nothing, and each refusal says why.

The commands that need the network, users or systemd are replaced by small recording scripts
(GENIE_SETUP_* variables); everything else (install, chmod, sed, cmp) is real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "setup-jetson.sh"
BASH = shutil.which("bash")

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(BASH is None, reason="bash is not installed")]

R36 = "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May  6 17:34:21 UTC 2024\n"

# Each fake appends its argv to calls.log, then does the least the script relies on.
FAKES = {
    "python3": """
if sys.argv[1:3] == ["-m", "venv"]:
    bin_dir = pathlib.Path(sys.argv[3]) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text("#!/bin/sh\\n")
    (bin_dir / "python").chmod(0o755)
else:
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])
""",
    "pip": """
genie = ROOT / "opt/genie-supervisor/venv/bin/genie-supervisor"
genie.write_text("#!/bin/sh\\n")
genie.chmod(0o755)
""",
    "genie": """
if sys.argv[1:3] == ["models", "fetch"]:
    cache = pathlib.Path(sys.argv[sys.argv.index("--cache-dir") + 1])
    name = {"gemma3": "gemma-3-270m-q4_k_m.gguf", "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}[sys.argv[3]]
    (cache / name).write_bytes(b"GGUF")
    print(cache / name)
elif sys.argv[1] == "doctor":
    print("verdict: all good")
""",
    "systemctl": """
marker = ROOT / "etc/systemd/system/multi-user.target.wants/genie-supervisor.service"
if "is-enabled" in sys.argv:
    sys.exit(0 if marker.exists() else 1)
if "enable" in sys.argv:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("")
""",
    "useradd": """
with open(ROOT / "etc/passwd", "a") as f:
    f.write(f"{sys.argv[-1]}:x:{UID}:{GID}::/var/lib/genie-supervisor:/usr/sbin/nologin\\n")
with open(ROOT / "etc/group", "a") as f:
    f.write(f"{sys.argv[-1]}:x:{GID}:\\n")
""",
    "usermod": """
group, user = sys.argv[-2], sys.argv[-1]
path = ROOT / "etc/group"
lines = []
for line in path.read_text().splitlines():
    if line.split(":")[0] == group:
        line += ("," if not line.endswith(":") else "") + user
    lines.append(line)
path.write_text("\\n".join(lines) + "\\n")
""",
    "chown": "",
}

PRELUDE = """#!{python}
import os, pathlib, sys
REAL_PYTHON = {python!r}
ROOT = pathlib.Path({root!r})
UID, GID = {uid}, {gid}
with open({log!r}, "a") as log:
    log.write(pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:]) + "\\n")
"""


def make_root(tmp_path: Path, *, release: str | None = R36, cuda: bool = True, jtop: bool = False) -> Path:
    """A fake Jetson: L4T release file, CUDA 12 runtime, groups video/render, mosquitto."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    if release is not None:
        (root / "etc" / "nv_tegra_release").write_text(release)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\nrender:x:109:ubuntu\n")
    if cuda:
        lib = root / "usr/local/cuda/lib64"
        lib.mkdir(parents=True)
        (lib / "libcudart.so.12").write_text("")
        (root / "usr/local/cuda/version.json").write_text(
            '{\n   "cuda" : {\n      "name" : "CUDA SDK",\n      "version" : "12.2.140"\n   }\n}\n'
        )
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/mosquitto").write_text("")
    if jtop:
        (root / "run").mkdir()
        (root / "run" / "jtop.sock").write_text("")
    return root


def fake_env(tmp_path: Path, root: Path) -> dict[str, str]:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    # As root, the real chown runs (by numeric id, so the fake root's user works); otherwise a fake.
    uid, gid = (os.getuid(), os.getgid()) if os.geteuid() != 0 else (999, 999)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENIE_SETUP_")}
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text(PRELUDE.format(python=sys.executable, root=str(root), uid=uid, gid=gid, log=str(log)) + body)
        path.chmod(0o755)
        if name == "chown" and os.geteuid() == 0:
            continue
        env[f"GENIE_SETUP_{name.upper()}"] = str(path)
    env["GENIE_SETUP_PYTHON"] = str(bin_dir / "python3")
    return env


def setup(tmp_path: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    return subprocess.run(
        [BASH, str(SCRIPT), "--root", str(root), *args],
        env=fake_env(tmp_path, root),
        capture_output=True,
        text=True,
        timeout=60,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every path under root: mode, uid, gid and (for files) contents."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (
            st.st_mode,
            st.st_uid,
            st.st_gid,
            path.read_bytes() if path.is_file() else b"",
        )
    return out


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def mutating(lines: list[str]) -> list[str]:
    """Calls that change something (not the version checks and queries)."""
    return [c for c in lines if not c.startswith("python3 -c") and "is-enabled" not in c and " doctor " not in c]


def test_dry_run_prints_every_step_and_changes_nothing(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    before = snapshot(root)
    result = setup(tmp_path, root, "--dry-run")
    assert result.returncode == 0, result.stderr + result.stdout
    out = result.stdout
    assert "L4T R36.3.0 (JetPack 6)" in out
    assert "CUDA 12.2.140" in out
    assert "jtop service absent" in out and "sysfs" in out
    would = [line for line in out.splitlines() if line.startswith("  would  ")]
    for what in (
        "create system user genie",
        "create the venv",
        "install genie-supervisor[jetson,cuda]",
        "supervisor.yaml (mode 0600)",
        "create a random API key",
        "fetch the gemma3 demo model",
        "enable genie-supervisor.service",
    ):
        assert any(what in line for line in would), what
    assert "nothing was changed" in out
    assert snapshot(root) == before
    assert mutating(calls(tmp_path)) == []


def test_install_on_a_fake_root_then_rerun_changes_nothing(tmp_path: Path) -> None:
    root = make_root(tmp_path, jtop=True)
    first = setup(tmp_path, root)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "jtop service is running" in first.stdout

    config = root / "etc/genie-supervisor/supervisor.yaml"
    assert config.stat().st_mode & 0o777 == 0o600
    assert "  model: /var/cache/genie-supervisor/models/gemma-3-270m-q4_k_m.gguf" in config.read_text()
    assert (root / "etc/genie-supervisor/policy.yaml").read_text() == (REPO / "policies/orin-nano-8gb.yaml").read_text()
    unit = root / "etc/systemd/system/genie-supervisor.service"
    assert unit.read_text() == (REPO / "deploy/systemd/genie-supervisor.service").read_text()
    assert (root / "var/cache/genie-supervisor/models/gemma-3-270m-q4_k_m.gguf").exists()
    for d, mode in (
        ("var/lib/genie-supervisor", 0o750),
        ("var/cache/genie-supervisor/models", 0o750),
        ("opt/genie-supervisor", 0o755),
    ):
        assert (root / d).stat().st_mode & 0o777 == mode, d
    if os.geteuid() == 0:
        assert (config.stat().st_uid, config.stat().st_gid) == (999, 999)
    group = (root / "etc/group").read_text()
    assert "video:x:44:genie" in group and "render:x:109:ubuntu,genie" in group

    made = mutating(calls(tmp_path))
    assert any(c.startswith("useradd --root") and c.endswith(" genie") for c in made), made
    assert any(c.startswith("pip install --upgrade") and c.endswith("[jetson,cuda]") for c in made), made
    assert any(c.startswith("systemctl --root=") and c.endswith("enable genie-supervisor.service") for c in made)
    assert not any("daemon-reload" in c for c in made)  # no live systemd behind a fake root

    state = snapshot(root)
    second = setup(tmp_path, root)
    assert second.returncode == 0, second.stderr + second.stdout
    assert snapshot(root) == state
    again = mutating(calls(tmp_path))
    assert all(c.startswith("chown") for c in again) and (os.geteuid() == 0) <= (again == []), again
    assert "exists: kept (not overwritten)" in second.stdout
    assert "genie-supervisor.service is up to date" in second.stdout
    assert "nothing to change" in second.stdout


def test_existing_config_is_never_overwritten_but_its_mode_is_fixed(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    etc = root / "etc/genie-supervisor"
    etc.mkdir(parents=True)
    (etc / "supervisor.yaml").write_text("node_id: mine\n")
    (etc / "supervisor.yaml").chmod(0o644)
    result = setup(tmp_path, root, "--model", "smollm2")
    assert result.returncode == 0, result.stderr + result.stdout
    assert (etc / "supervisor.yaml").read_text() == "node_id: mine\n"
    assert (etc / "supervisor.yaml").stat().st_mode & 0o777 == 0o600
    assert (root / "var/cache/genie-supervisor/models/SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_changed_unit_is_replaced(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    assert setup(tmp_path, root).returncode == 0
    unit = root / "etc/systemd/system/genie-supervisor.service"
    unit.write_text("[Service]\nExecStart=/bin/false\n")
    result = setup(tmp_path, root)
    assert result.returncode == 0
    assert "update " in result.stdout
    assert unit.read_text() == (REPO / "deploy/systemd/genie-supervisor.service").read_text()


def test_not_a_jetson_is_refused_with_a_fix(tmp_path: Path) -> None:
    root = make_root(tmp_path, release=None)
    result = setup(tmp_path, root, "--dry-run")
    assert result.returncode == 1
    assert "nv_tegra_release not found: this is not a Jetson" in result.stderr
    assert "--any-platform" in result.stderr
    assert setup(tmp_path, root, "--dry-run", "--any-platform").returncode == 0


def test_wrong_jetpack_is_refused(tmp_path: Path) -> None:
    root = make_root(tmp_path, release="# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref\n")
    result = setup(tmp_path, root, "--dry-run")
    assert result.returncode == 1
    assert "wrong JetPack: " in result.stderr and "L4T R35.4.1" in result.stderr and "JetPack 6" in result.stderr


def test_no_cuda_is_refused_unless_cpu_only(tmp_path: Path) -> None:
    root = make_root(tmp_path, cuda=False)
    result = setup(tmp_path, root, "--dry-run")
    assert result.returncode == 1
    assert "no CUDA: " in result.stderr and "--cpu-only" in result.stderr
    result = setup(tmp_path, root, "--cpu-only")
    assert result.returncode == 0, result.stderr
    assert "runs on the native CPU kernels" in result.stdout
    config = (root / "etc/genie-supervisor/supervisor.yaml").read_text()
    assert "  backend: native" in config
    assert any(c.endswith("[jetson]") for c in calls(tmp_path) if c.startswith("pip"))


def test_voice_dropins_are_installed_on_request(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    assert setup(tmp_path, root, "--voice-dropins", "--model", "none").returncode == 0
    dropin = root / "etc/systemd/system/wyoming-faster-whisper.service.d/genie.conf"
    assert dropin.read_text() == (REPO / "deploy/systemd/wyoming-faster-whisper.service.d/genie.conf").read_text()
    assert "  model: null" in (root / "etc/genie-supervisor/supervisor.yaml").read_text()


def test_installed_config_loads(tmp_path: Path) -> None:
    """What the script writes is a valid daemon config."""
    from genie_supervisor.config import load_config

    root = make_root(tmp_path)
    assert setup(tmp_path, root, "--cpu-only").returncode == 0
    cfg = load_config(root / "etc/genie-supervisor/supervisor.yaml")
    assert cfg.engine.backend == "native" and cfg.engine.model is not None


def test_api_key_is_created_once_private_and_required_by_the_installed_config(tmp_path: Path) -> None:
    """A fresh install writes a random key (mode 0600, never printed) that the installed config loads; reruns keep it."""
    from genie_supervisor.config import load_config

    root = make_root(tmp_path)
    first = setup(tmp_path, root, "--cpu-only")
    assert first.returncode == 0, first.stderr + first.stdout
    key_file = root / "etc/genie-supervisor/api-key"
    key = key_file.read_text()
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key.endswith("\n") and len(key.strip()) >= 40 and key.strip() not in first.stdout + first.stderr
    if os.geteuid() == 0:
        assert (key_file.stat().st_uid, key_file.stat().st_gid) == (999, 999)
    cfg = load_config(root / "etc/genie-supervisor/supervisor.yaml")
    assert cfg.api.key() == key.strip()
    key_file.chmod(0o644)
    second = setup(tmp_path, root, "--cpu-only")
    assert second.returncode == 0 and key_file.read_text() == key
    assert key_file.stat().st_mode & 0o777 == 0o600 and "api-key exists: kept" in second.stdout

    other = make_root(tmp_path / "other")
    assert setup(tmp_path, other, "--cpu-only").returncode == 0
    assert (other / "etc/genie-supervisor/api-key").read_text() != key  # random, not a shipped constant


def test_kept_config_without_a_key_line_gets_a_note(tmp_path: Path) -> None:
    """An existing config is not edited to require the key; the script says how to turn it on."""
    root = make_root(tmp_path)
    etc = root / "etc/genie-supervisor"
    etc.mkdir(parents=True)
    (etc / "supervisor.yaml").write_text("node_id: mine\n")
    result = setup(tmp_path, root, "--model", "none")
    assert result.returncode == 0, result.stderr + result.stdout
    assert (etc / "supervisor.yaml").read_text() == "node_id: mine\n" and (etc / "api-key").exists()
    assert "has no api.api_key_file" in result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean() -> None:
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
