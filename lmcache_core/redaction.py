"""Secrets of loaded configurations, kept out of everything lmcache-core writes or shows.

:func:`lmcache_core.config.load_config` registers the secret text of each configuration
it loads (values read from ``$env``, ``hash_salt``, backend options of kind ``secret``,
URL passwords); :func:`scrub` replaces them in documents written to disk (statistics
files) and :func:`scrub_text` in error messages. Structured places (``repr()`` and
``to_dict()`` of configuration objects) redact by field instead; this is the safety net
for free text such as an error message that quotes a path read from the environment.

Values that are only numbers, sizes or booleans (``"8GiB"``, ``"true"``) and texts shorter
than :data:`MIN_SECRET_LEN` are not registered: they hide nothing and would blank out
unrelated text.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "MIN_SECRET_LEN",
    "REDACTED",
    "redact_url",
    "register_secrets",
    "scrub",
    "scrub_text",
    "secret_forms",
    "url_password",
]

#: What a redacted secret is shown as.
REDACTED = "<redacted>"
#: Shorter texts are not registered (see the module docstring).
MIN_SECRET_LEN = 4
_MAX_SECRETS = 1024
_PLAIN_VALUE = re.compile(  # a number or size ("8GiB", "1.5e3", "512 MB"), or a boolean
    r"[+-]?[0-9][0-9_.]*(?:e[+-]?[0-9]+)?\s*(?:[kmgt]i?b?|b)?|true|false|yes|no|on|off|null|none",
    re.IGNORECASE,
)

_lock = threading.Lock()
_secrets: dict[str, None] = {}  # insertion-ordered set, bounded
_pattern: re.Pattern[str] | None = None


def secret_forms(value: str) -> list[str]:
    """The texts under which ``value`` may appear: itself, and as a path expanded."""
    forms = [value]
    if "/" in value or value.startswith("~"):
        try:
            expanded = os.path.expanduser(value)
            forms += [expanded, os.path.abspath(expanded)]
        except (ValueError, OSError):  # a NUL in the text, a vanished cwd
            pass
    return [f for f in dict.fromkeys(forms) if _worth_hiding(f)]


def _worth_hiding(text: str) -> bool:
    return len(text) >= MIN_SECRET_LEN and not _PLAIN_VALUE.fullmatch(text.strip())


def register_secrets(values: Iterable[str]) -> None:
    """Remember ``values`` (and their path forms) as secrets for :func:`scrub`."""
    global _pattern
    with _lock:
        added = False
        for value in values:
            for form in secret_forms(value):
                if form not in _secrets:
                    _secrets[form] = None
                    added = True
        while len(_secrets) > _MAX_SECRETS:
            del _secrets[next(iter(_secrets))]
        if added:
            _pattern = None


def _compiled() -> re.Pattern[str] | None:
    global _pattern
    with _lock:
        if _pattern is None and _secrets:
            # longest first, so a secret containing another is replaced whole
            alts = sorted(_secrets, key=len, reverse=True)
            _pattern = re.compile("|".join(re.escape(s) for s in alts))
        return _pattern


def scrub_text(text: str, extra: Iterable[str] = ()) -> str:
    """``text`` with every registered secret (and each of ``extra``) replaced by ``<redacted>``."""
    for value in sorted((f for v in extra for f in secret_forms(v)), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    pattern = _compiled()
    return pattern.sub(REDACTED, text) if pattern is not None else text


def scrub(doc: Any) -> Any:
    """A copy of a JSON-like ``doc`` with every registered secret replaced in its strings."""
    pattern = _compiled()
    if pattern is None:
        return doc
    return _scrub(doc, pattern)


def _scrub(doc: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(doc, str):
        return pattern.sub(REDACTED, doc)
    if isinstance(doc, dict):
        return {_scrub(k, pattern): _scrub(v, pattern) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_scrub(v, pattern) for v in doc]
    if doc is None or isinstance(doc, (bool, int, float)):
        return doc
    return pattern.sub(REDACTED, str(doc))  # what json.dumps(default=str) would write


def url_password(url: str) -> str | None:
    """The password in ``url``, if it has one (``None`` for text that is not a URL)."""
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``<redacted>`` (never raises)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url if "@" not in url else REDACTED
    if password is None:
        return url
    _, _, hostport = parts.netloc.rpartition("@")
    netloc = f"{parts.username or ''}:{REDACTED}@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
