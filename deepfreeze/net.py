"""Long because: one protocol (token to handshake), each part built on the frame and MAC helpers below it.

Tokens, authenticated connections and framed messages: the one network module of DeepFreeze.

Used by the stream (:mod:`deepfreeze.stream.wire`) and the repository providers (``deepfreeze
repo serve``), and meant for every other DeepFreeze service that listens on TCP. It knows
nothing about what is sent.

**Tokens.** Both ends share a secret. :func:`load_token` takes it from an explicit file, else
the environment variable ``DEEPFREEZE_TOKEN`` (the token text itself, never a path: a value
that contains ``/``, names an existing file or is shorter than :data:`MIN_ENV_TOKEN` characters
is refused, so a path set on both ends never becomes the shared secret), else the file that
``DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``. A token file must be a regular
file owned by the user with mode ``0600``, opened once without following a link (anything else
is refused, saying what to do). :func:`create_token` makes one (32 random bytes, hex): written and fsynced under a
temporary ``0600`` name, then hard-linked into place (fails if the name exists), so a reader
never sees a half-written token; :func:`ensure_token` loads it or creates it when missing, and
concurrent creators all end with the winner's token. **The token never goes on the wire.**

**Listening.** :func:`listen` binds to a loopback address only, unless ``allow_remote=True``.
:class:`Acceptor` is a server's bounded pre-authentication stage: one thread, ``poll``-style
readiness over every connection still in the handshake, a deadline per connection
(``handshake_timeout``) and at most ``max_pending`` of them (a new one closes the oldest), so
idle, slow-loris or token-less connections cannot lock out a client that knows the token.

**Frames** (little-endian)::

    magic b"DFNM", version u16 (= VERSION, the protocol version), flags u16, header length u32,
    payload length u64; header: UTF-8 JSON object (never pickle), at most ``max_header`` bytes;
    flags bit 0 set ("sealed"): a 32-byte header tag follows the header, and after a non-empty
    payload a 32-byte payload tag.

Both lengths are checked against the receiver's limits *before* anything is allocated or read;
the payload is received straight into the caller's buffers (:meth:`Message.recv_into`), never
through an intermediate ``bytes``. Every wait has a deadline: past it
:class:`~deepfreeze.errors.ProviderTimeoutError`; a peer that closes or sends something that
is not a frame: :class:`~deepfreeze.errors.ProviderError`.

**Handshake** (unsealed frames, no payload; ``T`` the token, ``H`` HMAC-SHA256)::

    client -> server  {"df": "auth", "protocol": 2, "nonce": Nc}          Nc: 32 random bytes, hex
    server -> client  {"df": "challenge", "protocol": 2, "nonce": Ns,     Ns: 32 random bytes
                       "proof": H(T, "deepfreeze-net proof 2 server\0" + Nc + Ns)}
    client checks the server's proof: wrong -> AuthenticationError, connection closed, nothing
    else sent (a planted server learns Nc only, which is worth nothing)
    client -> server  {"df": "proof", "proof": H(T, "deepfreeze-net proof 2 client\0" + Nc + Ns)}
    server checks it: wrong -> an unsealed {"ok": false, "type": "AuthenticationError"} answer, closed

The proofs are bound to both nonces and to the role, so neither side's proof can be replayed to
the other or on another connection. **Session keys** (HKDF-like, extract then expand):
``PRK = H(Nc + Ns, T)``, ``K_c2s = H(PRK, "deepfreeze-net session 2\0c2s\x01")``, ``K_s2c``
likewise with ``s2c``. From then on every frame in both directions is sealed: the header tag (32 bytes) is
``H(K_dir, dir + seq + the 20 fixed bytes + header)`` (``dir`` ``b"C"`` or ``b"S"``, ``seq`` the
frame's 8-byte sequence number in that direction, from 0) and is checked before the header is
parsed or used; the payload tag (16 bytes) is Poly1305 under the one-time key
``H(K_dir, "deepfreeze-net payload 2\0" + dir + seq)`` over the header tag and then the payload
bytes, updated as they land in the caller's buffer, and is checked when the last byte has been
read (the header tag binds the payload to its frame; the key is never used twice, as Poly1305
requires). A frame that is
changed, reordered, replayed, dropped (the next one's sequence number no longer matches) or
injected fails its check: :class:`~deepfreeze.errors.FrameAuthenticationError` and the
connection is closed. The first sealed frame is the client's application hello.

Why a MAC over the payload bytes and not over the header plus the payload's CRC32: CRC32 is
linear and not collision-resistant, so an on-path attacker can rewrite a payload while keeping
its CRC and the tag would still verify; a MAC over the bytes themselves cannot be forged. Why
Poly1305 (the ``cryptography`` package) for payloads: measured here at about 5 GB/s per core
against about 1 GB/s for HMAC-SHA256 and 0.5 GB/s for keyed BLAKE2b, so the MAC no longer
bounds a fetch; the cost against the unsealed baseline is in docs/performance.md ("The network
MAC", experiments/net_mac.py).

**Version.** ``VERSION`` is in every frame and in the hello. A server that gets another version
answers an unsealed error in the client's own frame version naming both versions
(:class:`~deepfreeze.errors.ProtocolVersionError` on a current client; a version-1 client shows
it as a ``ProviderError``); a client whose server closes at once on its hello says that the
server may be older.

**Errors on the wire.** An error answer is ``{"ok": false, "type": "<class name>", "error":
"<message>"}``; :func:`raise_for_reply` raises the named :mod:`deepfreeze.errors` class on the
other side (only classes of that module; any other name becomes a ``ProviderError``).

(The module is past 800 lines because the handshake's blocking and readiness-driven forms, the
frame format and the pre-authentication stage belong together with their protocol description.)
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any, Iterable, Mapping

from . import ownership
from .jsonsafe import loads as bounded_loads
from .errors import (AuthenticationError, ConfigError, DeepFreezeError, FrameAuthenticationError, PeerClosedError,
                     ProtocolVersionError, ProviderError, ProviderTimeoutError, UnsafePathError, UntrustedOwnerError,
                     error_class)

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "MIN_ENV_TOKEN", "DEFAULT_TOKEN_PATH", "MAGIC", "VERSION", "MAX_HEADER", "default_token_path",
           "create_token", "ensure_token", "load_token", "check_token", "parse_address", "format_address",
           "is_loopback", "listen", "connect", "send_msg", "recv_msg", "wait_readable", "Message", "Channel",
           "FrameWriter", "Acceptor", "error_reply", "raise_for_reply", "server_handshake", "server_authenticate",
           "client_handshake", "is_transport_error", "keepalive"]

#: environment variable holding the token text itself (takes precedence over the token files)
TOKEN_ENV = "DEEPFREEZE_TOKEN"
#: environment variable naming a token file (when :data:`TOKEN_ENV` is not set)
TOKEN_FILE_ENV = "DEEPFREEZE_TOKEN_FILE"
#: the shortest token text :data:`TOKEN_ENV` may hold (the tokens :func:`create_token` makes have 64)
MIN_ENV_TOKEN = 32
#: where :func:`create_token` and :func:`load_token` look by default
DEFAULT_TOKEN_PATH = "~/.deepfreeze/token"
MAGIC = b"DFNM"
#: the network protocol version (in every frame and in the hello); 1 sent the token in clear
VERSION = 2
_FRAME = struct.Struct("<4sHHIQ")
_FLAG_MAC = 1
_MAC_DIGEST = "sha256"
_TAG = 32
_NONCE = 32
_MAX_AUTH_HEADER = 4096
#: whether frames are really MACed. Only experiments/net_mac.py turns it off (on both ends),
#: to measure the unauthenticated baseline; never set it otherwise: every tag is then zeros.
MAC = True


_PTAG = 16  # a payload tag (Poly1305)


class _NoMac:
    """A payload tag of zeros: for a frame without payload, and the baseline of
    experiments/net_mac.py (``MAC = False``: the same frames, tags of zeros)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def update(self, data: Any) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(self.size)


