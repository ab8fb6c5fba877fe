"""HTTP health checks: whisper.cpp's ``/health``, Home Assistant's ``/api/``, anything with a URL.

2xx and 3xx are up. 401/403 are up too (the service answers; the token is wrong) with the status
in the reason. Anything else, a timeout or a refused connection is down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ProbeResult

if TYPE_CHECKING:  # httpx (about 30 ms, its CLI's click and pygments included) only with a probe
    import httpx


class HttpHealthProbe:
    """GET a URL with a deadline; up/down with the status code."""

    source = "http"

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self._client = client
        import httpx  # noqa: F401 - at start-up when a service has a URL to check (probe's import: a lookup)

        self.last_status: int | None = None
        """Status code of the last answer (None when there was none)."""

    async def probe(self) -> ProbeResult:
        """One request; never raises for an absent or failing service."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        import httpx

        try:
            if self._client is not None:
                response = await self._client.get(self.url, headers=headers, timeout=self.timeout_s)
            else:
                async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                    response = await client.get(self.url, headers=headers)
        except httpx.TimeoutException:
            self.last_status = None
            return ProbeResult(up=False, reason=f"no answer within {self.timeout_s}s")
        except httpx.HTTPError as exc:
            self.last_status = None
            return ProbeResult(up=False, reason=f"{type(exc).__name__}: {exc}")
        status = self.last_status = response.status_code
        if status < 400:
            return ProbeResult(up=True, reason=f"health {status}")
        if status in (401, 403):
            return ProbeResult(up=True, reason=f"health {status} (reachable, check the token)")
        return ProbeResult(up=False, reason=f"health {status}")
