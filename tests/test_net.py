"""deepfreeze.net: token files, the mutual handshake, sealed frames, loopback-only listening, bounded frames."""
import json
import os
import re
import socket
import stat
import struct
import threading
import time

import numpy as np
import pytest

from deepfreeze import net
from deepfreeze.errors import (AuthenticationError, ConfigError, FrameAuthenticationError, ModelNotFoundError,
                               ProtocolVersionError, ProviderError, ProviderTimeoutError, UntrustedOwnerError)


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
    monkeypatch.setenv(net.TOKEN_ENV, "from-the-environment-" + "e" * 32)
    assert net.load_token() == "from-the-environment-" + "e" * 32
    assert net.load_token(str(tmp_path / ".deepfreeze" / "token")) == tok  # an explicit path first


def test_token_env_holds_the_token_text_never_a_path(tmp_path, monkeypatch):
    """Issue 41, item 7: $DEEPFREEZE_TOKEN is the token text itself. A value that contains '/',
    names an existing file or is shorter than 32 characters is refused, saying to put the token
    text there (or name the file with DEEPFREEZE_TOKEN_FILE). Before: the path string itself
    became the shared secret, so two ends that set it to a path "agreed" on a public string."""
    monkeypatch.delenv(net.TOKEN_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tok"
    net.create_token(str(path))
    (tmp_path / ("f" * 40)).write_text("x")  # a long name of an existing file, given without '/'
    for value, why in [(str(path), "contains '/'"), ("~/my/token", "contains '/'"),
                       ("f" * 40, "names an existing file"), ("short-secret", "is 12 characters long")]:
        monkeypatch.setenv(net.TOKEN_ENV, value)
        for fn in (net.load_token, net.ensure_token):
            with pytest.raises(AuthenticationError, match=re.escape(why)) as e:
                fn()
            assert "the token text itself" in str(e.value) and net.TOKEN_FILE_ENV in str(e.value)
            assert value not in str(e.value)  # the value is not echoed (it may be a secret)
    monkeypatch.setenv(net.TOKEN_ENV, "a" * 32)  # the text of a token: taken as it is
    assert net.load_token() == net.ensure_token() == "a" * 32


def test_token_file_env_names_a_file_read_safely(tmp_path, monkeypatch):
    """Issue 41, item 7: DEEPFREEZE_TOKEN_FILE names a token file (when DEEPFREEZE_TOKEN is unset),
    read with the token file rule: yours, mode 0600, never through a link; never created."""
    monkeypatch.delenv(net.TOKEN_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no default token file
    path = tmp_path / "tok"
    tok = net.create_token(str(path))
    monkeypatch.setenv(net.TOKEN_FILE_ENV, str(path))
    assert net.load_token() == net.ensure_token() == tok
    os.chmod(path, 0o640)
    with pytest.raises(AuthenticationError, match="chmod 600"):
        net.load_token()
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    monkeypatch.setenv(net.TOKEN_FILE_ENV, str(link))
    with pytest.raises(AuthenticationError, match="symbolic link"):
        net.load_token()
    monkeypatch.setenv(net.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(AuthenticationError, match="cannot read the token file"):
        net.ensure_token()
    assert not (tmp_path / "missing").exists() and not (tmp_path / "home").exists()
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, 65534)
        monkeypatch.setenv(net.TOKEN_FILE_ENV, str(path))
        with pytest.raises(UntrustedOwnerError, match="not by you"):
            net.load_token()


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
            conn, hello = net.server_handshake(conn, token, deadline=time.monotonic() + 5)
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
    s, reply = net.client_handshake(s, "secret", {"op": "hello", "x": 1}, deadline=time.monotonic() + 5)
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


def test_wrong_token_refused_by_the_client_before_it_sends_anything():
    results = []
    addr, t = _server("secret", results)
    s = net.connect(addr, 5)
    with pytest.raises(AuthenticationError, match="did not prove that it knows the token"):
        net.client_handshake(s, "wrong", {"op": "hello", "secret-stuff": 1}, deadline=time.monotonic() + 5)
    s.close()
    t.join(5)
    assert results[0][0] == "error" and not isinstance(results[0][1], AuthenticationError)  # it got nothing more


@pytest.mark.parametrize("proof", ["00" * 32, "zz", None])
def test_client_without_the_token_refused_by_the_server(proof):
    """A client that cannot make the proof (it does not know the token) gets an unsealed
    AuthenticationError answer and the connection is closed."""
    results = []
    addr, t = _server("secret", results)
    s = net.connect(addr, 5)
    nc = os.urandom(32)
    s.sendall(net._plain({"df": "auth", "protocol": net.VERSION, "nonce": nc.hex()}))
    challenge = net._recv_plain(s, time.monotonic() + 5)
    assert challenge["df"] == "challenge" and "token" not in json.dumps(challenge)
    s.sendall(net._plain({"df": "proof"} if proof is None else {"df": "proof", "proof": proof}))
    reply = net._recv_plain(s, time.monotonic() + 5)
    with pytest.raises(AuthenticationError, match="token"):
        net.raise_for_reply(reply)
    assert s.recv(1) == b""  # and the server closed the connection
    s.close()
    t.join(5)
    assert isinstance(results[0][1], AuthenticationError)


def _pair():
    """Two ends of a session with matching keys (as a handshake would leave them)."""
    a, b = socket.socketpair()
    k1, k2 = os.urandom(32), os.urandom(32)
    return net.Channel(a, k1, k2, "client"), net.Channel(b, k2, k1, "server")


def _frame(hlen, plen, magic=net.MAGIC, version=net.VERSION, flags=1):
    return struct.pack("<4sHHIQ", magic, version, flags, hlen, plen)


def _sealed(ch, hdr: bytes, plen: int = 0) -> bytes:
    """A correctly sealed frame around any header bytes (a token holder that sends garbage)."""
    fixed = _frame(len(hdr), plen)
    tag = ch._header_tag(ch._send_dir, ch._send_key, ch.send_seq, fixed, hdr)
    ch.send_seq += 1
    return fixed + hdr + tag


@pytest.mark.parametrize("data,limits,match", [
    (lambda c: _frame(1 << 31, 0), {"max_header": 1 << 20}, "header of 2147483648 bytes"),  # a 2 GiB header
    (lambda c: _frame(2, 1 << 50) + b"{}", {"max_payload": 1 << 30}, "payload of 1125899906842624 bytes"),
    (lambda c: _frame(2, 0, magic=b"HTTP") + b"{}", {}, "not a DeepFreeze message"),
    (lambda c: _frame(2, 0, version=99) + b"{}", {}, "version 99"),
    (lambda c: _sealed(c, b"[1]"), {}, "not a JSON object"),
    (lambda c: _sealed(c, b"\xff\xfe"), {}, "not valid JSON"),
    (lambda c: _sealed(c, b"[" * 100000), {"max_header": 1 << 20}, "not valid JSON"),  # nesting bomb
    (lambda c: _frame(2, 0, flags=0) + b"{}", {}, "without a MAC"),
    (lambda c: _frame(2, 0) + b"{}" + b"\0" * 32, {}, "failed its MAC"),
])
def test_oversize_or_malformed_frames_refused_before_allocating(data, limits, match):
    """Each refusal happens before the announced sizes are allocated or read (the connection is
    then out of step: the caller closes it, so each case gets a fresh one)."""
    a, b = _pair()
    with a.sock, b.sock:
        a.sock.sendall(data(a))
        with pytest.raises(ProviderError, match=match) as ei:
            net.recv_msg(b, deadline=time.monotonic() + 5, **limits)
        assert net.is_transport_error(ei.value)


def test_silent_or_dead_peer_is_a_bounded_error():
    a, b = _pair()
    with a.sock, b.sock:
        t0 = time.monotonic()
        with pytest.raises(ProviderTimeoutError):  # a peer that sends nothing
            net.recv_msg(b, deadline=time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 5
        a.sock.sendall(_sealed(a, json.dumps({"op": "x"}).encode(), 100) + b"x" * 10)  # 10 of 100, then silence
        msg = net.recv_msg(b, max_payload=100, deadline=time.monotonic() + 0.3)
        with pytest.raises(ProviderTimeoutError, match="10 of 100"):
            msg.recv_into(bytearray(100))
        assert net.is_transport_error(ProviderTimeoutError("x")) is False
    a, b = _pair()
    with b.sock:
        a.sock.sendall(_frame(100, 0) + b"{")  # then the peer dies
        a.close()
        with pytest.raises(ProviderError, match="closed the connection") as ei:
            net.recv_msg(b, deadline=time.monotonic() + 5)
        assert net.is_transport_error(ei.value)


def test_a_peer_that_stops_reading_is_a_bounded_error():
    a, b = _pair()
    with a.sock, b.sock:
        big = np.zeros(64 << 20, np.uint8)  # more than the socket buffers hold; b never reads
        with pytest.raises(ProviderTimeoutError):
            net.send_msg(a, {"op": "x"}, [big], deadline=time.monotonic() + 0.5)


def test_frames_changed_replayed_reordered_dropped_or_injected_are_refused():
    payload = bytes(range(256)) * 64
    a, b = _pair()
    k1, k2 = a._send_key, a._recv_key

    def fresh():  # a new connection of the same session keys (the frames below were sealed with them)
        x, y = socket.socketpair()
        return net.Channel(x, k1, k2, "client"), net.Channel(y, k2, k1, "server")

    with a.sock, b.sock:
        frames = []
        for i in range(3):  # capture what a sender puts on the wire, then replay it through a "relay"
            x, y = socket.socketpair()
            tap = net.Channel(x, a._send_key, a._recv_key, "client")
            tap.send_seq = i
            tap.send({"op": "n", "i": i}, [payload])
            x.shutdown(socket.SHUT_WR)
            y.settimeout(5)
            raw = b""
            while chunk := y.recv(1 << 16):
                raw += chunk
            frames.append(raw)
            x.close()
            y.close()

        def deliver(raw):
            a.sock.sendall(raw)
            msg = b.recv(max_payload=1 << 20, deadline=time.monotonic() + 5)
            out = bytearray(msg.payload_bytes)
            msg.recv_into(out)
            return msg.header, bytes(out)

        assert deliver(frames[0]) == ({"op": "n", "i": 0}, payload)  # the genuine frame passes
        with pytest.raises(FrameAuthenticationError, match="frame 1 .* failed its MAC"):
            deliver(frames[0])  # replayed
    a, b = fresh()
    with a.sock, b.sock:
        a.sock.sendall(frames[1])  # frame 1 first: frame 0 was dropped, or they were swapped
        with pytest.raises(FrameAuthenticationError, match="frame 0 .* failed its MAC"):
            b.recv(max_payload=1 << 20, deadline=time.monotonic() + 5)
    # one payload byte changed on the way: the header passes, the payload's tag does not
    raw = bytearray(frames[0])
    raw[-40] ^= 1
    a, b = fresh()
    with a.sock, b.sock:
        a.sock.sendall(raw)
        msg = b.recv(max_payload=1 << 20, deadline=time.monotonic() + 5)
        with pytest.raises(FrameAuthenticationError, match="payload of frame 0 .* changed"):
            msg.recv_into(bytearray(msg.payload_bytes))
    # one header byte changed (the announced step): refused before the header is used
    raw = bytearray(frames[0])
    raw[raw.index(b'"i":0') + 4] = ord("7")
    a, b = fresh()
    with a.sock, b.sock:
        a.sock.sendall(raw)
        with pytest.raises(FrameAuthenticationError, match="frame 0 .* failed its MAC"):
            b.recv(max_payload=1 << 20, deadline=time.monotonic() + 5)


def test_sealed_frames_round_trip_in_both_directions_in_order():
    a, b = _pair()
    with a.sock, b.sock:
        for i in range(20):
            data = np.arange(i * 1000, dtype=np.int32)
            (a if i % 2 else b).send({"i": i}, [data] if i else [])
            msg = (b if i % 2 else a).recv(max_payload=1 << 20, deadline=time.monotonic() + 5)
            out = np.empty(i * 1000, np.int32)
            msg.recv_into(out)
            assert msg.header == {"i": i} and np.array_equal(out, data)
        assert a.send_seq == b.recv_seq == 10 and b.send_seq == a.recv_seq == 10


def test_protocol_version_mismatch_names_both_versions():
    got = []
    lsock = net.listen("127.0.0.1", 0)
    acc = net.Acceptor(lsock, "secret", got.append, name="test-acceptor", handshake_timeout=5)
    addr = net.format_address(*lsock.getsockname()[:2])
    try:
        s = net.connect(addr, 5)  # a version-1 client: its hello carried the token
        s.sendall(net._plain({"op": "hello", "token": "secret"}, version=1))
        raw = s.recv(1 << 16)
        assert struct.unpack("<4sHHIQ", raw[:20])[1] == 1  # answered in its own frame version ...
        err = json.loads(raw[20:])
        assert err["ok"] is False and "version 2" in err["error"] and "client 1" in err["error"]  # ... naming both
        s.close()
        fake = net.listen("127.0.0.1", 0)  # a server of a later version answering a current client

        def later():
            c, _ = fake.accept()
            with c:
                c.recv(1 << 16)
                c.sendall(net._plain(net.error_reply(ProtocolVersionError("this side speaks 3")), version=3))

        t = threading.Thread(target=later, daemon=True)
        t.start()
        s = net.connect(net.format_address(*fake.getsockname()[:2]), 5)
        with pytest.raises(ProtocolVersionError, match="version 3, this side 2"):
            net.client_handshake(s, "secret", {"op": "hello"}, deadline=time.monotonic() + 5)
        s.close()
        t.join(5)
        fake.close()
        assert got == []
    finally:
        acc.close()
        lsock.close()


def test_acceptor_bounds_unauthenticated_connections():
    """Idle connections cost no thread, wait at most the deadline, and at most max_pending of
    them wait: the oldest goes when another arrives; a token holder still gets through."""
    got = []
    lsock = net.listen("127.0.0.1", 0)
    threads0 = threading.active_count()
    acc = net.Acceptor(lsock, "secret", got.append, name="test-acceptor", handshake_timeout=1.0, max_pending=8)
    addr = net.format_address(*lsock.getsockname()[:2])
    idle = [net.connect(addr, 5) for _ in range(40)]
    try:
        deadline = time.monotonic() + 10
        while acc.dropped < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert acc.dropped >= 32 and acc.pending <= 8  # the oldest 32 closed at once
        assert threading.active_count() == threads0 + 1  # one thread for all of them
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest was closed
        s = net.connect(addr, 5)
        ch = _client_auth(s, "secret")
        assert len(got) == 1 and got[0].role == "server"
        deadline = time.monotonic() + 10
        while acc.pending and time.monotonic() < deadline:  # the rest: closed at their deadline
            time.sleep(0.05)
        assert acc.pending == 0
        idle[-1].settimeout(5)
        assert idle[-1].recv(1) == b""
        ch.close()
    finally:
        for s in idle:
            s.close()
        acc.close()
        lsock.close()


def _client_auth(sock, token):
    """The client's half of the handshake only (the Acceptor reads no hello)."""
    nc = os.urandom(32)
    sock.sendall(net._plain({"df": "auth", "protocol": net.VERSION, "nonce": nc.hex()}))
    rep = net._recv_plain(sock, time.monotonic() + 5)
    ns = bytes.fromhex(rep["nonce"])
    assert bytes.fromhex(rep["proof"]) == net._proof(token, b"server", nc, ns)
    sock.sendall(net._plain({"df": "proof", "proof": net._proof(token, b"client", nc, ns).hex()}))
    c2s, s2c = net._session_keys(token, nc, ns)
    ch = net.Channel(sock, c2s, s2c, "client")
    time.sleep(0.2)  # the acceptor hands it over
    return ch


def test_ensure_token_creates_once_and_loads_after(tmp_path, monkeypatch):
    monkeypatch.delenv(net.TOKEN_ENV, raising=False)
    path = str(tmp_path / "d" / "token")
    tok = net.ensure_token(path)
    assert net.ensure_token(path) == tok == net.load_token(path)
    assert [n for n in os.listdir(tmp_path / "d")] == ["token"]  # no temporary file left
    monkeypatch.setenv(net.TOKEN_ENV, "env-token-" + "0" * 32)
    assert net.ensure_token() == "env-token-" + "0" * 32


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