_POLY1305: Any = None


def _poly1305(key: bytes) -> Any:
    global _POLY1305
    if _POLY1305 is None:
        try:
            from cryptography.hazmat.primitives.poly1305 import Poly1305
        except ImportError as e:  # a declared dependency (pyproject, scripts/setup.sh)
            raise ImportError("deepfreeze.net needs the 'cryptography' package for its payload MAC (Poly1305): "
                              "pip install cryptography") from e
        _POLY1305 = Poly1305
    return _POLY1305(key)


class _PayloadMac:
    """The payload tag of one frame: Poly1305 under a one-time key ``H(K_dir, "deepfreeze-net
    payload 2\0" + dir + seq)`` (unique per direction and frame, as Poly1305 requires), over the
    frame's header tag and then the payload bytes. ``update``/``digest`` like hashlib's."""

    def __init__(self, key: bytes, direction: bytes, seq: int, header_tag: bytes) -> None:
        otk = hmac.digest(key, b"deepfreeze-net payload %d\0" % VERSION + direction + seq.to_bytes(8, "little"),
                          _MAC_DIGEST)
        self._poly = _poly1305(otk)
        self._poly.update(header_tag)
        self._tag: bytes | None = None

    def update(self, data: Any) -> None:
        self._poly.update(data)

    def digest(self) -> bytes:
        if self._tag is None:
            self._tag = self._poly.finalize()
        return self._tag
#: default bound of a frame's JSON header
MAX_HEADER = 1 << 20
_MAX_TOKEN = 1024
_CHUNK = 64 << 20  # largest single send/recv call (keeps each call's wait short and bounded)


# ----------------------------------------------------------------------------- tokens

def default_token_path() -> str:
    """``~/.deepfreeze/token`` expanded."""
    return os.path.expanduser(DEFAULT_TOKEN_PATH)


def create_token(path: str | None = None) -> str:
    """Create a new token file holding 32 random bytes in hex and return the token; its directory
    is created ``0700`` when missing. The token is written and fsynced under a temporary name
    (``0600``, ``O_EXCL``) and then hard-linked into place (:func:`os.link` fails if the name
    exists), so a reader never sees a half-written file and an existing token is never
    overwritten: ``FileExistsError`` then (remove the file first to rotate the token; to load or
    create, race-free, use :func:`ensure_token`). The directory follows the directory rule of
    :func:`deepfreeze.ownership.ensure_dir` (else :class:`~deepfreeze.errors.UnsafePathError`)."""
    path = os.path.abspath(os.path.expanduser(path or default_token_path()))
    d = os.path.dirname(path)
    # the one directory rule (deepfreeze.ownership.ensure_dir): missing directories are made 0700,
    # an existing one must be a real directory that nobody else can write in (or a sticky one)
    ownership.ensure_dir(d, d)
    token = secrets.token_hex(32)
    # whole or not at all; FileExistsError when another creator (or an old token) is there
    ownership.create_whole(path, (token + "\n").encode())
    return token


def ensure_token(path: str | None = None) -> str:
    """The token of ``path`` (default as :func:`load_token`: ``$DEEPFREEZE_TOKEN``, the token
    text, else the file ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``), creating
    the default file (or ``path``) when it is missing; a file named by ``$DEEPFREEZE_TOKEN_FILE``
    is only read. Race-free: of several processes creating it at once, one links its file into
    place and the others load that one, so all of them end with the same token."""
    if path is None and (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV)):
        return load_token(None)
    p = os.path.abspath(os.path.expanduser(path or default_token_path()))
    if not os.path.lexists(p):
        try:
            return create_token(p)
        except FileExistsError:
            pass  # another creator won the race: use its token
    return load_token(p)


def _valid_token(tok: str, where: str) -> str:
    tok = tok.strip()
    if not tok or len(tok) > _MAX_TOKEN or not tok.isascii() or not tok.isprintable():
        raise AuthenticationError(f"the token in {where} is empty, longer than {_MAX_TOKEN} characters or not "
                                  "printable ASCII; create a new one with deepfreeze.net.create_token()")
    return tok


def _env_token(value: str) -> str:
    """The token text of ``$DEEPFREEZE_TOKEN``; :class:`AuthenticationError` for a value that looks
    like a path (contains ``/`` or names an existing file) or is too short to be a token."""
    tok = value.strip()
    why = None
    if "/" in tok:
        why = "contains '/'"
    elif tok and os.path.lexists(os.path.expanduser(tok)):
        why = "names an existing file"
    elif len(tok) < MIN_ENV_TOKEN:
        why = f"is {len(tok)} characters long, shorter than a token ({MIN_ENV_TOKEN} at least; DeepFreeze makes 64)"
    if why is not None:
        raise AuthenticationError(
            f"${TOKEN_ENV} {why}: it must hold the token text itself (e.g. the 64 hex characters of a token "
            f"file: export {TOKEN_ENV}=$(cat ~/.deepfreeze/token)), not a path. To name a token file, set "
            f"{TOKEN_FILE_ENV}=PATH instead (a file of yours, mode 0600), and unset {TOKEN_ENV}")
    return _valid_token(tok, f"${TOKEN_ENV}")


