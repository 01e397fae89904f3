"""What is stored instead of secrets and oversized bodies. Applied to every payload before it is
encoded, hashed and written, so neither the database file nor the chain ever contains them.

1. Redaction: the value of any object key equal to ``authorization`` (any case) becomes
   ``"<redacted>"``; every occurrence of a configured secret string inside any string, object
   keys included, is replaced by ``"<redacted>"``, and so is the password of every URL written
   with one (``scheme://user:PASSWORD@host``: ``mask_url_passwords``) — a server URL in the
   config may carry one, and it would reach the ledger in every call's ``url``.
2. Body capping: the value under any key named ``body`` whose canonical encoding is longer than
   ``BODY_CAP_BYTES`` becomes ``{"sha256": <hex of those bytes>, "bytes": <their length>,
   "prefix": <the first 1024 characters of that canonical text>}``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Final

from quiesce.ledger.canonical import canonical_text, canonical_text_of_plain

REDACTED: Final = "<redacted>"
#: ``scheme://user:`` then the password, up to the ``@`` of the userinfo (RFC 3986: no ``/``,
#: ``?``, ``#`` or ``@`` inside it; whitespace ends a URL inside a message).
_URL_PASSWORD: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/?#@\s:]*:)[^/?#@\s]+@")


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:PASSWORD@``) replaced by
    ``<redacted>``; for stored payloads and for messages alike."""
    if "@" not in text or "://" not in text:
        return text
    return _URL_PASSWORD.sub(_masked, text)


def _masked(match: re.Match[str]) -> str:
    # `***` is how a database URL shows with its password already hidden (``urls.safe``): kept
    whole = match.group(0)
    return whole if whole.endswith(":***@") else f"{match.group(1)}{REDACTED}@"


BODY_CAP_BYTES: Final = 64 * 1024
PREFIX_CHARS: Final = 1024


class Redactor:
    """Applies the redaction and capping rules for one set of secrets. Pure: inputs are not mutated."""

    __slots__ = ("_plain_secrets", "_secrets")

    def __init__(self, secrets: Sequence[str] = ()) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._secrets: tuple[str, ...] = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))
        self._plain_secrets = all(canonical_text(s)[1:-1] == s for s in self._secrets)

    def text(self, value: str) -> str:
        """``value`` with every configured secret and every URL password replaced."""
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return mask_url_passwords(value)

    def columns(
        self, checkpoint_id: str | None, server: str | None, call_id: str | None
    ) -> tuple[str | None, str | None, str | None]:
        """The three text columns with every configured secret replaced (None stays None)."""
        for secret in self._secrets:
            if (
                (checkpoint_id is not None and secret in checkpoint_id)
                or (server is not None and secret in server)
                or (call_id is not None and secret in call_id)
            ):
                text = self.text
                return (
                    None if checkpoint_id is None else text(checkpoint_id),
                    None if server is None else text(server),
                    None if call_id is None else text(call_id),
                )
        return checkpoint_id, server, call_id

    def redact(self, value: Any) -> Any:
        """A copy of ``value`` with authorization values and secret strings replaced."""
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            for key, item in value.items():
                if isinstance(key, str):
                    if key.lower() == "authorization":
                        out[self.text(key)] = REDACTED
                        continue
                    key = self.text(key)
                out[key] = self.redact(item)
            return out
        if isinstance(value, list | tuple):
            return [self.redact(item) for item in value]
        if isinstance(value, str):
            return self.text(value)
        return value

    def apply(self, value: Any) -> Any:
        """Redaction, then body capping: what gets stored for payload ``value``."""
        return cap_bodies(self.redact(value))

    def encode(self, value: Any, *, plain: bool = False) -> tuple[Any, str]:
        """``(stored, canonical_text(stored))`` with ``stored = self.apply(value)``. ``plain``: the
        value is one ``canonical_text_of_plain`` may encode (so is what redaction and capping make
        of it: they only replace strings and bodies with strings and plain objects).

        Fast path: when the canonical text of ``value`` shows nothing to redact (no configured
        secret in it, no ``authorization`` in any case, no URL password), redaction would return
        ``value`` unchanged, so only the body cap applies: a text within the cap as a whole is
        stored as it is, and a longer one is only capped (its text encoded again only when a body
        was). Secrets whose JSON encoding differs from their text (quotes, backslashes, control
        characters) always take the full walk.
        """
        encode = canonical_text_of_plain if plain else canonical_text
        text = encode(value)
        if self._plain_secrets and _no_authorization(text) and mask_url_passwords(text) is text:
            for secret in self._secrets:
                if secret in text:
                    break
            else:
                if len(text) * 4 <= BODY_CAP_BYTES or len(text.encode("utf-8")) <= BODY_CAP_BYTES:
                    return value, text  # no body can exceed the cap: each is a part of this text
                stored = cap_bodies(value)
                return (value, text) if stored is value else (stored, encode(stored))
        stored = self.apply(value)
        return stored, encode(stored)


def _no_authorization(text: str) -> bool:
    """Whether ``"authorization" not in text.lower()``. Only ``z`` and ``Z`` lower to a ``z`` (of
    every code point), so a text with neither needs no lowered copy: most payloads, whose texts
    run to tens of kilobytes (a commit reply), are checked at the cost of two scans for one character."""
    return ("z" not in text and "Z" not in text) or "authorization" not in text.lower()


def cap_body(body: Any) -> Any:
    """``body`` itself, or its digest form when its canonical encoding exceeds the cap."""
    if body is None or isinstance(body, bool | int | float):
        return body
    text = canonical_text(body)
    if len(text) * 4 <= BODY_CAP_BYTES:  # cannot exceed the cap even if every char is 4 bytes
        return body
    raw = text.encode("utf-8")
    if len(raw) <= BODY_CAP_BYTES:
        return body
    return {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw), "prefix": text[:PREFIX_CHARS]}


def cap_bodies(value: Any) -> Any:
    """``value`` with every value under a ``body`` key capped (see ``cap_body``). Never mutates:
    a container holding a capped body is copied; one holding none is returned as it is."""
    if isinstance(value, dict):
        out = {k: (cap_body(v) if k == "body" else cap_bodies(v)) for k, v in value.items()}
        return value if all(out[k] is v for k, v in value.items()) else out
    if isinstance(value, list):
        items = [cap_bodies(item) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value
