"""deepfreeze.net: token files, the token handshake, loopback-only listening, bounded frames."""
import json
import os
import socket
import stat
import struct
import threading
import time

import numpy as np
import pytest

from deepfreeze import net
from deepfreeze.errors import (AuthenticationError, ConfigError, ModelNotFoundError, ProviderError,
                               ProviderTimeoutError, UntrustedOwnerError)


def test_create_token_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / "sub" / "token"
    tok = net.create_token(str(path))
    assert len(tok) == 64 and int(tok, 16) >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert net.load_token(str(path)) == tok
    with pytest.raises(FileExistsError):
        net.create_token(str(path))
    assert net.load_token(str(path)) == tok


def test_load_token_order_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(net.TOKEN_ENV, raising=False)
    with pytest.raises(AuthenticationError, match="create_token"):
        net.load_token()
    tok = net.create_token()  # the default file
    assert (tmp_path / ".deepfreeze" / "token").exists()
    assert net.load_token() == tok
    monkeypatch.setenv(net.TOKEN_ENV, "from-the-environment")
    assert net.load_token() == "from-the-environment"
    assert net.load_token(str(tmp_path / ".deepfreeze" / "token")) == tok  # an explicit path first


def test_load_token_refuses_loose_mode_links_and_other_owners(tmp_path):
    path = tmp_path / "token"
    net.create_token(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(AuthenticationError, match="chmod 600"):
        net.load_token(str(path))
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(AuthenticationError, match="symbolic link"):
        net.load_token(str(link))
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        with pytest.raises(UntrustedOwnerError, match="not by you"):
            net.load_token(str(path))


def test_check_token_constant_time_compare():
    assert net.check_token("abc", "abc")
    assert not net.check_token("abd", "abc")
    assert not net.check_token(None, "abc")
    assert not net.check_token("ab\u00e9", "abc")


def test_parse_address():
    assert net.parse_address("127.0.0.1:7000") == ("127.0.0.1", 7000)
    assert net.parse_address("[::1]:80") == ("::1", 80)
    for bad in ("noport", "h:", "h:99999", ":80", "h:-1"):
        with pytest.raises(ConfigError):
            net.parse_address(bad)


def test_listen_refuses_non_loopback_unless_allowed():
    with pytest.raises(ConfigError, match="allow_remote"):
        net.listen("0.0.0.0", 0)
    s = net.listen("0.0.0.0", 0, allow_remote=True)
    s.close()
    s = net.listen("127.0.0.1", 0)
    assert s.getsockname()[0] == "127.0.0.1"
    s.close()


def _server(token, results):
    """A one-connection server: handshake, then echo one message's payload length."""
    lsock = net.listen("127.0.0.1", 0)

    def run():
        conn, _ = lsock.accept()
        try:
            hello = net.server_handshake(conn, token, deadline=time.monotonic() + 5)
            results.append(("hello", hello))
            net.send_msg(conn, {"ok": True}, deadline=time.monotonic() + 5)
            msg = net.recv_msg(conn, max_payload=1 << 20, deadline=time.monotonic() + 5)
            buf = np.empty(msg.payload_bytes // 4, np.float32)
            msg.recv_into(buf)
            net.send_msg(conn, {"ok": True, "sum": float(buf.sum())}, [buf], deadline=time.monotonic() + 5)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append(("error", e))
        finally:
            conn.close()
            lsock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return net.format_address(*lsock.getsockname()[:2]), t


def test_handshake_accepts_the_token_and_payload_lands_in_caller_buffers():
    results = []
    addr, t = _server("secret", results)
    s = net.connect(addr, 5)
    reply = net.client_handshake(s, "secret", {"op": "hello", "x": 1}, deadline=time.monotonic() + 5)
    assert reply == {"ok": True}
    data = np.arange(1000, dtype=np.float32)
    net.send_msg(s, {"op": "sum"}, [data], deadline=time.monotonic() + 5)
    msg = net.recv_msg(s, max_payload=1 << 20, deadline=time.monotonic() + 5)
    assert msg.header["sum"] == float(data.sum())
    back = np.zeros(1000, np.float32)
    msg.recv_into(back)
    assert np.array_equal(back, data) and msg.remaining == 0
    s.close()
    t.join(5)
    assert results[0] == ("hello", {"op": "hello", "x": 1})  # the token is not passed on


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_refused(token):
    results = []
    addr, t = _server("secret", results)
    s = net.connect(addr, 5)
    hello = {"op": "hello"} if token is None else {"op": "hello", "token": token}
    net.send_msg(s, hello, deadline=time.monotonic() + 5)
    reply = net.recv_msg(s, deadline=time.monotonic() + 5)
    with pytest.raises(AuthenticationError, match="token"):
        net.raise_for_reply(reply.header)
    assert s.recv(1) == b""  # and the server closed the connection
    s.close()
    t.join(5)
    assert isinstance(results[0][1], AuthenticationError)


def _frame(hlen, plen, magic=net.MAGIC, version=net.VERSION):
    return struct.pack("<4sHHIQ", magic, version, 0, hlen, plen)


@pytest.mark.parametrize("data,limits,match", [
    (_frame(1 << 31, 0), {"max_header": 1 << 20}, "header of 2147483648 bytes"),  # a 2 GiB header
    (_frame(2, 1 << 50) + b"{}", {"max_payload": 1 << 30}, "payload of 1125899906842624 bytes"),
    (_frame(2, 0, magic=b"HTTP") + b"{}", {}, "not a DeepFreeze message"),
    (_frame(2, 0, version=99) + b"{}", {}, "version 99"),
    (_frame(3, 0) + b"[1]", {}, "not a JSON object"),
    (_frame(2, 0) + b"\xff\xfe", {}, "not valid JSON"),
    (_frame(100000, 0) + b"[" * 100000, {"max_header": 1 << 20}, "not valid JSON"),  # nesting bomb
])
def test_oversize_or_malformed_frames_refused_before_allocating(data, limits, match):
    """Each refusal happens before the announced sizes are allocated or read (the connection is
    then out of step: the caller closes it, so each case gets a fresh one)."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        with pytest.raises(ProviderError, match=match) as ei:
            net.recv_msg(b, deadline=time.monotonic() + 5, **limits)
        assert net.is_transport_error(ei.value)


def test_silent_or_dead_peer_is_a_bounded_error():
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        with pytest.raises(ProviderTimeoutError):  # a peer that sends nothing
            net.recv_msg(b, deadline=time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 5
        hdr = json.dumps({"op": "x"}).encode()
        a.sendall(_frame(len(hdr), 100) + hdr + b"x" * 10)  # 10 of 100 payload bytes, then silence
        msg = net.recv_msg(b, max_payload=100, deadline=time.monotonic() + 0.3)
        with pytest.raises(ProviderTimeoutError, match="10 of 100"):
            msg.recv_into(bytearray(100))
        assert net.is_transport_error(ProviderTimeoutError("x")) is False
    a, b = socket.socketpair()
    with b:
        a.sendall(_frame(100, 0) + b"{")  # then the peer dies
        a.close()
        with pytest.raises(ProviderError, match="closed the connection") as ei:
            net.recv_msg(b, deadline=time.monotonic() + 5)
        assert net.is_transport_error(ei.value)


def test_a_peer_that_stops_reading_is_a_bounded_error():
    a, b = socket.socketpair()
    with a, b:
        big = np.zeros(64 << 20, np.uint8)  # more than the socket buffers hold; b never reads
        with pytest.raises(ProviderTimeoutError):
            net.send_msg(a, {"op": "x"}, [big], deadline=time.monotonic() + 0.5)


def test_raise_for_reply_maps_only_deepfreeze_errors():
    with pytest.raises(ModelNotFoundError, match="nope"):
        net.raise_for_reply({"ok": False, "type": "ModelNotFoundError", "error": "nope"})
    with pytest.raises(ProviderError, match="boom"):
        net.raise_for_reply({"ok": False, "type": "SystemExit", "error": "boom"})
    with pytest.raises(ProviderError):
        net.raise_for_reply({"ok": False, "type": "os", "error": 3})
    assert net.raise_for_reply({"ok": True, "a": 1}) == {"ok": True, "a": 1}


def test_listen_on_a_busy_port_is_a_clear_error():
    s = net.listen("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1"):
            net.listen("127.0.0.1", s.getsockname()[1])
    finally:
        s.close()
