"""`pdserve serve`'s access keys: each route kind's keys from its flags, key file and environment
variable, checked; and a loud warning when the API listens beyond the loopback without one. No torch."""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError
from pdserve.router.auth import AccessKeys

logger = logging.getLogger("pdserve.serve")


KEY_ENV = {"api": "PDSERVE_API_KEY", "admin": "PDSERVE_ADMIN_KEY", "metrics": "PDSERVE_METRICS_KEY"}
_SHORT_KEY = 16  # characters; shorter keys are accepted with a warning


def access_keys(o: dict[str, Any], environ: Mapping[str, str] = os.environ) -> AccessKeys:
    """Each route kind's keys: its flags, then its key file, then its environment variable."""
    found: dict[str, tuple[str, ...]] = {}
    for kind, env in KEY_ENV.items():
        keys = list(o[f"{kind}_key"] or [])
        if o[f"{kind}_key_file"] is not None:
            keys += _read_key_file(Path(o[f"{kind}_key_file"]), kind)
        keys += [k.strip() for k in environ.get(env, "").split(",") if k.strip()]
        for key in keys:
            if not key or not all(33 <= ord(c) < 127 for c in key):
                raise PdserveError(
                    f"a {kind} key must be printable ASCII without spaces (it goes in a header)"
                )
            if len(key) < _SHORT_KEY:
                logger.warning(
                    "a %s key has only %d characters: a guessable key protects little", kind, len(key)
                )
        found[kind] = tuple(dict.fromkeys(keys))
    shared = set(found["admin"]) & (set(found["api"]) | set(found["metrics"]))
    if shared:
        raise PdserveError("an admin key must not also be an API or metrics key: give the admin API its own")
    return AccessKeys(**found)


def _read_key_file(path: Path, kind: str) -> list[str]:
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise PdserveError(f"cannot read the {kind} key file {path}: {exc}") from exc
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("the %s key file %s is readable by other users: chmod 600 it", kind, path)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise PdserveError(f"the {kind} key file {path} holds no key")
    return keys


def warn_if_exposed(host: str, keys: AccessKeys) -> None:
    """Say it loudly when the API is reachable from other hosts without a key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a hostname: it may resolve to anything
    if loopback:
        return
    if not keys.api:
        logger.warning(
            "SERVING ON %s WITHOUT AN API KEY: anyone who can reach this address can use the model "
            "and, without --admin-key, scale and drain its pools. Give --api-key-file and "
            "--admin-key-file (docs/security.md), or listen on 127.0.0.1.",
            host,
        )
    elif not keys.admin:
        logger.info("the admin API is closed (API keys but no admin key)")
