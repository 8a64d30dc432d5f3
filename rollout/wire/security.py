"""Who may talk to a rollout server: loopback only, a shared-secret token, or ZMQ CURVE keys.

A server binds to loopback by default, where every local process may connect. Any other address
needs one of (`check_bind` refuses to start otherwise):

* a shared-secret token: ZMQ's PLAIN mechanism, checked by a ZAP handler in the server process.
  The token travels in clear text: use it on a trusted network only. The handler compares it in
  constant time and never logs it (pyzmq's own logs accepted passwords at DEBUG);
* CURVE: the server's key pair and a directory of the client public keys it accepts (certificate
  files as `zmq.auth.create_certificates` writes them, see `create_keys`); traffic is encrypted.

Both also work on loopback. A client gives the same token, or its own key pair plus the server's
public key (`ClientSecurity`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import zmq

PLAIN_USER = b"rollout"


class InsecureBindError(ValueError):
    """A server was asked to listen beyond loopback without a token or CURVE keys."""


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """A server's credentials: a shared-secret `token`, or CURVE (`curve_keys` = its certificate
    file with the secret key, `curve_clients` = directory of accepted client public keys)."""

    token: Optional[str] = None
    curve_keys: Optional[Path] = None
    curve_clients: Optional[Path] = None

    def __post_init__(self) -> None:
        if self.token is not None and not self.token:
            raise ValueError("ServerSecurity.token must not be empty")
        if self.token is not None and self.curve_keys is not None:
            raise ValueError("ServerSecurity: give a token or CURVE keys, not both")
        if (self.curve_keys is None) != (self.curve_clients is None):
            raise ValueError("ServerSecurity: CURVE needs both curve_keys (server certificate) and curve_clients "
                             "(directory of accepted client public keys)")

    @property
    def enabled(self) -> bool:
        return self.token is not None or self.curve_keys is not None


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """A client's credentials: the server's `token`, or CURVE (`curve_keys` = the client's
    certificate file with its secret key, `server_public_key` = the server's public key, z85)."""

    token: Optional[str] = None
    curve_keys: Optional[Path] = None
    server_public_key: Optional[bytes] = None

    def __post_init__(self) -> None:
        if (self.curve_keys is None) != (self.server_public_key is None):
            raise ValueError("ClientSecurity: CURVE needs curve_keys and server_public_key")
        if self.token is not None and self.curve_keys is not None:
            raise ValueError("ClientSecurity: give a token or CURVE keys, not both")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or a wildcard ("*", "eth0"): not known to be loopback


def check_bind(host: str, security: ServerSecurity) -> None:
    """Refuse (`InsecureBindError`) to listen beyond loopback without credentials."""
    if not is_loopback(host) and not security.enabled:
        raise InsecureBindError(
            f"refusing to listen on {host!r} without credentials: bind to 127.0.0.1, or give a shared-secret "
            f"token (--token / ROLLOUT_TOKEN) or CURVE keys (--curve-keys and --curve-clients)")


def secure_server_socket(ctx: zmq.Context, sock: zmq.Socket, security: ServerSecurity) -> Optional[Any]:
    """Configure `sock` (before bind) and start the ZAP handler; returns the authenticator to
    stop at shutdown (None without credentials)."""
    if not security.enabled:
        return None
    if security.token is not None:
        auth = _plain_authenticator(ctx, security.token)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    if security.token is not None:
        auth.configure_plain(domain="*", passwords={PLAIN_USER.decode(): security.token})
        sock.plain_server = True
    else:
        public, secret = _load_keys(security.curve_keys)
        if not Path(security.curve_clients).is_dir():
            auth.stop()
            raise FileNotFoundError(f"curve_clients: {security.curve_clients} is not a directory")
        auth.configure_curve(domain="*", location=str(security.curve_clients))
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    return auth


class _WithholdSecret(logging.Filter):
    """Drops the arguments of a record that would show `secret` (pyzmq's authenticator logs the
    credentials it refuses as unreadable, `%r`, and the accepted ones at DEBUG)."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self._secret, self._raw = secret, secret.encode()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args and self._shows(record.args):
            record.msg, record.args = f"{record.msg} [arguments withheld: they hold a credential]", ()
        return True

    def _shows(self, value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return any(self._shows(v) for v in value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return self._raw in bytes(value)
        return self._secret in str(value)


def _plain_authenticator(ctx: zmq.Context, token: str) -> Any:
    """pyzmq's ZAP handler with a constant-time token check whose logs never show a password."""
    from zmq.auth.thread import ThreadAuthenticator

    class PlainAuthenticator(ThreadAuthenticator):
        def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
            # NOTE: compare_digest takes as long whatever prefix matches: the token cannot be guessed byte by byte
            user_ok = hmac.compare_digest(username.encode(), PLAIN_USER)
            token_ok = hmac.compare_digest(password.encode(self.encoding, "replace"), token.encode())
            if user_ok and token_ok:
                self.log.debug("ALLOWED (PLAIN) domain=%s", domain)
                return True, b"OK"
            self.log.debug("DENIED (PLAIN) domain=%s: wrong user or token", domain)
            return False, b"Invalid credentials"

    log = logging.getLogger(f"{__name__}.zap.{secrets.token_hex(4)}")  # NOTE: its own filter, for its token alone
    log.addFilter(_WithholdSecret(token))
    return PlainAuthenticator(ctx, log=log)


def secure_client_socket(sock: zmq.Socket, security: Optional[ClientSecurity]) -> None:
    """Configure a client's socket (before connect) with its credentials, if any."""
    if security is None:
        return
    if security.token is not None:
        sock.plain_username = PLAIN_USER
        sock.plain_password = security.token.encode()
    elif security.curve_keys is not None:
        public, secret = _load_keys(security.curve_keys)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = security.server_public_key


def create_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a CURVE key pair as `name.key` (public) and `name.key_secret` (keep it private)."""
    import zmq.auth

    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


def public_key(path: Path) -> bytes:
    """The public key (z85) in a certificate file (either half of a pair)."""
    return _load_keys(path, need_secret=False)[0]


def _load_keys(path: Optional[Path], need_secret: bool = True) -> tuple[bytes, Optional[bytes]]:
    import zmq.auth

    if path is None or not Path(path).is_file():
        raise FileNotFoundError(f"CURVE certificate {path} not found")
    public, secret = zmq.auth.load_certificate(str(path))
    if need_secret and secret is None:
        raise ValueError(f"{path} holds no secret key (give the `.key_secret` file)")
    return public, secret
