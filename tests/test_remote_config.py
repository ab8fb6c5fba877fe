"""The openai backend's config: each bad setting is one `file:line key: message` error, the key never shown."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from genie_supervisor.config import load_config
from genie_supervisor.errors import ConfigErrors

pytestmark = pytest.mark.timeout(30)

MODELS = """\
models:
  voice: {path: v.gguf, roles: [fast]}
  big: {backend: openai, fallback_model: fast}
"""


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("openai: {url: ftp://gpu:8000/v1}\n" + MODELS, 1, "openai.url: expected http(s)://HOST:PORT/v1, got 'ftp://gpu:8000/v1'"),
        ("openai: {url: 'http://u:hunter2@gpu:8000/v1'}\n" + MODELS, 1, "openai.url: put no credentials in the URL (it is logged and shown); a key goes in api_key or api_key_env"),
        ("openai: {url: 'http://gpu:99999/v1'}\n" + MODELS, 1, "openai.url: bad port in 'http://gpu:99999/v1'"),
        ("openai: {url: 'http://gpu/v1', api_key: k, api_key_env: K}\n" + MODELS, 1, "openai.api_key_env: give api_key or api_key_env, not both"),
        ("openai: {url: 'http://gpu/v1', api_key_env: GENIE_TEST_UNSET_KEY}\n" + MODELS, 1, "openai.api_key_env: the environment variable GENIE_TEST_UNSET_KEY is not set or empty"),
        ("openai: {url: 'http://gpu/v1', verify_tls: false, ca_file: /ca.pem}\n" + MODELS, 1, "openai.ca_file: ca_file is used to verify TLS: it takes verify_tls: true"),
        ("openai:\n  url: 'http://gpu/v1'\n  first_token_timeout_s: 0\n" + MODELS, 3, "openai.first_token_timeout_s: Input should be greater than 0 (got 0)"),
        (MODELS, 3, "models.big.backend: the openai backend needs openai.url (the remote's base URL)"),
        ("backend: openai\nengine: {model: m.gguf}\n", 1, "backend: the openai backend needs openai.url (the remote's base URL)"),
        ("openai: {url: 'http://gpu/v1'}\n" + MODELS.replace("fallback_model: fast", "fallback_model: nobody"), 4, "models.big.fallback_model: no model has the id or role 'nobody'"),
        ("openai: {url: 'http://gpu/v1'}\n" + MODELS.replace("path: v.gguf,", "backend: openai,"), 4, "models.big.fallback_model: the fallback 'fast' must be a local model"),
        ("openai: {url: 'http://gpu/v1'}\n" + MODELS + "  small: {path: s.gguf, remote_model: x}\n", 5, "models.small.remote_model: remote_model only applies to a model with backend openai"),
        ("openai: {url: 'http://gpu/v1'}\nmodels:\n  big: {backend: builtin}\n", 3, "models.big.path: a model needs a path (only an openai model or a llama_cpp model attached by llama_cpp.url may omit it)"),
    ],
)  # fmt: skip
def test_bad_openai_settings_are_reported_at_their_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    """Each bad openai setting is refused with the file, the line, the key path and what is expected."""
    path = tmp_path / "supervisor.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigErrors) as info:
        load_config(path)
    assert [i.format() for i in info.value.issues] == [f"{path}:{line} {message}"]
    assert "hunter2" not in str(info.value)


def test_remote_settings_load_with_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full openai setup loads: the key comes from the named variable, the model name defaults to the id."""
    monkeypatch.setenv("GENIE_TEST_REMOTE_KEY", "sk-test")
    path = tmp_path / "supervisor.yaml"
    text = """\
        openai: {url: 'https://gpu.lan:8000/v1', api_key_env: GENIE_TEST_REMOTE_KEY, health_interval_s: 2}
        models:
          voice: {path: v.gguf, roles: [fast], resident: true}
          big: {backend: openai, remote_model: qwen2.5-32b, fallback_model: fast}
          coder: {backend: openai}
        """
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    c = load_config(path)
    assert c.openai.key() == "sk-test" and "sk-test" not in repr(c.openai)
    assert (c.models["big"].remote_model, c.models["coder"].remote_model, c.models["big"].fallback_model) == (
        "qwen2.5-32b",
        None,
        "fast",
    )


def test_shipped_remote_example_loads() -> None:
    """deploy/config/remote-gpu.yaml loads: a local resident voice model and a remote brain with it as the fallback."""
    c = load_config(Path(__file__).resolve().parents[1] / "deploy/config/remote-gpu.yaml")
    remote = [m for m in c.models.values() if (m.backend or c.backend) == "openai"]
    assert remote and all(m.fallback_model == "voice" for m in remote) and c.models["voice"].resident
    assert c.openai.url == "http://127.0.0.1:8081/v1" and c.policy.path and Path(c.policy.path).is_file()