def load_token(path: str | None = None) -> str:
    """The token: from the file ``path`` when given, else ``$DEEPFREEZE_TOKEN`` (the token text
    itself: a value containing ``/``, naming an existing file or shorter than
    :data:`MIN_ENV_TOKEN` characters is an :class:`AuthenticationError` saying to put the token
    text there), else the file ``$DEEPFREEZE_TOKEN_FILE`` names, else ``~/.deepfreeze/token``.

    A token file must be a regular file (not a link) owned by you with no group/other permission,
    opened once (``O_NOFOLLOW``) and checked on that descriptor (:func:`deepfreeze.ownership.open_trusted`):
    :class:`UntrustedOwnerError` for another owner, :class:`AuthenticationError` for loose modes or
    no token at all (the message says how to fix it)."""
    if path is None:
        env = os.environ.get(TOKEN_ENV)
        if env:
            return _env_token(env)
        path = os.environ.get(TOKEN_FILE_ENV) or None
        if path is None:
            path = default_token_path()
            if not os.path.lexists(path):
                raise AuthenticationError(
                    f"no token: {TOKEN_ENV} is not set and {path} does not exist. Create one with "
                    f"'python -c \"import deepfreeze.net as n; n.create_token()\"' (or set {TOKEN_ENV} to the token "
                    f"text itself, or {TOKEN_FILE_ENV} to a token file) and use the same token on every client and "
                    "provider")
    path = os.path.expanduser(path)
    try:  # the one trust check (deepfreeze.ownership): regular, no link, yours, no group/other bits
        fd = ownership.open_trusted(path, os.O_RDONLY, kind="token file", trusted=frozenset({os.getuid()}),
                                    loose="refuse")
    except UntrustedOwnerError:
        raise
    except UnsafePathError as e:
        raise AuthenticationError(f"{e} (a token file must be a regular file of yours, mode 0600; rotate the "
                                  "token if others could read it)") from e
    except OSError as e:
        raise AuthenticationError(f"cannot read the token file {path}: {e.strerror}; create it with "
                                  "deepfreeze.net.create_token() or set " + TOKEN_ENV) from e
    try:
        data = os.read(fd, _MAX_TOKEN + 2)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise AuthenticationError(f"token file {path} is not ASCII; create a new token") from e
    return _valid_token(text, path)


def check_token(presented: object, expected: str) -> bool:
    """Whether ``presented`` equals ``expected``, compared in constant time (False for a non-string)."""
    if not isinstance(presented, str) or not presented.isascii():
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


# ----------------------------------------------------------------------------- addresses and sockets

