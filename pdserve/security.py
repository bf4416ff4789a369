"""The secrets of a deployment and how each process gets its share. No torch.

- **RPC (router <-> worker)**: ZeroMQ CURVE. The router has a keypair made at its start; each
  worker makes its own server keypair when it starts and reports the public half in its `Ready`
  (over the pipe, or the channel, of the cluster backend that started it, never over the network
  unauthenticated). A worker accepts a connection only from the router public keys it was given
  (ZAP), so a process without the router's secret key cannot speak to it: not `Shutdown`, not
  `AddRequest`, not a read of another peer's token streams.
- **KV (worker <-> worker)**: a per-deployment secret (`kv_secret`) that every worker of the
  deployment holds: a KV connection is accepted only after it answered a challenge with an HMAC
  of that secret (pdserve.transfer.tcp_wire).

A cluster backend hands each worker its `WorkerSecrets` in the environment variable
`PDSERVE_WORKER_SECRETS` (a process's environment is readable by its owner only; its command
line by every user), and the worker removes it from its environment at once, so nothing it
starts inherits it. Nothing here is written to disk or logged.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pdserve.errors import PdserveError

SECRETS_ENV = "PDSERVE_WORKER_SECRETS"
# No control message comes near this (a 128k-token prompt is ~640 KB of msgpack); a peer that
# announces more is cut off before ZeroMQ allocates it.
MAX_RPC_MESSAGE_BYTES = 16 << 20
KV_SECRET_BYTES = 32


@dataclass(frozen=True)
class CurveKeypair:
    """A CURVE keypair as Z85 text (40 characters each)."""

    public: str
    secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeypair:
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())


class WorkerSecrets(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a worker is given: whom to obey and the deployment's KV secret (hex)."""

    rpc_clients: list[str]  # CURVE public keys of the routers it accepts
    kv_secret: str

    @property
    def kv_secret_bytes(self) -> bytes:
        return bytes.fromhex(self.kv_secret)

    def __repr__(self) -> str:  # never print the secret
        return f"WorkerSecrets(rpc_clients={self.rpc_clients!r}, kv_secret=<hidden>)"


@dataclass(frozen=True)
class DeploymentSecrets:
    """Made once per `pdserve serve` (or per test): the router's keypair and the KV secret."""

    router: CurveKeypair
    kv_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> DeploymentSecrets:
        return cls(CurveKeypair.generate(), secrets.token_bytes(KV_SECRET_BYTES))

    def for_workers(self) -> WorkerSecrets:
        return WorkerSecrets(rpc_clients=[self.router.public], kv_secret=self.kv_secret.hex())


def worker_env(worker_secrets: WorkerSecrets) -> dict[str, str]:
    """The environment entry that carries a worker's secrets."""
    return {SECRETS_ENV: msgspec.json.encode(worker_secrets).decode()}


def take_worker_secrets(environ: MutableMapping[str, str] = os.environ) -> WorkerSecrets:
    """A worker's secrets, removed from its environment. Raises PdserveError without them: a
    worker that obeyed anyone would be the hole this module closes."""
    raw = environ.pop(SECRETS_ENV, None)
    if not raw:
        raise PdserveError(
            f"no {SECRETS_ENV} in the environment: a worker is started by a cluster backend "
            "(pdserve serve), which hands it the keys of the router it obeys"
        )
    try:
        taken = msgspec.json.decode(raw.encode(), type=WorkerSecrets)
        if len(taken.kv_secret_bytes) < 16 or not taken.rpc_clients:
            raise ValueError("a KV secret of at least 16 bytes and at least one router key are needed")
        for key in taken.rpc_clients:
            if len(key) != 40:
                raise ValueError(f"not a Z85 CURVE public key: {key!r}")
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise PdserveError(f"bad {SECRETS_ENV}: {exc}") from None
    return taken


def curve_client(sock: zmq.Socket[Any], keypair: CurveKeypair, server_public: str) -> None:
    """Make `sock` (before it connects) a CURVE client of the worker whose public key is given."""
    sock.curve_secretkey = keypair.secret.encode()
    sock.curve_publickey = keypair.public.encode()
    sock.curve_serverkey = server_public.encode()
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_RPC_MESSAGE_BYTES)


def curve_server(sock: zmq.Socket[Any], keypair: CurveKeypair) -> None:
    """Make `sock` (before it binds) a CURVE server; who may connect is the ZAP handler's call."""
    sock.curve_secretkey = keypair.secret.encode()
    sock.curve_publickey = keypair.public.encode()
    sock.curve_server = True
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_RPC_MESSAGE_BYTES)
