"""The prompt cache on disk with the CuPy backend: a prefix restored into the KV buffers on the
device keeps their addresses (captured CUDA graphs stay valid) and gives the logits of the prefix
it was saved from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402

from engine import Model, SamplingParams, load_model  # noqa: E402
from engine.kv_file import kv_arrays  # noqa: E402
from engine.prompt_cache import ModelCache, PromptCache  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from tests.cupy_helpers import SHAPE  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _wipe(model: Model) -> None:
    def zero(kv: Any) -> None:
        for _, a in kv_arrays(kv):
            a[...] = 0
        kv.tokens.clear()

    model.with_kv(zero)


def _save_prefix(model: Model, directory: Path, ids: list[int]) -> tuple[PromptCache, ModelCache]:
    """Prefill `ids` from an empty KV cache and write them to a new prompt cache in `directory`."""
    store = PromptCache(directory, 1 << 30, 16)
    cache = store.attach(model)
    assert cache.wait_ready(60), cache.error
    model.with_kv(lambda kv_: kv_.tokens.clear())
    model.step_logits(ids, 0)
    assert cache.offer(ids)
    assert store.flush(60)
    return store, cache


async def _greedy(model: Model, ids: list[int], cache: ModelCache | None) -> tuple[list[int], int]:
    gen = model.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), prompt_cache=cache)
    return [t.id async for t in gen], gen.stats.disk_tokens


@pytest.mark.parametrize("kv", ["f16", "int8"])
def test_restore_into_cupy_kv_buffers_keeps_addresses_logits_and_graph_decode(tmp_path: Path, kv: str) -> None:
    """A prefix saved from one CuPy model and restored into a second one (a restart) lands in the
    second model's existing device buffers (same pointers), gives bit-identical logits for the rest
    of the prompt, and greedy decode (replayed CUDA graphs captured before the restore) gives the
    tokens of the in-memory prefix."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", head_dim=128, **SHAPE)
    first = load_model(path, backend="cupy", n_ctx=512, kv_dtype=kv)
    second = load_model(path, backend="cupy", n_ctx=512, kv_dtype=kv)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, SHAPE["n_vocab"], 120)]
    _save_prefix(first, tmp_path / "pc", ids[:96])
    reference = first.step_logits(ids[96:], 96)
    first.with_kv(lambda kv_: kv_.tokens.__delitem__(slice(96, None)))
    expected, _ = anyio.run(_greedy, first, ids, None)  # from the in-memory prefix, the same chunks

    restored = PromptCache(tmp_path / "pc", 1 << 30, 16).attach(second)
    assert restored.wait_ready(60), restored.error
    anyio.run(_greedy, second, ids[:40], None)  # decode graphs captured before the restore
    pointers = [a.data.ptr for _, a in kv_arrays(second.transformer.kv)]
    _wipe(second)
    assert restored.restore(ids, 0) == (96, 96)
    assert [a.data.ptr for _, a in kv_arrays(second.transformer.kv)] == pointers
    assert np.array_equal(second.step_logits(ids[96:], 96), reference)
    _wipe(second)
    tokens, disk = anyio.run(_greedy, second, ids, restored)
    assert (tokens, disk) == (expected, 96)


@pytest.mark.parametrize("kv", ["f16", "int8"])
def test_a_gpu_file_carries_device_checksums_and_a_flipped_byte_is_rejected(tmp_path: Path, kv: str) -> None:
    """A file written from a CuPy cache lists each array's device checksum, equal to the NumPy
    twin's over the file's bytes; restored, the arrays are checked by it (no CRC): a flipped data
    byte is refused as "checksum", the file deleted, and no token of the cache is trusted."""
    from engine import kv_file

    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", head_dim=128, **SHAPE)
    model = load_model(path, backend="cupy", n_ctx=512, kv_dtype=kv)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, SHAPE["n_vocab"], 100)]
    store, cache = _save_prefix(model, tmp_path / "pc", ids[:80])
    (entry,) = cache.entries
    assert cache.key is not None
    header = kv_file.read_header(entry.path, cache.key, kv_file.kv_arrays(model.transformer.kv), SHAPE["n_vocab"])
    data = np.fromfile(entry.path, dtype=np.uint8)[header.data_start :]
    for spec in header.arrays:
        rows = data[spec.offset : spec.offset + spec.nbytes]
        assert spec.dsum is not None and spec.dsum == kv_file.host_sum(rows), spec.name
    _wipe(model)
    assert cache.restore(ids, 0) == (80, 80)

    raw = bytearray(entry.path.read_bytes())
    raw[header.data_start + header.arrays[-1].offset + 7] ^= 0x10  # one byte of the last array
    entry.path.write_bytes(bytes(raw))
    _wipe(model)
    assert cache.restore(ids, 0) == (0, 0)
    assert not entry.path.exists()
    assert store.stats().reject_reasons == {"checksum": 1}
    assert model.with_kv(lambda kv_: list(kv_.tokens)) == []
