"""Who a key belongs to: the tenants of ``PREFIXRAG_SERVICE__KEYS_FILE`` (or the single ``PREFIXRAG_API_KEY``).

A tenant reads only its collections (another one is a 404: it cannot learn that it exists), writes only if
allowed (403), and its prompts carry a ``cache_salt`` of its own, set here and never taken from a client: vLLM
then hashes its KV blocks apart from every other tenant's, so no tenant's cached context can be hit, or timed, by
another. The salt is derived from the keys file's content and the tenant's name: the same in every app process
that reads that file (replicas behind one router share a tenant's cache), new when the file changes."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.core.errors import Forbidden, NotFound


@dataclass(frozen=True)
class Tenant:
    name: str
    collections: frozenset[str] | None = None  # None: every collection
    write: bool = True
    cache_salt: str | None = None  # None: the shared prefix cache (no keys, or PREFIXRAG_API_KEY)

    def may_read(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections

    def reads(self, collection: str) -> None:
        """A collection this tenant may not read is not found, as one that does not exist."""
        if not self.may_read(collection):
            raise collection_not_found(collection)

    def writes(self, collection: str) -> None:
        self.reads(collection)
        if not self.write:
            raise Forbidden(f"this key may read collection {collection!r} but not change it")


def collection_not_found(collection: str) -> NotFound:
    return NotFound(f"collection {collection!r} not found", param="collection", code="collection_not_found")


EVERYONE = Tenant("default")  # no key set: the service is open, one shared cache


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    keys: list[str] = Field(min_length=1)
    collections: list[str] | None = None
    write: bool = False


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: list[_TenantEntry]


class Tenants:
    def __init__(self, api_key: str | None = None, keys_file: Path | None = None) -> None:
        """Fails at start-up (``ValueError``, naming the file) on a file that cannot be read or parsed, a key
        given twice, or a tenant named twice."""
        self.required = bool(api_key or keys_file)
        self._keys: list[tuple[bytes, Tenant]] = [(api_key.encode(), EVERYONE)] if api_key else []
        if keys_file is not None:
            self._keys += _read(keys_file)
        if len({key for key, _ in self._keys}) != len(self._keys):
            raise ValueError(f"{keys_file}: a key is given twice")

    def of(self, authorization: str) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header (None: no such key); anyone without keys."""
        if not self.required:
            return EVERYONE
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given, found = token.strip().encode(), None
        for key, tenant in self._keys:  # every key compared, in constant time each: no early exit to time
            if hmac.compare_digest(given, key):
                found = tenant
        return found


def _read(path: Path) -> list[tuple[bytes, Tenant]]:
    try:
        raw = path.read_bytes()
        parsed = _KeysFile.model_validate(json.loads(raw))
    except (OSError, ValueError, ValidationError) as exc:
        raise ValueError(f"keys file {path}: {str(exc).splitlines()[0]}") from None
    names = [entry.name for entry in parsed.tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"keys file {path}: a tenant is named twice")
    secret = hashlib.sha256(raw).digest()
    keys = []
    for entry in parsed.tenants:
        salt = hmac.new(secret, entry.name.encode(), hashlib.sha256).hexdigest()
        tenant = Tenant(entry.name, frozenset(entry.collections) if entry.collections is not None else None,
                        entry.write, salt)
        keys += [(key.encode(), tenant) for key in entry.keys]
    return keys
