"""API keys: generation, hashing at rest, the key file format, and who a request is (pure).

A key is ``sk-swarm-`` followed by 43 characters of URL-safe base64 (32 random
bytes, 256 bits). It is shown once, when it is made (``swarm-gateway keys
add``); the gateway stores only its SHA-256. A plain hash is enough here and a
slow one (scrypt, argon2) would buy nothing: slow hashes protect *low-entropy*
secrets (passwords) against guessing, and nobody can enumerate 2^256 keys; a
fast hash also keeps the check per request in microseconds.

Key file (``api_keys_file``; default ``<data_dir>/api-keys.jsonl``): one JSON
object per line, ``#`` lines and blank lines ignored::

    {"id": "key_3fa2c1d09bd1", "name": "alice", "sha256": "<64 hex>", "created": 1764580000,
     "max_sessions": 4, "tokens_per_minute": 20000, "max_tokens": 1024}

``id`` is ``key_`` plus the first 12 hex digits of the hash: safe to show in
logs and listings (it cannot be turned back into the key). The three limits
are optional; absent or 0 means no limit of that kind. Unknown fields are an
error (a typo must not silently drop a limit).

Authentication (:func:`authenticate`): with no key in the file every request
is anonymous (the bearer token, if any, only tells clients apart, as before
keys existed). With keys, a request must carry one of them
(``Authorization: Bearer <key>``, as the OpenAI client sends it): a wrong key
is 401 ``invalid_api_key``; no key at all is anonymous when ``allow_anonymous``
is on, else 401 ``missing_api_key``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from common.keyfile import KeyFileError
from gateway.errors import AuthenticationFailed

KEY_PREFIX = "sk-swarm-"
KEY_BYTES = 32
ID_PREFIX = "key_"
LIMIT_FIELDS = ("max_sessions", "tokens_per_minute", "max_tokens")
_FIELDS = {"id", "name", "sha256", "created", *LIMIT_FIELDS}
MAX_NAME_CHARS = 64


@dataclass(frozen=True)
class Limits:
    """Per-identity quotas; 0 = no limit of that kind."""

    max_sessions: int = 0  # requests running at once (queued ones count)
    tokens_per_minute: int = 0  # prompt + completion tokens, token bucket of one minute
    max_tokens: int = 0  # completion tokens per request (also the default when a request names none)


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    sha256: str
    created: int
    limits: Limits = Limits()

    def to_line(self) -> str:
        body: dict[str, object] = {"id": self.id, "name": self.name, "sha256": self.sha256}
        body["created"] = self.created
        body.update({k: v for k, v in asdict(self.limits).items() if v})
        return json.dumps(body, separators=(", ", ": "))


@dataclass(frozen=True)
class Principal:
    """Who a request is, for quotas: a key (``key_...``) or an anonymous client (``anon:<address>``)."""

    id: str
    anonymous: bool
    limits: Limits
    name: str = ""


def new_key() -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=").decode()


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id(digest: str) -> str:
    return ID_PREFIX + digest[:12]


def make_record(key: str, name: str, created: int, limits: Limits) -> KeyRecord:
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise KeyFileError(f"a key name is 1..{MAX_NAME_CHARS} printable characters, got {name!r}")
    for field_name, value in asdict(limits).items():
        if value < 0:
            raise KeyFileError(f"{field_name} must be >= 0, got {value}")
    digest = key_hash(key)
    return KeyRecord(key_id(digest), name, digest, created, limits)


def _int(obj: Mapping[str, object], name: str, where: str) -> int:
    value = obj.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeyFileError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    return value


def parse_key_file(text: str) -> list[KeyRecord]:
    """The records of a key file; :class:`KeyFileError` naming the line on anything malformed."""
    records: list[KeyRecord] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"line {number}"
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise KeyFileError(f"{where}: not JSON ({err})") from err
        if not isinstance(obj, dict):
            raise KeyFileError(f"{where}: expected a JSON object")
        unknown = set(obj) - _FIELDS
        if unknown:
            raise KeyFileError(f"{where}: unknown fields {sorted(unknown)}")
        digest = obj.get("sha256")
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise KeyFileError(f"{where}: sha256 must be 64 lowercase hex digits")
        name = obj.get("name", "")
        if not isinstance(name, str):
            raise KeyFileError(f"{where}: name must be a string")
        if digest in seen:
            raise KeyFileError(f"{where}: the same key twice")
        seen.add(digest)
        limits = Limits(*(_int(obj, f, where) for f in LIMIT_FIELDS))
        records.append(KeyRecord(key_id(digest), name, digest, _int(obj, "created", where), limits))
    return records


def format_key_file(records: Iterable[KeyRecord]) -> str:
    head = (
        "# swarm-gateway API keys: SHA-256 of each key, never the key (swarm-gateway keys add/list/revoke)\n"
    )
    return head + "".join(r.to_line() + "\n" for r in records)


def find(records: Iterable[KeyRecord], ref: str) -> list[KeyRecord]:
    """Records matching ``ref``: an id, a name, or an id prefix of at least 8 characters."""
    return [
        r
        for r in records
        if ref in (r.id, r.name) or (len(ref) >= len(ID_PREFIX) + 8 and r.id.startswith(ref))
    ]


@dataclass(frozen=True)
class AuthPolicy:
    allow_anonymous: bool = True
    anonymous: Limits = Limits()


class KeyTable:
    """The keys in force, by hash; :meth:`authenticate` maps a request's bearer token to a principal."""

    def __init__(self, records: Iterable[KeyRecord] = ()) -> None:
        self._by_hash = {r.sha256: r for r in records}

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, bearer: str | None, address: str, policy: AuthPolicy) -> Principal:
        """The principal of a request (``bearer``: the token after ``Bearer``, None when absent).

        Raises :class:`AuthenticationFailed` (401) for a wrong key, or no key when anonymous
        access is off. The comparison is on hashes (``hmac.compare_digest``), so its timing
        tells nothing about any key.
        """
        anonymous = Principal("anon:" + address, True, policy.anonymous)
        if not self._by_hash:
            return anonymous
        if not bearer:
            if policy.allow_anonymous:
                return anonymous
            raise AuthenticationFailed(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
            )
        digest = key_hash(bearer)
        record = self._by_hash.get(digest)
        if record is None or not hmac.compare_digest(record.sha256, digest):
            raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")
        return Principal(record.id, False, record.limits, record.name)
