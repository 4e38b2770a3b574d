"""Tokens, listening sockets and framed messages: the one small network module of DeepFreeze.

Used by the repository providers (``deepfreeze repo serve``) and meant for every other DeepFreeze
service that listens on TCP. It knows nothing about what is sent.

**Tokens.** Every connection presents a shared secret. :func:`load_token` takes it from an
explicit file, else the environment variable ``DEEPFREEZE_TOKEN``, else ``~/.deepfreeze/token``.
A token file must be a regular file owned by the user with mode ``0600`` (anything else is
refused, saying what to do); :func:`create_token` makes one (32 random bytes, hex, created with
``O_EXCL`` in a ``0700`` directory). Tokens are compared with :func:`hmac.compare_digest`.

**Listening.** :func:`listen` binds to a loopback address only, unless ``allow_remote=True``
(then the token is all that keeps others out: use it on a trusted network).

**Frames.** Every message, in both directions, is one frame (little-endian)::

    magic b"DFNM", version u16 (1), flags u16 (0), header length u32, payload length u64
    header: UTF-8 JSON object (never pickle), at most ``max_header`` bytes
    payload: raw bytes, at most ``max_payload`` bytes

Both lengths are checked against the receiver's limits *before* anything is allocated or read;
the payload is received straight into the caller's buffers (:meth:`Message.recv_into`), never
through an intermediate ``bytes``. Every wait has a deadline: past it
:class:`~deepfreeze.errors.ProviderTimeoutError`; a peer that closes or sends something that
is not a frame: :class:`~deepfreeze.errors.ProviderError`.

**Handshake.** The first frame of a connection is the client's ``hello``, whose header carries
``"token"``; :func:`server_handshake` compares it in constant time and, when it is missing or
wrong, answers ``{"ok": false, "type": "AuthenticationError", ...}`` and raises
:class:`~deepfreeze.errors.AuthenticationError` (the caller closes the connection).

**Errors on the wire.** An error answer is ``{"ok": false, "type": "<class name>", "error":
"<message>"}``; :func:`raise_for_reply` raises the named :mod:`deepfreeze.errors` class on the
other side (only classes of that module; any other name becomes a ``ProviderError``).
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import secrets
import select
import socket
import stat
import struct
import time
from typing import Any, Iterable, Mapping

from . import errors as _errors
from . import ownership
from .errors import (AuthenticationError, ConfigError, DeepFreezeError, ProviderError, ProviderTimeoutError,
                     UnsafePathError, UntrustedOwnerError)

__all__ = ["TOKEN_ENV", "DEFAULT_TOKEN_PATH", "MAGIC", "VERSION", "MAX_HEADER", "default_token_path",
           "create_token", "load_token", "check_token", "parse_address", "format_address", "is_loopback",
           "listen", "connect", "send_msg", "recv_msg", "wait_readable", "Message", "error_reply",
           "raise_for_reply", "server_handshake", "client_handshake", "is_transport_error", "keepalive", "node_id"]

#: environment variable holding the token (takes precedence over the default file)
TOKEN_ENV = "DEEPFREEZE_TOKEN"
#: where :func:`create_token` and :func:`load_token` look by default
DEFAULT_TOKEN_PATH = "~/.deepfreeze/token"
MAGIC = b"DFNM"
VERSION = 1
_FRAME = struct.Struct("<4sHHIQ")
#: default bound of a frame's JSON header
MAX_HEADER = 1 << 20
_MAX_TOKEN = 1024
_CHUNK = 64 << 20  # largest single send/recv call (keeps each call's wait short and bounded)


# ----------------------------------------------------------------------------- tokens

def node_id() -> str:
    """This machine's boot id (same node <=> same boot id; the host name where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(100).strip()
    except OSError:
        return socket.gethostname()


def default_token_path() -> str:
    """``~/.deepfreeze/token`` expanded."""
    return os.path.expanduser(DEFAULT_TOKEN_PATH)


def create_token(path: str | None = None) -> str:
    """Create a new token file (``0600``, ``O_EXCL``: an existing file is never overwritten) holding
    32 random bytes in hex; its directory is created ``0700`` when missing. Returns the token.
    ``FileExistsError`` if the file exists (remove it first to rotate the token)."""
    path = os.path.abspath(os.path.expanduser(path or default_token_path()))
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d, 0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise UntrustedOwnerError(f"{d} (the token's directory) is not a directory of yours: refusing to put a "
                                  "secret there; choose another path")
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return token


