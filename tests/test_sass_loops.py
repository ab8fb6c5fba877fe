"""`bench.sass_loops` reads the decode kernels' machine code without a GPU: the hot loop of an
instruction list, and a real module's registers and dot-product loop against itself. The module
test is skipped without NVRTC or nvdisasm (the `dev` extra installs both; failed under CI=true)."""

from __future__ import annotations

import shutil

import pytest

from bench import sass_loops
from tests.models import missing

pytestmark = pytest.mark.timeout(300)


def test_hot_loop_is_the_innermost_with_dot_products() -> None:
    """The shortest loop holding an IDP is the hot one, even inside a longer loop with more."""
    ins = [
        (0x00, "S2R R0, SR_TID.X"),
        (0x10, "LDG.E R1, desc[UR4][R2.64]"),  # outer loop head
        (0x20, "IDP.4A.S8.S8 R3, R1, R1, RZ"),
        (0x30, "LDG.E.128 R4, desc[UR4][R6.64]"),  # inner loop head
        (0x40, "IDP.4A.S8.S8 R3, R4, R5, R3"),
        (0x50, "IDP.4A.S8.S8 R3, R6, R7, R3"),
        (0x60, "@!P0 BRA 0x30"),
        (0x70, "IDP.4A.S8.S8 R3, R4, R5, R3"),
        (0x80, "@P1 BRA 0x10"),
        (0x90, "EXIT"),
    ]
    assert sass_loops.hot_loop(ins) == {"loop": 4, "loop_idp": 2, "loop_ldg": 1}


def test_no_loop_gives_zeros() -> None:
    """A kernel without a backward branch has no hot loop."""
    assert sass_loops.hot_loop([(0, "LDG.E R1, desc[UR4][R2.64]"), (0x10, "@P0 BRA 0x20"), (0x20, "EXIT")]) == {
        "loop": 0,
        "loop_idp": 0,
        "loop_ldg": 0,
    }


def test_a_module_against_itself() -> None:
    """SmolLM2's decode module on sm_87: its Q4_1 GEMV has registers, no spills and a loop of 16
    dot products, and this checkout against itself gives the same figures (ratio 1.000x)."""
    try:
        sass_loops.nvrtc()
        sass_loops.nvdisasm()
    except SystemExit as e:
        missing(str(e))
    assert shutil.which(sass_loops.nvdisasm())
    srcs = sass_loops.sources(sass_loops.ROOT, ["smollm2-135m-q4_1"], ["sm_87"])
    got, modules = sass_loops.profile(srcs, ["sm_87"], "qgemv_Q4_1")
    assert list(modules) == ["smollm2-135m-q4_1@sm_87"] and len(modules["smollm2-135m-q4_1@sm_87"]) == 64
    fig = got["smollm2-135m-q4_1@sm_87/qgemv_Q4_1"]
    assert 16 <= fig["regs"] <= 255 and fig["spill"] == 0
    assert fig["loop_idp"] == 16 and fig["loop"] > fig["loop_idp"]
    text = sass_loops.table(got, got)
    assert "| smollm2-135m-q4_1@sm_87/qgemv_Q4_1 |" in text and "1.000x" in text
