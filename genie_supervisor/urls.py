"""URLs as they may be shown: user name and password (``mqtt://user:pass@host``) never leave the process."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
"""What stands in for the user information of a URL."""


def redact_url(url: str | None) -> str | None:
    """`url` with any ``user:password@`` replaced by ``***@``; None stays None.

    Text that does not parse as a URL is returned with everything up to the last ``@`` replaced,
    so a malformed URL holding a password is not shown either.
    """
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, f"{REDACTED}@{host}", parts.path, parts.query, parts.fragment))
    except ValueError:
        return REDACTED + "@" + url.rpartition("@")[2] if "@" in url else url
