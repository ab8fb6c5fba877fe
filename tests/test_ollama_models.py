"""Ollama names, keep_alive and /api/ps over several configured models (tiny synthetic ones)."""

from __future__ import annotations

from pathlib import Path

import anyio
import ollama
import pytest

from genie_supervisor.api.ollama_schemas import keep_alive_seconds
from genie_supervisor.errors import BadRequest
from tests.apitools import http, make_api_supervisor, synth
from tests.daemon import wait_for

pytestmark = pytest.mark.timeout(90)

HI = [{"role": "user", "content": "hi"}]
TINY = {"temperature": 0, "num_predict": 2}


def _config(tmp_path: Path) -> str:
    voice, brain, spare = synth(tmp_path, "voice"), synth(tmp_path, "brain-a", "mid", 1), synth(tmp_path, "spare")
    return f"""\
models:
  voice: {{path: {voice}, roles: [fast], resident: true}}
  brain-a: {{path: {brain}, roles: [brain]}}
  spare: {{path: {spare}, ttl_s: 600}}
api: {{warmup: false}}
"""


async def test_ids_and_roles_are_names_and_keep_alive_zero_unloads_after_the_answer(tmp_path: Path) -> None:
    """Each id and role is listed as name:latest; keep_alive 0 unloads a non-resident model after its answer,
    never a resident one; ps shows the loaded ones with when they expire."""
    sup = make_api_supervisor(tmp_path, _config(tmp_path))
    with anyio.fail_after(80):
        async with sup, http(sup) as client, ollama.AsyncClient(host=str(client.base_url), timeout=30) as oc:
            models = sup.models.models
            listed = [m.model for m in (await oc.list()).models]
            assert listed == ["voice:latest", "fast:latest", "brain-a:latest", "brain:latest", "spare:latest"]
            assert [m.model for m in (await oc.ps()).models] == ["voice:latest"]

            answer = await oc.chat(model="BRAIN", messages=HI, options=TINY, keep_alive=0)
            assert answer.done and answer.model == "BRAIN:latest"
            await wait_for(sup, lambda: models["brain-a"].state == "unloaded")

            await oc.chat(model="fast:latest", messages=HI, options=TINY, keep_alive=0)
            assert models["voice"].state == "ready"  # resident: kept
            kept = await oc.chat(model="voice", messages=[], keep_alive=0)
            assert kept.done_reason == "load" and models["voice"].state == "ready"

            loaded = await oc.generate(model="spare", prompt="", keep_alive="10m")
            assert loaded.done_reason == "load" and models["spare"].state == "ready"
            running = {m.model: m for m in (await oc.ps()).models}
            assert set(running) == {"voice:latest", "spare:latest"}
            expires = running["spare:latest"].expires_at
            assert expires is not None and expires.year < 2300  # ttl_s: it unloads when idle
            gone = await oc.generate(model="spare", prompt="", keep_alive=0)
            assert gone.done_reason == "unload" and models["spare"].state == "unloaded"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (-1, -1.0), (0, 0.0), ("0", 0.0), ("300s", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("-1m", -60.0)],
)
def test_keep_alive_reads_go_durations_and_seconds(value: str | float | None, seconds: float | None) -> None:
    """keep_alive takes a Go duration string or a number of seconds (negative: forever)."""
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", "m", "", "1h-5m"])
def test_keep_alive_refuses_what_is_no_duration(value: str) -> None:
    """A keep_alive that is no duration is a 400 naming keep_alive."""
    with pytest.raises(BadRequest, match="keep_alive"):
        keep_alive_seconds(value)
