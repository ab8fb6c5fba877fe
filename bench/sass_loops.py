"""Static: the decode module's machine code per kernel, this checkout against another, no GPU needed.

For a session without a device. Each synth preset's decode module (`engine.kernels.decode_src`,
built as `tests/test_cuda_sources.py` builds it) is compiled with NVRTC (the `dev` extra's
`nvidia-cuda-nvrtc-cu12`) for each architecture and disassembled with `nvdisasm`
(`pip install nvidia-cuda-nvdisasm`, or a CUDA toolkit's). Per kernel it reports the registers and
spill bytes (the cubin's `.nv.info`), the instructions, and its *hot loop*: the innermost loop (a
backward branch) with integer dot products (`IDP`) in it, or else with a global load - its
instructions, `IDP` and loads. `--against DIR` builds the same modules from another checkout (its
`engine` imported in a child process) and prints this / that for every figure. Counts are not
time: a GEMV whose body issues fewer instructions at the same registers is likely faster, and
only `bench.decode_ab` on a GPU says by how much.

    python -m bench.sass_loops --against /tmp/prev --preset qwen3-4b-q4_k_m --kernels qgemv
    python -m bench.sass_loops --against . --set qgemv_min_blocks=4 --kernels qgemv
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

SOURCES = r"""
import inspect, json, sys
from engine.kernels import decode_src
from engine.spec import ARCHITECTURES
from engine.synth import preset_config
out = {}
for name in sys.argv[1].split(","):
    c = preset_config(name)
    hd = c.head_dim or c.n_embd // c.n_heads
    for n_sm in map(int, sys.argv[2].split(",")):
        # decode_src.attn_split; a checkout from before it had the same rule inline
        split = getattr(decode_src, "attn_split", lambda s, k: max(1, min(64, -(-2 * s // k))))
        n_split = split(n_sm, c.n_kv_heads)
        extra = {"attn_cluster": 8} if n_sm == 132 and "attn_cluster" in inspect.signature(decode_src.source).parameters else {}
        extra.update(json.loads(sys.argv[3]))
        out[f"{name}@{n_sm}"] = decode_src.source(
            sorted({c.weight_type, *c.type_overrides.values()}), n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
            head_dim=hd, v_head_dim=hd, rope_half=hd // 2, neox=ARCHITECTURES[c.arch].rope_style == "neox",
            kv_half=True, n_split=n_split, **extra)
json.dump(out, sys.stdout)
"""
"""Printed by a child whose `engine` is the checkout's: the f16-KV decode module of each preset for
each multiprocessor count, as `CupyDecoder` builds it by default (attention in clusters of 8 on
sm_90 where the checkout has them)."""
SMS = {"sm_90": 132, "sm_87": 16}
"""Multiprocessors that set the attention split of each architecture's module (H100/H200; AGX Orin)."""


def sources(
    checkout: Path, presets: list[str], archs: list[str], settings: dict[str, Any] | None = None
) -> dict[str, str]:
    """The decode modules of `checkout`'s engine, by `preset@sm_count`; `settings` are more keyword
    arguments of its `decode_src.source` (e.g. `qgemv_min_blocks`)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    sms = ",".join(str(SMS[a]) for a in archs)
    r = subprocess.run(
        [sys.executable, "-c", SOURCES, ",".join(presets), sms, json.dumps(settings or {})],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        raise SystemExit(f"building the sources of {checkout} failed:\n{r.stderr[-3000:]}")
    return dict(json.loads(r.stdout))


def nvrtc_libraries() -> Iterator[str]:
    """Where libnvrtc may be: the nvidia-cuda-nvrtc-cu12 wheel, then the loader's search path
    (also what tests/test_cuda_sources.py tries)."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        yield from sorted(str(p) for p in (Path(folder) / "lib").glob("libnvrtc.so*") if "alt" not in p.name)
    yield from ("libnvrtc.so.12", "libnvrtc.so")


def nvrtc() -> ctypes.CDLL:
    """The first libnvrtc of `nvrtc_libraries` that loads."""
    for name in nvrtc_libraries():
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no libnvrtc: pip install nvidia-cuda-nvrtc-cu12")


def cubin(lib: ctypes.CDLL, src: str, arch: str) -> bytes:
    """`src` compiled for `arch` with the backend's options."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"genie.cu", 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    try:
        opts = [b"--std=c++17", f"--gpu-architecture={arch}".encode()]
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise SystemExit(log.value.decode(errors="replace")[-3000:])
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvdisasm() -> str:
    """The nvdisasm binary: on PATH, or in the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for d in (spec.submodule_search_locations or []) if spec else []:
        for p in sorted(glob.glob(f"{d}/*/bin/nvdisasm")):
            return p
    raise SystemExit("no nvdisasm: pip install nvidia-cuda-nvdisasm (or put a CUDA toolkit's on PATH)")


def registers(b: bytes) -> dict[str, dict[str, int]]:
    """Per kernel of a cubin: `regs` (EIATTR_REGCOUNT) and `spill` (EIATTR_FRAME_SIZE, bytes of
    local memory a thread), from the ELF's `.nv.info` section."""
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    so = hdrs[shstrndx][4]
    secs = {b[so + h[0] : b.index(b"\0", so + h[0])].decode(): h for h in hdrs}
    sym, st = secs[".symtab"], secs[".strtab"]
    names = []
    for i in range(sym[5] // 24):
        nm = struct.unpack_from("<I", b, sym[4] + 24 * i)[0]
        names.append(b[st[4] + nm : b.index(b"\0", st[4] + nm)].decode())
    info = secs[".nv.info"]
    p, end, out = info[4], info[4] + info[5], {}  # type: ignore[var-annotated]
    while p < end:
        fmt, attr = b[p], b[p + 1]
        p += 2
        if fmt == 4:  # EIFMT_SVAL: a 2-byte size, then the value
            size = struct.unpack_from("<H", b, p)[0]
            p += 2
            if attr in (0x2F, 0x11):  # REGCOUNT, FRAME_SIZE: (symbol index, value)
                si, v = struct.unpack_from("<II", b, p)
                out.setdefault(names[si], {})["regs" if attr == 0x2F else "spill"] = v
            p += size
        elif fmt == 3:  # EIFMT_HVAL
            p += 2
        elif fmt == 2:  # EIFMT_BVAL
            p += 1
    return out


INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
FUNC = re.compile(r"^\s+\.type\s+(\S+),@function")


def disassemble(tool: str, b: bytes) -> dict[str, list[tuple[int, str]]]:
    """Per kernel: its (address, instruction) list, branch targets rewritten as addresses."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(b)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=300).stdout
    out: dict[str, list[tuple[int, str]]] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    cur = None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSN.match(line)
        if m and cur:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[f"{cur}:{lab}"] = addr
            pending = []
            out[cur].append((addr, m.group(2)))

    def target(name: str) -> Any:
        return lambda m: hex(labels.get(f"{name}:{m.group(1)}", -1))

    for name, ins in out.items():
        out[name] = [(a, re.sub(r"`\((\.L_x_\d+)\)", target(name), t)) for a, t in ins]
    return out


def hot_loop(ins: list[tuple[int, str]]) -> dict[str, int]:
    """The innermost loop doing the kernel's work: the shortest loop (a backward branch) with an
    `IDP` in it, else the shortest with a global load and at least 16 instructions; its
    instructions, `IDP` and global loads (zeros where there is none)."""
    loops = []
    for a, t in ins:
        m = re.search(r"BRA (?:!?U?P\d, )?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) <= a:
            loops.append([x for b, x in ins if int(m.group(1), 16) <= b <= a])
    dots = [b for b in loops if any("IDP" in x for x in b)]
    work = dots or [b for b in loops if len(b) >= 16 and any("LDG" in x for x in b)]
    if not work:
        return {"loop": 0, "loop_idp": 0, "loop_ldg": 0}
    body = min(work, key=len)
    return {"loop": len(body), "loop_idp": sum("IDP" in x for x in body), "loop_ldg": sum("LDG" in x for x in body)}


def profile(srcs: dict[str, str], archs: list[str], kernels: str) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """(`preset@arch/kernel` -> registers, spill bytes, instructions, hot loop; `preset@arch` -> the
    SHA-256 of the whole module's cubin)."""
    lib, tool, out, modules = nvrtc(), nvdisasm(), {}, {}
    for arch in archs:
        for key, src in sorted(srcs.items()):
            preset, sm = key.split("@")
            if int(sm) != SMS[arch]:
                continue
            b = cubin(lib, src, arch)
            modules[f"{preset}@{arch}"] = hashlib.sha256(b).hexdigest()
            regs = registers(b)
            for name, ins in sorted(disassemble(tool, b).items()):
                if not name.startswith(tuple(kernels.split(","))):
                    continue
                out[f"{preset}@{arch}/{name}"] = {
                    "regs": regs.get(name, {}).get("regs", 0),
                    "spill": regs.get(name, {}).get("spill", 0),
                    "instructions": len(ins),
                    **hot_loop(ins),
                }
    return out, modules


def work(fig: dict[str, int]) -> float:
    """A hot loop's instructions per `IDP` where it has any, else its instructions."""
    return fig["loop"] / fig["loop_idp"] if fig["loop_idp"] else float(fig["loop"])


def table(this: dict[str, dict[str, int]], ref: dict[str, dict[str, int]] | None) -> str:
    """A markdown table: each kernel's figures (reference -> this where given, and the ratio of the
    hot loop's instructions per `IDP`, or of its length without `IDP`)."""
    cols = ("regs", "spill", "instructions", "loop", "loop_idp", "loop_ldg")
    head = "| kernel | " + " | ".join(cols) + (" | loop ratio (per IDP) |" if ref is not None else " |")
    lines = [head, "|---" * (len(cols) + 1 + (ref is not None)) + "|"]
    for k, v in this.items():
        if ref is not None and k in ref:
            r = ref[k]
            cells = [f"{v[c]}" if v[c] == r[c] else f"{r[c]} -> {v[c]}" for c in cols]
            ratio = f"{work(v) / work(r):.3f}x" if work(r) else "-"
            lines.append(f"| {k} | " + " | ".join(cells) + f" | {ratio} |")
        else:
            lines.append(f"| {k} | " + " | ".join(str(v[c]) for c in cols) + (" | new |" if ref is not None else " |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="synth preset (repeatable; default the 4B and SmolLM2 shapes)")
    ap.add_argument("--arch", default="sm_90,sm_87", help="comma-separated: sm_90 (H100/H200), sm_87 (Orin)")
    ap.add_argument("--kernels", default="qgemv,qprep,attn", help="comma-separated kernel name prefixes")
    ap.add_argument("--against", type=Path, help="another checkout whose engine is the reference")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword of decode_src.source for this checkout's modules only, an integer or a "
        "comma-separated list (e.g. qgemv_min_blocks=4, attn_cluster=4; with --against . it compares a "
        "setting with the default)",
    )
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    presets = a.preset or ["qwen3-4b-q4_k_m", "smollm2-135m-q4_1"]
    archs = a.arch.split(",")
    settings: dict[str, Any] = {
        k: int(v) if v.lstrip("-").isdigit() else v.split(",") for k, v in (x.split("=", 1) for x in a.set)
    }
    this, mods = profile(sources(ROOT, presets, archs, settings), archs, a.kernels)
    ref, ref_mods = profile(sources(a.against.resolve(), presets, archs), archs, a.kernels) if a.against else (None, {})
    print(table(this, ref))
    for key, digest in mods.items():
        same = {None: "", True: ": the same bytes as the reference's", False: ": differs from the reference's"}
        print(f"module {key}: cubin sha256 {digest[:16]}{same[ref_mods[key] == digest if key in ref_mods else None]}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "this": this,
            "reference": ref,
            "modules": mods,
            "reference_modules": ref_mods,
            "against": str(a.against),
        }
        a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