def _valid_token(tok: str, where: str) -> str:
    tok = tok.strip()
    if not tok or len(tok) > _MAX_TOKEN or not tok.isascii() or not tok.isprintable():
        raise AuthenticationError(f"the token in {where} is empty, longer than {_MAX_TOKEN} characters or not "
                                  "printable ASCII; create a new one with deepfreeze.net.create_token()")
    return tok


def load_token(path: str | None = None) -> str:
    """The token: from ``path`` when given, else ``$DEEPFREEZE_TOKEN``, else ``~/.deepfreeze/token``.

    A token file must be a regular file (not a link) owned by you with no group/other permission:
    :class:`UntrustedOwnerError` for another owner, :class:`AuthenticationError` for loose modes or
    no token at all (the message says how to fix it)."""
    if path is None:
        env = os.environ.get(TOKEN_ENV)
        if env:
            return _valid_token(env, f"${TOKEN_ENV}")
        path = default_token_path()
        if not os.path.lexists(path):
            raise AuthenticationError(
                f"no token: {TOKEN_ENV} is not set and {path} does not exist. Create one with "
                f"'python -c \"import deepfreeze.net as n; n.create_token()\"' (or set {TOKEN_ENV}) and use the "
                "same token on every client and provider")
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

def _lost(cls: type, message: str) -> DeepFreezeError:
    """An error of the connection itself (see :func:`is_transport_error`)."""
    e = cls(message)
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


def send_msg(sock: socket.socket, header: Mapping[str, Any], payload: Iterable[Any] = (), *,
             deadline: float | None = None) -> None:
    """Send one frame: ``header`` as JSON, then the ``payload`` buffers (contiguous, any buffer
    protocol object; numpy arrays via ``deepfreeze.format.byte_view``) back to back, unjoined.
    Past ``deadline`` (``time.monotonic()``): :class:`ProviderTimeoutError`; a closed peer:
    :class:`ProviderError`."""
    hdr = json.dumps(header, separators=(",", ":")).encode()
    bufs = [_bytes_of(b) for b in payload]
    total = sum(b.nbytes for b in bufs)
    try:
        sock.settimeout(_left(deadline, sock, "sending to"))
        sock.sendall(_FRAME.pack(MAGIC, VERSION, 0, len(hdr), total) + hdr)
        for b in bufs:
            for pos in range(0, b.nbytes, _CHUNK):
                sock.settimeout(_left(deadline, sock, "sending to"))
                sock.sendall(b[pos:pos + _CHUNK])
    except (socket.timeout, TimeoutError) as e:
        raise _lost(ProviderTimeoutError,
                    f"{_peer(sock)} did not take our message in time (stopped or overloaded?)") from e
    except OSError as e:
        raise _lost(ProviderError, f"lost the connection to {_peer(sock)} while sending: {e.strerror or e}") from e


def _recv_exact(sock: socket.socket, mv: memoryview, deadline: float | None, what: str) -> None:
    pos, n = 0, mv.nbytes
    try:
        while pos < n:
            sock.settimeout(_left(deadline, sock, f"waiting for {what} from"))
            got = sock.recv_into(mv[pos:pos + _CHUNK])
            if not got:
                raise _lost(ProviderError, f"{_peer(sock)} closed the connection in the middle of {what} "
                                           f"({pos} of {n} bytes)")
            pos += got
    except (socket.timeout, TimeoutError) as e:
        raise _lost(ProviderTimeoutError, f"{_peer(sock)} sent {pos} of {n} bytes of {what} and then nothing in "
                                          "time (stopped, hung or gone?)") from e
    except ProviderError:
        raise
    except OSError as e:
        raise _lost(ProviderError,
                    f"lost the connection to {_peer(sock)} while receiving {what}: {e.strerror or e}") from e


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has data (or EOF) within ``timeout`` seconds."""
    r, _, _ = select.select([sock], [], [], max(0.0, timeout))
    return bool(r)


class Message:
    """A received frame: ``header`` (a dict) and ``payload_bytes`` still to be read from the socket.

    The payload must be consumed in order: :meth:`recv_into` caller buffers, :meth:`read` small
    pieces, :meth:`discard` the rest (:meth:`finish`). Every read keeps the frame's deadline."""

    def __init__(self, sock: socket.socket, header: dict[str, Any], payload_bytes: int,
                 deadline: float | None) -> None:
        self.sock, self.header, self.payload_bytes, self.deadline = sock, header, payload_bytes, deadline
        self.remaining = payload_bytes

    def recv_into(self, buf: Any) -> None:
        """Fill ``buf`` (a writable contiguous buffer: numpy array, bytearray, memoryview) entirely
        from the payload; :class:`ProviderError` if the payload has fewer bytes left."""
        mv = _bytes_of(buf)
        if mv.readonly:
            raise ValueError("recv_into needs a writable buffer")
        if mv.nbytes > self.remaining:
            raise _lost(ProviderError, f"{_peer(self.sock)} sent a payload of {self.payload_bytes} bytes, fewer "
                                       "than its header announces")
        _recv_exact(self.sock, mv, self.deadline, "a message payload")
        self.remaining -= mv.nbytes

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


