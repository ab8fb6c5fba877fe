"""The device sampler's kernels (`sample_src`: `smp_adjust`, `smp_prep`, `smp_select`) run on the
host (tests/cuda_host.py) in the sequence `cupy_sample.sample_launches` gives, on one set of buffers
reused sample after sample as the device does, and pick the token the NumPy twin of the device
algorithm picks (`sample_twin.reference_sample`) for every parameter case, with a repetition
window, a logit bias and several blocks. Skipped without a C++20 compiler (failed under CI=true)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine.backends.cupy_sample import _fill, sample_launches
from engine.backends.sample_twin import flags_of, pass_schedule, recent_window, reference_sample, weight_scale
from engine.constrain import mask_words
from engine.kernels import sample_src as ks
from engine.sampler import SamplingParams
from tests.cuda_host import HostModule, cxx_or_skip
from tests.sampling_cases import PARAMS, random_history, random_row

pytestmark = pytest.mark.timeout(600)

HISTORY = 256


@pytest.fixture(scope="module")
def mod(tmp_path_factory: pytest.TempPathFactory) -> HostModule:
    """The sampling module, built once."""
    return HostModule(Path(tmp_path_factory.mktemp("smp")), ks.source(), cxx_or_skip("the sampling kernels"), "smp")


def buffers(vocab: int) -> SimpleNamespace:
    """`DeviceSampler`'s buffers as NumPy arrays, zeroed as it allocates them."""
    pbytes = ks.PD_N * 8 + ks.PI_N * 4
    b = SimpleNamespace(blocks=-(-vocab // ks.CHUNK), schedule=pass_schedule(vocab), vocab=vocab)
    b.params_dev = np.zeros(pbytes, np.uint8)
    b.pd = b.params_dev[: ks.PD_N * 8].view(np.float64)
    b.pi = b.params_dev[ks.PD_N * 8 :].view(np.int32)
    b.pd[ks.PD_SCALE] = weight_scale(vocab)
    b.pi[ks.PI_VOCAB] = vocab
    b.recent_dev = np.zeros(HISTORY, np.int32)
    b.xw, b.xa = np.zeros(vocab, np.float32), np.zeros(vocab, np.float32)
    b.state = np.zeros(ks.STATE_BYTES, np.uint8)
    b.bv, b.bi = np.zeros(b.blocks, np.float32), np.zeros(b.blocks, np.int32)
    b.ghist = np.zeros(1 << ks.BITS, np.uint64)
    b.counter, b.out = np.zeros(1, np.int32), np.zeros(1, np.int32)
    b.mask_dev = np.zeros(mask_words(vocab), np.int32)
    b.bias_ids_dev, b.bias_vals_dev = np.zeros(64, np.int32), np.zeros(64, np.float32)
    return b


def sample(mod: HostModule, b: SimpleNamespace, x: np.ndarray, p: SamplingParams, u: float, hist: list[int]) -> int:
    """What `DeviceSampler.sample` does, with the host kernels: parameters, window and bias into
    the buffers, then the launches; the token."""
    window = recent_window(p, hist)
    flags = flags_of(p, b.vocab, len(window))
    _fill(b.pd, b.pi, p, u, len(window), flags)
    b.recent_dev[: len(window)] = window
    for j, (token, value) in enumerate(p.logit_bias):
        b.bias_ids_dev[j], b.bias_vals_dev[j] = token, value
    names = ("smp_adjust", "smp_prep", "smp_select")
    for kernel, (grid, block, args) in sample_launches(names, b, x, int(b.pi[ks.PI_FLAGS])):
        conv: list[Any] = [int(a) if isinstance(a, np.integer) else a for a in args]
        mod.launch(kernel, grid[0], block[0], *conv)
    return int(b.out[0])


@pytest.mark.parametrize("vocab", [7, 1000, 20000])
def test_host_kernels_pick_the_twins_token(mod: HostModule, vocab: int) -> None:
    """Every parameter case (greedy, temperature, top-k, top-p, min-p, penalties, all together),
    two rows each and several draws, plus a logit bias: the kernels' token == the twin's."""
    rng = np.random.default_rng(vocab)
    b = buffers(vocab)
    cases = dict(PARAMS)
    cases["bias"] = SamplingParams(temperature=0.9, logit_bias=((1, 4.0), (vocab - 1, -100.0)))
    n = 0
    for name, p in sorted(cases.items()):
        for _ in range(2):
            x, hist = random_row(rng, vocab), random_history(rng, vocab)
            for u in rng.random(3):
                got = sample(mod, b, x, p, float(u), hist)
                assert got == reference_sample(x, p, float(u), hist), (vocab, name, float(u))
                n += 1
    assert n == len(cases) * 6