def parse_address(addr: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` or ``"[v6]:port"``; :class:`ConfigError` otherwise."""
    if not isinstance(addr, str) or ":" not in addr:
        raise ConfigError(f"address {addr!r}: expected 'host:port' (e.g. 127.0.0.1:7000)")
    host, _, port_s = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535 or len(host) > 255:
        raise ConfigError(f"address {addr!r}: expected 'host:port' with a port in 0..65535 (e.g. 127.0.0.1:7000)")
    return host, int(port_s)


def format_address(host: str, port: int) -> str:
    """``host:port`` (``[v6]:port`` for an IPv6 literal)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def listen(host: str, port: int, *, allow_remote: bool = False, backlog: int = 64) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port; see ``getsockname()``).
    A non-loopback ``host`` is refused (:class:`ConfigError`) unless ``allow_remote``."""
    if not allow_remote and not is_loopback(host):
        raise ConfigError(f"refusing to listen on {host}:{port}: not a loopback address, so other machines could "
                          "connect. Listen on 127.0.0.1, or pass allow_remote=True (CLI: --allow-remote) on a "
                          "trusted network: every connection must still present the token")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve {host!r} to listen on: {e}") from e
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {format_address(host, port)}: {e.strerror or e} (another process "
                          "there? choose another port, or port 0 for any free one)") from e
    return sock


def keepalive(sock: socket.socket, idle: int = 60, interval: int = 10, count: int = 6) -> None:
    """TCP keepalive on ``sock``: a peer whose machine died (no FIN ever comes) is detected after
    about ``idle + interval * count`` seconds of silence, so a server thread waiting for its next
    request ends instead of waiting forever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def connect(addr: str, timeout: float) -> socket.socket:
    """A connected TCP socket to ``"host:port"`` within ``timeout`` seconds
    (:class:`ProviderTimeoutError`; refused or unreachable: :class:`ProviderError`)."""
    host, port = parse_address(addr)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except (socket.timeout, TimeoutError) as e:
        raise _lost(ProviderTimeoutError, f"{addr} did not accept a connection within {timeout:g}s") from e
    except OSError as e:
        raise _lost(ProviderError, f"cannot connect to {addr}: {e.strerror or e}; is the server running there?") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# ----------------------------------------------------------------------------- frames

def _lost(cls: type, message: str, **fields: Any) -> DeepFreezeError:
    """An error of the connection itself (see :func:`is_transport_error`); ``fields``: the class's own."""
    e = cls(message, **fields)
    e.transport = True
    return e


def is_transport_error(e: BaseException) -> bool:
    """Whether ``e`` was raised by this module because the connection failed (timed out, closed,
    a frame that cannot be read): the stream is out of step, close it. Errors a peer *answered*
    with (:func:`raise_for_reply`) are not."""
    return bool(getattr(e, "transport", False))

def _left(deadline: float | None, sock: socket.socket, what: str) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise _lost(ProviderTimeoutError, f"timed out {what} {_peer(sock)}")
    return left


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "the peer"
    return format_address(*name[:2]) if isinstance(name, tuple) else "the peer"


def _bytes_of(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("payload buffers must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class Channel:
    """An authenticated connection: the socket, the session's two directional keys and the two
    frame sequence numbers (see the module doc). Made by :func:`client_handshake` and
    :func:`server_handshake` (or :class:`Acceptor`); never from a bare socket in production.

    :meth:`send` and :meth:`frame` seal outgoing frames, :meth:`recv` checks incoming ones. One
    thread sends at a time and one receives at a time (the callers serialize their sends)."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, role: str) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role {role!r}: 'client' or 'server'")
        self.sock, self.role = sock, role
        self._send_key, self._recv_key = send_key, recv_key
        self._send_dir = b"C" if role == "client" else b"S"
        self._recv_dir = b"S" if role == "client" else b"C"
        self.send_seq = 0  #: frames sealed so far
        self.recv_seq = 0  #: frames received and verified so far
        self._open: Message | None = None

    # -- socket-like
    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        self.sock.shutdown(how)

    def peer(self) -> str:
        return _peer(self.sock)

    # -- sealing
    @staticmethod
    def _header_tag(direction: bytes, key: bytes, seq: int, fixed: bytes, hdr: Any) -> bytes:
        """``H(K_dir, dir + seq + fixed + header)`` (one-shot: a header is small)."""
        if not MAC:
            return bytes(_TAG)
        return hmac.digest(key, b"".join((direction, seq.to_bytes(8, "little"), fixed, hdr)), _MAC_DIGEST)

    def _seal_header(self, header: Mapping[str, Any], total: int) -> tuple[bytes, Any]:
        hdr = json.dumps(header, separators=(",", ":")).encode()
        fixed = _FRAME.pack(MAGIC, VERSION, _FLAG_MAC, len(hdr), total)
        seq = self.send_seq
        tag = self._header_tag(self._send_dir, self._send_key, seq, fixed, hdr)
        self.send_seq += 1
        return fixed + hdr + tag, (self._payload_mac(self._send_dir, self._send_key, seq, tag) if total
                                   else _NoMac(_PTAG))

    @staticmethod
    def _payload_mac(direction: bytes, key: bytes, seq: int, header_tag: bytes) -> Any:
        return _PayloadMac(key, direction, seq, header_tag) if MAC else _NoMac(_PTAG)

    def frame(self, header: Mapping[str, Any]) -> bytes:
        """One whole sealed frame without payload (for a caller that writes it itself, e.g. a
        notification queued for a subscriber). Takes the next sequence number now: frames must
        go on the socket in the order they were made."""
        return self._seal_header(header, 0)[0]

    def send(self, header: Mapping[str, Any], payload: Iterable[Any] = (), *, deadline: float | None = None) -> None:
        """Send one frame: ``header`` as JSON, then the ``payload`` buffers (contiguous, any buffer
        protocol object; numpy arrays via ``deepfreeze.format.byte_view``) back to back, unjoined
        (the MAC is updated over each piece as it goes out: no copy). Past ``deadline``
        (``time.monotonic()``): :class:`ProviderTimeoutError`; a closed peer: :class:`ProviderError`."""
        bufs = [_bytes_of(b) for b in payload]
        w = self.begin(header, sum(b.nbytes for b in bufs), deadline=deadline)
        for b in bufs:
            w.write(b, deadline=deadline)
        w.finish(deadline=deadline)

    def begin(self, header: Mapping[str, Any], total: int, *, deadline: float | None = None) -> "FrameWriter":
        """Send the sealed header of a frame whose payload of ``total`` bytes the returned
        :class:`FrameWriter` sends piece by piece (for a sender that must be able to pause)."""
        head, mac = self._seal_header(header, total)
        w = FrameWriter(self, mac, total)
        w._put(head, deadline)
        return w


    def recv(self, *, max_header: int = MAX_HEADER, max_payload: int = 0, deadline: float | None = None) -> "Message":
        """Receive one frame's header (the payload stays on the socket: see :class:`Message`).

        The magic, the version and both lengths are checked before anything else is read or
        allocated (a header over ``max_header`` or a payload over ``max_payload`` bytes:
        :class:`ProviderError`); then the header's MAC (direction, sequence number, lengths,
        header), before the header is parsed or used: a frame that fails it
        (:class:`~deepfreeze.errors.FrameAuthenticationError`) ends the connection. A payload
        left unread by the previous message is read and checked first. Past ``deadline``:
        :class:`ProviderTimeoutError`; EOF: :class:`ProviderError`."""
        if self._open is not None and self._open.remaining:
            self._open.discard()
        self._open = None
        sock = self.sock
        raw = bytearray(_FRAME.size)
        _recv_exact(sock, memoryview(raw), deadline, "a message", boundary=True)
        magic, version, flags, hlen, plen = _check_fixed(sock, raw, max_header, max_payload)
        if not flags & _FLAG_MAC:
            if self.recv_seq == 0 and hlen <= _MAX_AUTH_HEADER and plen == 0:  # a refusal sent before the session
                header = _parse_header(sock, _read(sock, hlen, deadline, "a message header"))
                if header.get("ok") is False:
                    raise_for_reply(header, f"{_peer(sock)} (unauthenticated answer): ")
            raise _lost(FrameAuthenticationError, f"{_peer(sock)} sent a frame without a MAC on an authenticated "
                                                  "connection: injected by someone else? closing it")
        body = _read(sock, hlen + _TAG, deadline, "a message header")
        tag = bytes(body[hlen:])
        if not hmac.compare_digest(self._header_tag(self._recv_dir, self._recv_key, self.recv_seq, bytes(raw),
                                                    memoryview(body)[:hlen]), tag):
            raise _lost(FrameAuthenticationError,
                        f"frame {self.recv_seq} from {_peer(sock)} failed its MAC check: it was changed, replayed, "
                        "reordered or injected on the way (or does not come from the peer that authenticated): "
                        "refused, closing the connection")
        payload_mac = self._payload_mac(self._recv_dir, self._recv_key, self.recv_seq, tag) if plen else None
        self.recv_seq += 1
        header = _parse_header(sock, body[:hlen])
        msg = Message(self, header, plen, deadline, payload_mac)
        self._open = msg
        return msg


class FrameWriter:
    """The payload of one frame being sent (:meth:`Channel.begin`): :meth:`write` the pieces in
    order, then :meth:`finish` (the payload tag). Errors as :meth:`Channel.send`."""

    def __init__(self, ch: Channel, mac: Any, total: int) -> None:
        self.ch, self.total, self.sent = ch, total, 0
        self._mac = mac
        self._ahead = 0

    def _put(self, data: bytes, deadline: float | None) -> None:
        sock = self.ch.sock
        try:
            sock.settimeout(_left(deadline, sock, "sending to"))
            sock.sendall(data)
        except (socket.timeout, TimeoutError) as e:
            raise _lost(ProviderTimeoutError,
                        f"{_peer(sock)} did not take our message in time (stopped or overloaded?)") from e
        except OSError as e:
            raise _lost(ProviderError, f"lost the connection to {_peer(sock)} while sending: {e.strerror or e}") from e

    def write(self, buf: Any, *, deadline: float | None = None, pause_at: float | None = None) -> int:
        """Send ``buf`` (MACed as it goes, no copy); returns the bytes of it sent. With
        ``pause_at`` (``time.monotonic()``, before ``deadline``): when the peer takes nothing
        until then, return early with fewer bytes sent (no error): write the rest later."""
        mv = _bytes_of(buf)
        if self.sent + mv.nbytes > self.total:
            raise ValueError(f"a frame payload of {self.total} bytes: {self.sent + mv.nbytes} written")
        sock, pos, n = self.ch.sock, 0, mv.nbytes
        hashed = min(self._ahead, n)  # bytes of buf already in the MAC (sent again after a pause)
        self._ahead -= hashed
        paused = False
        try:
            while pos < n and not paused:
                end = min(n, pos + _WINDOW)
                job = None
                if hashed < end:  # the MAC of this window runs beside its send (both only read the bytes)
                    job = _mac_update(self._mac, mv[hashed:end])
                    hashed = end
                try:
                    while pos < end:
                        limit = deadline if pause_at is None or (deadline is not None and deadline <= pause_at) \
                            else pause_at
                        if limit is not None and limit - time.monotonic() <= 0:
                            if limit is pause_at:
                                paused = True
                                break
                            raise socket.timeout()
                        sock.settimeout(None if limit is None else limit - time.monotonic())
                        try:
                            pos += sock.send(mv[pos:end])
                        except (socket.timeout, TimeoutError):
                            if limit is pause_at:
                                paused = True
                                break
                            raise
                finally:
                    _wait(job)
        except (socket.timeout, TimeoutError) as e:
            raise _lost(ProviderTimeoutError,
                        f"{_peer(sock)} did not take our message in time (stopped or overloaded?)") from e
        except OSError as e:
            raise _lost(ProviderError, f"lost the connection to {_peer(sock)} while sending: {e.strerror or e}") from e
        self.sent += pos
        self._ahead = hashed - pos  # hashed, not sent: the caller writes these same bytes next
        return pos

    def finish(self, *, deadline: float | None = None) -> None:
        """After the whole payload: its tag (nothing for an empty payload)."""
        if self.sent != self.total:
            raise ValueError(f"a frame payload of {self.total} bytes: only {self.sent} written")
        if self.total:
            self._put(self._mac.digest(), deadline)


def _check_fixed(sock: socket.socket, raw: Any, max_header: int, max_payload: int) -> tuple[bytes, int, int, int, int]:
    magic, version, flags, hlen, plen = _FRAME.unpack(raw)
    if magic != MAGIC:
        raise _lost(ProviderError,
                    f"{_peer(sock)} sent something that is not a DeepFreeze message (magic {bytes(magic)!r})")
    if version != VERSION:
        raise _lost(ProtocolVersionError, f"{_peer(sock)} speaks DeepFreeze network protocol version {version}, this "
                                          f"side {VERSION}: run the same DeepFreeze version on both sides")
    if hlen > max_header:
        raise _lost(ProviderError, f"{_peer(sock)} announced a message header of {hlen} bytes, over the limit "
                                   f"of {max_header}: refused")
    if plen > max_payload:
        raise _lost(ProviderError, f"{_peer(sock)} announced a payload of {plen} bytes, over the limit of "
                                   f"{max_payload} for this connection: refused")
    return magic, version, flags, hlen, plen


def _read(sock: socket.socket, n: int, deadline: float | None, what: str) -> bytearray:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf), deadline, what)
    return buf


def _parse_header(sock: socket.socket, raw: Any) -> dict[str, Any]:
    try:  # size and nesting bounded before parsing (the frame's length was bounded when it was read)
        header = bounded_loads(raw, "message header", max_bytes=len(raw), error=ProviderError, advice="refused")
    except ProviderError as e:
        raise _lost(ProviderError, f"{_peer(sock)} sent a message header that is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise _lost(ProviderError, f"{_peer(sock)} sent a message header that is not a JSON object")
    return header


def send_msg(ch: Channel, header: Mapping[str, Any], payload: Iterable[Any] = (), *,
             deadline: float | None = None) -> None:
    """:meth:`Channel.send`."""
    ch.send(header, payload, deadline=deadline)


def _recv_exact(sock: socket.socket, mv: memoryview, deadline: float | None, what: str,
                mac: Any = None, boundary: bool = False) -> None:
    """Fill ``mv`` from ``sock``. An end of file is a :class:`PeerClosedError`, its
    ``between_messages`` true when nothing arrived and ``boundary`` (``mv`` starts a message)."""
    pos, n, hashed, job = 0, mv.nbytes, 0, None
    try:
        while pos < n:
            sock.settimeout(_left(deadline, sock, f"waiting for {what} from"))
            got = sock.recv_into(mv[pos:pos + _CHUNK])
            if not got:
                raise _lost(PeerClosedError, f"{_peer(sock)} closed the connection in the middle of {what} "
                                             f"({pos} of {n} bytes)",
                            received=pos, expected=n, between_messages=boundary and pos == 0)
            pos += got
            if mac is not None and (pos - hashed >= _WINDOW or pos == n):
                # MAC the bytes as they land (no second pass later), beside the next window's receive
                _wait(job)
                job, hashed = _mac_update(mac, mv[hashed:pos]), pos
        _wait(job)
        job = None
    except (socket.timeout, TimeoutError) as e:
        raise _lost(ProviderTimeoutError, f"{_peer(sock)} sent {pos} of {n} bytes of {what} and then nothing in "
                                          "time (stopped, hung or gone?)") from e
    except ProviderError:
        raise
    except OSError as e:
        raise _lost(ProviderError,
                    f"lost the connection to {_peer(sock)} while receiving {what}: {e.strerror or e}") from e
    finally:
        if job is not None:  # failed: the buffer must not be read after we return
            try:
                job.result()
            except Exception:
                pass


_WINDOW = 8 << 20     # payload bytes MACed per step beside the I/O of the next/same step
_PARALLEL_MIN = 1 << 20  # smaller pieces are MACed inline
_POOL: Any = None
_POOL_LOCK = threading.Lock()


def _mac_update(mac: Any, piece: memoryview) -> Any:
    """``mac.update(piece)``: inline for a small piece, else in the ``deepfreeze-net-mac`` threads
    (beside the caller's next socket call, which releases the GIL; Poly1305 itself holds it, so
    two MAC updates never run at once), returning the future to wait for before the next update of the
    same MAC (so the updates of one MAC stay in order)."""
    global _POOL
    if piece.nbytes < _PARALLEL_MIN or not MAC:
        mac.update(piece)
        return None
    with _POOL_LOCK:
        if _POOL is None:
            import concurrent.futures
            _POOL = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="deepfreeze-net-mac")
        pool = _POOL
    return pool.submit(mac.update, piece)


def _wait(job: Any) -> None:
    if job is not None:
        job.result()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def wait_readable(sock: Any, timeout: float) -> bool:
    """Whether ``sock`` (a socket or a :class:`Channel`) has data (or EOF) within ``timeout`` seconds."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLPRI)
    return bool(p.poll(max(0, int(timeout * 1000 + 0.999))))


class Message:
    """A received frame: ``header`` (a dict, its MAC already checked) and ``payload_bytes`` still
    to be read from the socket.

    The payload must be consumed in order: :meth:`recv_into` caller buffers, :meth:`read` small
    pieces, :meth:`discard` the rest (:meth:`finish`). Every read keeps the frame's deadline.
    The payload's MAC is computed as the bytes land and checked when the last byte has been
    read: the call that reads it raises :class:`~deepfreeze.errors.FrameAuthenticationError`
    when it fails, and the bytes already in the caller's buffers must then not be used."""

    def __init__(self, ch: Channel, header: dict[str, Any], payload_bytes: int, deadline: float | None,
                 mac: Any) -> None:
        self.channel, self.sock = ch, ch.sock
        self.header, self.payload_bytes, self.deadline = header, payload_bytes, deadline
        self.remaining = payload_bytes
        self._mac = mac

    def recv_into(self, buf: Any) -> None:
        """Fill ``buf`` (a writable contiguous buffer: numpy array, bytearray, memoryview) entirely
        from the payload; :class:`ProviderError` if the payload has fewer bytes left."""
        mv = _bytes_of(buf)
        if mv.readonly:
            raise ValueError("recv_into needs a writable buffer")
        if mv.nbytes > self.remaining:
            raise _lost(ProviderError, f"{_peer(self.sock)} sent a payload of {self.payload_bytes} bytes, fewer "
                                       "than its header announces")
        _recv_exact(self.sock, mv, self.deadline, "a message payload", self._mac)
        self.remaining -= mv.nbytes
        if self.remaining == 0 and mv.nbytes:
            tag = _read(self.sock, _PTAG, self.deadline, "a message's MAC")
            if not hmac.compare_digest(self._mac.digest(), bytes(tag)):
                raise _lost(FrameAuthenticationError,
                            f"the payload of frame {self.channel.recv_seq - 1} from {_peer(self.sock)} failed its MAC "
                            "check: its bytes were changed on the way (or it was injected): refused, closing the "
                            "connection; do not use what was received")

    def read(self, n: int) -> bytes:
        """The next ``n`` payload bytes (for small pieces only)."""
        buf = bytearray(n)
        self.recv_into(buf)
        return bytes(buf)

    def discard(self, n: int | None = None) -> None:
        """Read and drop ``n`` payload bytes (default: all that is left), through a small buffer."""
        n = self.remaining if n is None else n
        scratch = bytearray(min(n, 1 << 20))
        while n > 0:
            k = min(n, len(scratch))
            self.recv_into(memoryview(scratch)[:k])
            n -= k

    finish = discard


def recv_msg(ch: Channel, *, max_header: int = MAX_HEADER, max_payload: int = 0,
             deadline: float | None = None) -> Message:
    """:meth:`Channel.recv`."""
    return ch.recv(max_header=max_header, max_payload=max_payload, deadline=deadline)


# ----------------------------------------------------------------------------- replies

def error_reply(e: BaseException) -> dict[str, Any]:
    """The wire form of an error: ``{"ok": false, "type": ..., "error": ...}``."""
    name = type(e).__name__ if isinstance(e, DeepFreezeError) else "ProviderError"
    return {"ok": False, "type": name, "error": str(e)}


def raise_for_reply(header: Mapping[str, Any], where: str = "") -> Mapping[str, Any]:
    """``header`` when it says ``"ok": true``; otherwise raise the error it names (a class of
    :mod:`deepfreeze.errors`, else :class:`ProviderError`), prefixed with ``where``."""
    if header.get("ok") is True:
        return header
    name, msg = header.get("type"), header.get("error")
    cls = error_class(name) or ProviderError
    raise cls(f"{where}{msg if isinstance(msg, str) else 'error without a message'}")


# ----------------------------------------------------------------------------- handshake

def _proof(token: str, role: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(token.encode(), b"deepfreeze-net proof %d %s\0" % (VERSION, role) + nc + ns, _MAC_DIGEST).digest()


def _session_keys(token: str, nc: bytes, ns: bytes) -> tuple[bytes, bytes]:
    """(client->server key, server->client key): HMAC-SHA256 extract-and-expand (HKDF-like)."""
    prk = hmac.new(nc + ns, token.encode(), _MAC_DIGEST).digest()
    info = b"deepfreeze-net session %d\0" % VERSION
    return (hmac.new(prk, info + b"c2s\x01", _MAC_DIGEST).digest(),
            hmac.new(prk, info + b"s2c\x01", _MAC_DIGEST).digest())


def _plain(header: Mapping[str, Any], version: int = VERSION) -> bytes:
    """A frame without MAC (the handshake's, and a refusal before the session exists)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _FRAME.pack(MAGIC, version, 0, len(raw), 0) + raw


def _version_refusal(peer_version: int) -> bytes:
    err = ProtocolVersionError(f"this side speaks DeepFreeze network protocol version {VERSION}, the client "
                               f"{peer_version}: run the same DeepFreeze version on both sides")
    return _plain(error_reply(err), peer_version if 0 < peer_version < 1 << 16 else VERSION)


def _nonce_of(header: Mapping[str, Any], key: str) -> bytes | None:
    v = header.get(key)
    if not isinstance(v, str) or len(v) != 2 * _NONCE:
        return None
    try:
        return bytes.fromhex(v)
    except ValueError:
        return None


def _recv_plain(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    raw = _read(sock, _FRAME.size, deadline, "the handshake")
    magic, version, flags, hlen, plen = _FRAME.unpack(raw)
    if magic == MAGIC and version != VERSION and hlen <= _MAX_AUTH_HEADER and plen == 0:
        try:  # an older/newer peer's refusal in its own format: show its words, then name both versions
            peer_says = _parse_header(sock, _read(sock, hlen, deadline, "the handshake")).get("error")
        except DeepFreezeError:
            peer_says = None
        raise _lost(ProtocolVersionError, f"{_peer(sock)} speaks DeepFreeze network protocol version {version}, this "
                                          f"side {VERSION}: run the same DeepFreeze version on both sides"
                                          + (f" (it said: {peer_says!s:.300})" if peer_says else ""))
    _check_fixed(sock, raw, _MAX_AUTH_HEADER, 0)
    if flags & _FLAG_MAC:
        raise _lost(ProviderError, f"{_peer(sock)} sent a sealed frame in the handshake: not a DeepFreeze peer")
    return _parse_header(sock, _read(sock, hlen, deadline, "the handshake"))


def _send_plain(sock: socket.socket, header: Mapping[str, Any], deadline: float | None) -> None:
    try:
        sock.settimeout(_left(deadline, sock, "sending to"))
        sock.sendall(_plain(header))
    except (socket.timeout, TimeoutError) as e:
        raise _lost(ProviderTimeoutError, f"{_peer(sock)} did not take the handshake in time") from e
    except OSError as e:
        raise _lost(ProviderError, f"lost the connection to {_peer(sock)} in the handshake: {e.strerror or e}") from e


def client_handshake(sock: socket.socket, token: str, hello: Mapping[str, Any], *, deadline: float,
                     max_header: int = MAX_HEADER) -> tuple[Channel, dict[str, Any]]:
    """Authenticate both ends on a fresh connection, then send ``hello`` sealed and return
    ``(channel, the server's answer)`` (its error raised).

    The server must prove it knows the token before anything else is sent: one that does not
    (a planted or wrong server) gets only a random nonce, and :class:`AuthenticationError` is
    raised. Another protocol version: :class:`~deepfreeze.errors.ProtocolVersionError`."""
    nc = secrets.token_bytes(_NONCE)
    peer = _peer(sock)
    _send_plain(sock, {"df": "auth", "protocol": VERSION, "nonce": nc.hex()}, deadline)
    try:
        rep = _recv_plain(sock, deadline)
    except PeerClosedError as e:  # an older server closes on a frame version it does not know
        raise _lost(PeerClosedError, f"{peer} closed the connection in the handshake (protocol version {VERSION} "
                                     "here: an older DeepFreeze there? or it refused this connection)",
                    received=e.received, expected=e.expected) from e
    if rep.get("ok") is False:
        raise_for_reply(rep, f"{peer}: ")
    ns = _nonce_of(rep, "nonce")
    proof = _nonce_of(rep, "proof")
    if rep.get("df") != "challenge" or ns is None or proof is None or ns == nc:
        raise _lost(ProviderError, f"{peer} answered the handshake with something else than a DeepFreeze challenge: "
                                   "not a DeepFreeze server of this version")
    if not hmac.compare_digest(proof, _proof(token, b"server", nc, ns)):
        raise AuthenticationError(f"{peer} did not prove that it knows the token: it is not the server you meant (a "
                                  "planted or stale endpoint?) or it uses another token. Nothing was sent to it; "
                                  f"check the endpoint and use the same token (file or ${TOKEN_ENV}) on both sides")
    _send_plain(sock, {"df": "proof", "proof": _proof(token, b"client", nc, ns).hex()}, deadline)
    c2s, s2c = _session_keys(token, nc, ns)
    ch = Channel(sock, c2s, s2c, "client")
    ch.send(hello, deadline=deadline)
    reply = ch.recv(max_header=max_header, max_payload=0, deadline=deadline)
    return ch, dict(raise_for_reply(reply.header, f"{peer}: "))


class _ServerAuth:
    """The server's side of the handshake as a state machine fed with bytes (for :class:`Acceptor`,
    which drives many at once without a thread each, and :func:`server_handshake`)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.buf = bytearray()
        self.need = _FRAME.size
        self.stage = 1  # 1: waiting for "auth", 2: for "proof", 3: done
        self.nc = self.ns = b""
        self.error: BaseException | None = None  # set: refused; `out` holds the refusal (maybe)

    def want(self) -> int:
        return self.need - len(self.buf)

    def feed(self, data: bytes, peer: str) -> bytes:
        """Take received bytes; returns bytes to send (possibly empty). Sets ``error`` when the peer
        is refused (the refusal frame returned), ``stage`` 3 when authenticated."""
        self.buf += data
        if len(self.buf) < self.need:
            return b""
        if self.need == _FRAME.size:
            magic, version, flags, hlen, plen = _FRAME.unpack(self.buf[:_FRAME.size])
            if magic != MAGIC:
                self.error = ProviderError(f"{peer} sent something that is not a DeepFreeze message")
                return b""
            if version != VERSION:
                self.error = ProtocolVersionError(f"{peer} speaks DeepFreeze network protocol version {version}, "
                                                  f"this side {VERSION}")
                return _version_refusal(version)
            if flags or plen or hlen > _MAX_AUTH_HEADER:
                self.error = ProviderError(f"{peer} sent a handshake frame out of bounds")
                return b""
            self.need = _FRAME.size + hlen
            if len(self.buf) < self.need:
                return b""
        try:
            header = bounded_loads(self.buf[_FRAME.size:self.need], "handshake", max_bytes=_MAX_AUTH_HEADER,
                                   error=ProviderError)
        except ProviderError:
            header = None
        rest = self.buf[self.need:]
        self.buf, self.need = bytearray(), _FRAME.size
        if not isinstance(header, dict) or rest:
            self.error = ProviderError(f"{peer} sent a malformed handshake")
            return b""
        if self.stage == 1:
            nc = _nonce_of(header, "nonce")
            if header.get("df") != "auth" or nc is None:
                if "token" in header or header.get("op") == "hello":
                    self.error = ProtocolVersionError(f"{peer} sent an old-style hello: it speaks an older DeepFreeze "
                                                      f"network protocol than version {VERSION}")
                    return b""
                self.error = ProviderError(f"{peer} did not start with a DeepFreeze handshake")
                return b""
            self.nc, self.ns = nc, secrets.token_bytes(_NONCE)
            self.stage = 2
            return _plain({"df": "challenge", "protocol": VERSION, "nonce": self.ns.hex(),
                           "proof": _proof(self.token, b"server", self.nc, self.ns).hex()})
        proof = _nonce_of(header, "proof")
        if header.get("df") != "proof" or proof is None or not hmac.compare_digest(
                proof, _proof(self.token, b"client", self.nc, self.ns)):
            self.error = AuthenticationError(f"{peer} did not prove that it knows the token: refused (use the token "
                                             f"of the server's token file or ${TOKEN_ENV} on the client)")
            return _plain(error_reply(AuthenticationError("wrong or missing token: use the token of the server's "
                                                          f"token file (or ${TOKEN_ENV}) on the client")))
        self.stage = 3
        return b""

    def channel(self, sock: socket.socket) -> Channel:
        c2s, s2c = _session_keys(self.token, self.nc, self.ns)
        return Channel(sock, s2c, c2s, "server")


def server_authenticate(sock: socket.socket, token: str, *, deadline: float) -> Channel:
    """The server's side of the handshake on one connection, blocking until ``deadline``: the
    authenticated :class:`Channel`, or :class:`AuthenticationError` (a refusal was sent; close
    the connection), :class:`ProtocolVersionError`, :class:`ProviderError`."""
    auth, peer = _ServerAuth(token), _peer(sock)
    while auth.stage != 3:
        out = auth.feed(bytes(_read(sock, auth.want(), deadline, "the handshake")), peer)
        if out:
            try:
                sock.settimeout(_left(deadline, sock, "sending to"))
                sock.sendall(out)
            except OSError:
                if auth.error is None:
                    raise
        if auth.error is not None:
            raise auth.error
    return auth.channel(sock)


def server_handshake(sock: socket.socket, token: str, *, deadline: float,
                     max_header: int = MAX_HEADER) -> tuple[Channel, dict[str, Any]]:
    """:func:`server_authenticate`, then the client's first sealed frame (its hello, no
    payload): ``(channel, hello header)``."""
    ch = server_authenticate(sock, token, deadline=deadline)
    return ch, dict(ch.recv(max_header=max_header, max_payload=0, deadline=deadline).header)


class Acceptor:
    """The bounded pre-authentication stage of a server: one thread (``name``) accepts on
    ``listener`` and drives every unauthenticated connection's handshake with ``poll``-style
    readiness (no thread per connection), each within ``handshake_timeout`` seconds of its
    accept. At most ``max_pending`` connections wait in the handshake: when another arrives,
    the oldest waiting one is closed. Each authenticated connection is handed to
    ``on_ready(channel)``, in this thread (it must not block: start a thread or refuse there).
    Idle, slow (a byte at a time) or token-less connections hold only a pending slot until
    their deadline, so a client that knows the token gets through within the deadline."""

    def __init__(self, listener: socket.socket, token: str, on_ready: Any, *, name: str,
                 handshake_timeout: float = 5.0, max_pending: int = 64, log: Any = None) -> None:
        import collections
        import logging
        import selectors
        if not handshake_timeout > 0 or not (isinstance(max_pending, int) and max_pending >= 1):
            raise ConfigError("handshake_timeout and max_pending must be positive")
        self.listener, self.token, self.on_ready = listener, token, on_ready
        self.handshake_timeout, self.max_pending = float(handshake_timeout), max_pending
        self.log = log or logging.getLogger("deepfreeze.net")
        self.dropped = 0  #: unauthenticated connections closed (pool full, deadline, refused)
        self.refused = 0  #: connections that failed the handshake
        self._pending: "collections.OrderedDict[socket.socket, list]" = collections.OrderedDict()
        self._sel = selectors.DefaultSelector()
        self._stop_r, self._stop_w = os.pipe()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._selectors = selectors
        self._last_warn = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Connections in the handshake right now."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the thread and close every pending connection (not the listener)."""
        try:
            os.write(self._stop_w, b"\0")
        except OSError:
            return
        self._thread.join(10.0)
        for fd in (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _drop(self, conn: socket.socket, why: str) -> None:
        st = self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if st is not None and why:
            self.dropped += 1
            now = time.monotonic()
            if now - self._last_warn > 60.0:  # one line a minute, not one per connection of a flood
                self._last_warn = now
                self.log.warning("%s: closed an unauthenticated connection from %s (%s); %d so far (at most one "
                                 "such line a minute)", self._thread.name, st[3], why, self.dropped)

    def _loop(self) -> None:
        sel, EV_R, EV_W = self._sel, self._selectors.EVENT_READ, self._selectors.EVENT_WRITE
        try:
            while True:
                now = time.monotonic()
                while self._pending:
                    conn, st = next(iter(self._pending.items()))
                    if st[0] > now:
                        break
                    self._drop(conn, f"no handshake within {self.handshake_timeout:g}s")
                timeout = None
                if self._pending:
                    timeout = max(0.0, next(iter(self._pending.values()))[0] - now)
                for key, ev in sel.select(timeout):
                    if key.data == "stop":
                        return
                    if key.data == "listen":
                        self._accept()
                        continue
                    conn = key.fileobj
                    st = self._pending.get(conn)  # type: ignore[call-overload]
                    if st is not None:
                        self._step(conn, st, ev, EV_R, EV_W)
        except Exception:  # a bug: say so once; the server stops accepting
            self.log.exception("%s: the accept loop failed", self._thread.name)
        finally:
            for conn in list(self._pending):
                self._drop(conn, "")
            sel.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of descriptors: say so (rate-limited), free one, retry later
                now = time.monotonic()
                if now - self._last_warn > 60.0:
                    self._last_warn = now
                    self.log.warning("%s: accept failed: %s", self._thread.name, e)
                if self._pending:
                    self._drop(next(iter(self._pending)), f"accept failed ({e.strerror or e}): the oldest goes")
                else:
                    time.sleep(0.05)  # the listener stays readable: do not spin
                return
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending)), f"{self.max_pending} connections were waiting in the "
                                                      "handshake: the oldest goes")
            conn.setblocking(False)
            peer = format_address(*addr[:2]) if isinstance(addr, tuple) else "the peer"
            # [deadline, auth state, bytes to send, peer]
            self._pending[conn] = [time.monotonic() + self.handshake_timeout, _ServerAuth(self.token), b"", peer]
            self._sel.register(conn, self._selectors.EVENT_READ)

    def _step(self, conn: socket.socket, st: list, ev: int, EV_R: int, EV_W: int) -> None:
        auth: _ServerAuth = st[1]
        try:
            if ev & EV_R and not st[2]:
                data = conn.recv(max(1, auth.want()))
                if not data:
                    self._drop(conn, "")
                    return
                st[2] += auth.feed(data, st[3])
            if st[2]:
                n = conn.send(st[2])
                st[2] = st[2][n:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, "")
            return
        if auth.error is not None:  # refused (what of the refusal did not fit in the socket buffer is lost)
            self.refused += 1
            self._drop(conn, f"refused: {auth.error}")
            return
        if st[2]:
            self._sel.modify(conn, EV_W)
            return
        self._sel.modify(conn, EV_R)
        if auth.stage == 3:
            del self._pending[conn]
            self._sel.unregister(conn)
            conn.setblocking(True)
            try:
                self.on_ready(auth.channel(conn))
            except Exception:
                self.log.exception("%s: handing over an authenticated connection failed", self._thread.name)
                conn.close()
