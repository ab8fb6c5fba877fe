"""MQTT credentials and TLS against a real Mosquitto: a password_file broker takes the right user and
refuses a wrong one (reported, never fatal), a TLS broker with a CA made here (and one that requires a
client certificate), and a password given in the URL shown nowhere (status, logs, doctor, errors)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import structlog

from genie_supervisor.config import MqttConfig, load_config
from genie_supervisor.doctor.broker import check_broker, mqtt_ping
from genie_supervisor.errors import ConfigErrors
from genie_supervisor.mqtt import MqttBridge
from genie_supervisor.mqtt.bridge import BROKER_TIMEOUT_S
from genie_supervisor.status import format_status
from genie_supervisor.urls import redact_url
from tests.broker import Mosquitto, needs_broker
from tests.net import HOST
from tests.test_mqtt import (
    AVAIL,
    is_,
    mqtt_config,
    running_bridge,
    subscriber,
)

OPENSSL = shutil.which("openssl")
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or next(
    (p for p in ("/usr/bin/mosquitto_passwd", "/usr/local/bin/mosquitto_passwd") if Path(p).exists()), None
)
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed")
needs_passwd = pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd is not installed")

USER, PASSWORD = "genie", "s3:cr@t pw"  # ':' and '@' must survive the URL form percent-encoded
PASSWORD_IN_URL = "s3%3Acr%40t%20pw"


# -- brokers --------------------------------------------------------------------------------------
@asynccontextmanager
async def started(broker: Mosquitto) -> AsyncIterator[Mosquitto]:
    """Run `broker` for the block."""
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


def password_broker(tmp_path: Path) -> Mosquitto:
    """A Mosquitto that takes only USER / PASSWORD (password_file, no anonymous clients)."""
    assert MOSQUITTO_PASSWD is not None
    passwd = tmp_path / "passwd"
    subprocess.run(
        [MOSQUITTO_PASSWD, "-b", "-c", str(passwd), USER, PASSWORD], check=True, capture_output=True, timeout=10
    )
    return Mosquitto(tmp_path, anonymous=False, extra=(f"password_file {passwd}",))


def openssl(*args: str | Path) -> None:
    """Run one openssl command (bounded)."""
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=30)


def make_pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA (EC P-256)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        d / "ca.key",
        "-out",
        d / "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=genie test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    out = {"ca": d / "ca.crt"}
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *ec, "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr", "-subj", f"/CN=genie {name}")
        openssl(
            "x509",
            "-req",
            "-in",
            d / f"{name}.csr",
            "-CA",
            d / "ca.crt",
            "-CAkey",
            d / "ca.key",
            "-CAcreateserial",
            "-out",
            d / f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            d / f"{name}.ext",
        )
        out[name], out[f"{name}_key"] = d / f"{name}.crt", d / f"{name}.key"
    return out


def tls_broker(tmp_path: Path, pki: dict[str, Path], *, client_cert: bool = False) -> Mosquitto:
    """A Mosquitto speaking only TLS on its port, optionally requiring a client certificate from the CA."""
    extra = (
        f"cafile {pki['ca']}",
        f"certfile {pki['server']}",
        f"keyfile {pki['server_key']}",
        f"require_certificate {str(client_cert).lower()}",
    )
    return Mosquitto(tmp_path, extra=extra)


async def wait_refused(bridge: MqttBridge, within_s: float = 5) -> str:
    """The bridge's reason for not being connected, once it has one."""
    with anyio.fail_after(within_s):
        status = await bridge.wait_status(lambda s: s["last_error"] is not None)
    assert not bridge.connected
    return str(status["last_error"])


# -- username / password ------------------------------------------------------------------------
@needs_broker
@needs_passwd
@pytest.mark.timeout(30)
async def test_password_broker_takes_the_right_credentials_as_keys_or_in_the_url(tmp_path: Path) -> None:
    """mqtt.username / mqtt.password, and the same user percent-encoded in the URL, both get online."""
    async with (
        started(password_broker(tmp_path)) as broker,
        subscriber(broker.port, AVAIL, username=USER, password=PASSWORD) as (rec, _),
    ):
        async with running_bridge(mqtt_config(broker.url, username=USER, password=PASSWORD)) as (bridge, _s, _a):
            assert bridge.connected
            await rec.wait_for(AVAIL, is_("online"))
        url = f"mqtt://{USER}:{PASSWORD_IN_URL}@{HOST}:{broker.port}"
        async with running_bridge(mqtt_config(url)) as (bridge, _s, _a):
            assert bridge.connected and bridge.status()["broker"] == broker.url
        ok, why = await anyio.to_thread.run_sync(lambda: mqtt_ping(url, timeout_s=2.0))
        assert ok, why