def recv_msg(sock: socket.socket, *, max_header: int = MAX_HEADER, max_payload: int = 0,
             deadline: float | None = None) -> Message:
    """Receive one frame's header (the payload stays on the socket: see :class:`Message`).

    The magic, the version and both lengths are checked before anything else is read or
    allocated: a header over ``max_header`` or a payload over ``max_payload`` bytes, a header that
    is not a JSON object: :class:`ProviderError` (the connection cannot be resynchronized: close
    it). Past ``deadline``: :class:`ProviderTimeoutError`; EOF: :class:`ProviderError`."""
    raw = bytearray(_FRAME.size)
    _recv_exact(sock, memoryview(raw), deadline, "a message")
    magic, version, _flags, hlen, plen = _FRAME.unpack(raw)
    if magic != MAGIC:
        raise _lost(ProviderError,
                    f"{_peer(sock)} sent something that is not a DeepFreeze message (magic {bytes(magic)!r})")
    if version != VERSION:
        raise _lost(ProviderError, f"{_peer(sock)} speaks message version {version}, this side {VERSION}: run the "
                                   "same DeepFreeze version on both sides")
    if hlen > max_header:
        raise _lost(ProviderError, f"{_peer(sock)} announced a message header of {hlen} bytes, over the limit "
                                   f"of {max_header}: refused")
    if plen > max_payload:
        raise _lost(ProviderError, f"{_peer(sock)} announced a payload of {plen} bytes, over the limit of "
                                   f"{max_payload} for this connection: refused")
    hbuf = bytearray(hlen)
    _recv_exact(sock, memoryview(hbuf), deadline, "a message header")
    try:
        header = json.loads(hbuf.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _lost(ProviderError, f"{_peer(sock)} sent a message header that is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise _lost(ProviderError, f"{_peer(sock)} sent a message header that is not a JSON object")
    return Message(sock, header, plen, deadline)


# ----------------------------------------------------------------------------- replies and handshake

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
    cls = getattr(_errors, name, None) if isinstance(name, str) and name in _errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, DeepFreezeError)):
        cls = ProviderError
    raise cls(f"{where}{msg if isinstance(msg, str) else 'error without a message'}")


def server_handshake(sock: socket.socket, token: str, *, deadline: float,
                     max_header: int = MAX_HEADER) -> dict[str, Any]:
    """Read the client's first frame and check its ``"token"`` in constant time. Returns that
    header without the token. A missing or wrong token: an ``AuthenticationError`` answer, then
    :class:`AuthenticationError` raised (close the connection). A payload is not allowed."""
    msg = recv_msg(sock, max_header=max_header, max_payload=0, deadline=deadline)
    header = dict(msg.header)
    presented = header.pop("token", None)
    if not check_token(presented, token):
        err = AuthenticationError("wrong or missing token: use the token of the server's token file "
                                  f"(or ${TOKEN_ENV}) on the client")
        try:
            send_msg(sock, error_reply(err), deadline=deadline)
        except ProviderError:
            pass
        raise err
    return header


def client_handshake(sock: socket.socket, token: str, hello: Mapping[str, Any], *, deadline: float,
                     max_header: int = MAX_HEADER) -> dict[str, Any]:
    """Send ``hello`` with the token, return the server's answer (its error raised)."""
    send_msg(sock, {**hello, "token": token}, deadline=deadline)
    reply = recv_msg(sock, max_header=max_header, max_payload=0, deadline=deadline)
    return dict(raise_for_reply(reply.header, f"{_peer(sock)}: "))