@needs_broker
@needs_passwd
@pytest.mark.timeout(30)
async def test_password_broker_refuses_wrong_credentials_reported_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password is refused: the daemon starts anyway, keeps retrying, and says why; it is never logged."""
    caplog.set_level(logging.DEBUG)
    async with started(password_broker(tmp_path)) as broker:
        url = f"mqtt://{USER}:wrong-Pa55@{HOST}:{broker.port}"
        with structlog.testing.capture_logs() as logs:
            with anyio.fail_after(4):  # started after startup_wait_s although never online
                async with running_bridge(mqtt_config(url, startup_wait_s=0.5)) as (bridge, _s, _a):
                    why = await wait_refused(bridge)
                    assert "authori" in why.lower() or "password" in why.lower(), why
                    status = bridge.status()
                    assert status["connected"] is False and status["last_error"] == why and status["since"]
                    assert status["url"] == f"mqtt://***@{HOST}:{broker.port}"
        assert any(e["event"] == "mqtt_connect_failed" for e in logs)
        assert "wrong-Pa55" not in repr(logs) and "wrong-Pa55" not in caplog.text
        ok, why = await anyio.to_thread.run_sync(lambda: mqtt_ping(url, timeout_s=2.0))
        assert not ok and ("bad user name or password" in why or "not authorised" in why), why
        check = check_broker(url, (ok, why))
        assert check.status == "warn" and "wrong-Pa55" not in check.detail and "password_file" in (check.fix or "")


# -- TLS --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CA, server and client certificates made once for this module."""
    if OPENSSL is None:
        pytest.skip("the openssl command is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


@needs_broker
@needs_openssl
@pytest.mark.timeout(30)
async def test_tls_broker_with_a_generated_ca(tmp_path: Path, pki: dict[str, Path]) -> None:
    """mqtts:// (or tls: true) with ca_file gets online; without our CA the certificate is refused and reported."""
    async with started(tls_broker(tmp_path, pki)) as broker:
        port = broker.port
        for cfg in (
            mqtt_config(f"mqtts://{HOST}:{port}", ca_file=str(pki["ca"])),
            mqtt_config(f"mqtt://{HOST}:{port}", tls=True, ca_file=str(pki["ca"])),
        ):
            async with running_bridge(cfg) as (bridge, _s, _a):
                assert bridge.connected, bridge.last_error
        async with running_bridge(mqtt_config(f"mqtts://{HOST}:{port}", startup_wait_s=0.5)) as (bridge, _s, _a):
            assert "certificate" in (await wait_refused(bridge)).lower()
        ok, why = await anyio.to_thread.run_sync(lambda: mqtt_ping(f"mqtts://{HOST}:{port}", ca_file=str(pki["ca"])))
        assert ok, why


@needs_broker
@needs_openssl
@pytest.mark.timeout(45)
async def test_tls_broker_requiring_a_client_certificate(tmp_path: Path, pki: dict[str, Path]) -> None:
    """With require_certificate, cert_file + key_file get online; without them the broker refuses."""
    async with started(tls_broker(tmp_path, pki, client_cert=True)) as broker:
        url = f"mqtts://{HOST}:{broker.port}"
        files: dict[str, Any] = {
            "ca_file": str(pki["ca"]),
            "cert_file": str(pki["client"]),
            "key_file": str(pki["client_key"]),
        }
        async with running_bridge(mqtt_config(url, **files)) as (bridge, _s, _a):
            assert bridge.connected, bridge.last_error
        async with running_bridge(mqtt_config(url, ca_file=str(pki["ca"]), startup_wait_s=0.5)) as (bridge, _s, _a):
            # TLS 1.3: the broker's refusal comes after the handshake, so the client sees it when its
            # CONNACK wait runs out (BROKER_TIMEOUT_S)
            await wait_refused(bridge, within_s=BROKER_TIMEOUT_S + 5)
        ok, why = await anyio.to_thread.run_sync(lambda: mqtt_ping(url, **files))
        assert ok, why


def test_tls_files_without_tls_are_a_config_error() -> None:
    """ca_file / cert_file with a plain mqtt:// URL and no tls: true is refused, naming the key."""
    with pytest.raises(ValueError, match="ca_file is only used with TLS"):
        MqttConfig(url="mqtt://127.0.0.1", ca_file="/etc/ssl/ca.crt")
    with pytest.raises(ValueError, match="set cert_file too"):
        MqttConfig(url="mqtts://127.0.0.1", key_file="/etc/ssl/k.pem")
    assert MqttConfig(url="mqtt://127.0.0.1", tls=True, ca_file="/etc/ssl/ca.crt").ca_file


# -- secrets in output ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("mqtt://genie:hunter2@broker.lan:1883", "mqtt://***@broker.lan:1883"),
        ("mqtts://hunter2@10.0.0.2", "mqtts://***@10.0.0.2"),
        ("mqtt://a%40b:hunter2@@h:1", "mqtt://***@h:1"),
        ("mqtt://broker.lan:1883", "mqtt://broker.lan:1883"),
    ],
)
def test_urls_are_shown_without_credentials(url: str, shown: str) -> None:
    """redact_url drops user and password, keeping scheme, host and port."""
    assert redact_url(url) == shown


def test_url_password_is_shown_nowhere(tmp_path: Path) -> None:
    """Bridge status, a config error, the doctor's verdict and `genie-supervisor status` never show the password."""
    from genie_supervisor.state import StateStore
    from tests.test_mqtt import FakeApp

    url = "mqtt://genie:hunter2@127.0.0.1:1"
    bridge = MqttBridge(
        MqttConfig(url=url), "box", StateStore(), gate_metrics=dict, commands=FakeApp(StateStore()).commands()
    )
    assert "hunter2" not in repr(bridge.status()) and bridge.status()["broker"] == "mqtt://127.0.0.1:1"
    bad = tmp_path / "supervisor.yaml"
    bad.write_text("mqtt: {url: 'http://genie:hunter2@127.0.0.1:1'}\n")
    with pytest.raises(ConfigErrors) as err:
        load_config(bad)
    assert "hunter2" not in str(err.value) and "***@127.0.0.1" in str(err.value)
    check = check_broker(url, (False, "127.0.0.1:1: refused the connection: not authorised"))
    assert "hunter2" not in check.detail + (check.fix or "")
    old_daemon = {"mqtt": {"url": url, "enabled": True}}  # an older daemon still showed the URL
    text = format_status(old_daemon, "http://127.0.0.1:8080")
    assert "hunter2" not in text and "mqtt: mqtt://***@127.0.0.1:1 NOT CONNECTED" in text
