"""The TLS module: loopback rules, the CA pin, generated certificates, and real handshakes with them."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography import x509

from fleetserve.tls import (
    CaPin,
    PinMismatch,
    PlainHttpRefused,
    ServerTls,
    ServerTrust,
    TlsError,
    check_plain,
    client_verify,
    default_sans,
    ensure_generated,
    is_loopback,
    listen_tls,
    pinned_ca,
    public_host,
)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("api.localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("192.0.2.7", False),
        ("128.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_loopback_is_127_slash_8_and_the_ipv6_loopback_and_localhost_only(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    "text",
    ["", "sha256:", "sha1:" + "a" * 64, "sha256:" + "a" * 63, "sha256:" + "g" * 64, "a" * 64],
)
def test_a_malformed_pin_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(TlsError, match=r"sha256:<64 hex digits>"):
        CaPin.parse(text)


def test_a_pin_reads_back_as_written_in_either_case() -> None:
    digest = "ab" * 32
    assert str(CaPin.parse(f"sha256:{digest.upper()}")) == f"sha256:{digest}"


# --- generated certificates -----------------------------------------------------------------------


def test_first_start_generates_a_ca_and_a_certificate_with_secret_keys_and_reuses_them(
    tmp_path: Path,
) -> None:
    tls_dir = tmp_path / "tls"
    first = ensure_generated(tls_dir, "server", ["10.1.2.3", "cp.example", "127.0.0.1"])
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((tls_dir / key).stat().st_mode) == 0o600, key
    assert not [p.name for p in tls_dir.iterdir() if p.name.endswith(".tmp")]
    ca = x509.load_pem_x509_certificate((tls_dir / "ca.crt").read_bytes())
    assert first.pin == CaPin.of(ca) and first.ca_pem == (tls_dir / "ca.crt").read_bytes()
    leaf, chained_ca = x509.load_pem_x509_certificates(first.cert_file.read_bytes())
    assert chained_ca == ca and leaf.issuer == ca.subject
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(n.value) for n in names} == {"10.1.2.3", "cp.example", "127.0.0.1"}

    before = {p.name: p.read_bytes() for p in tls_dir.iterdir()}
    again = ensure_generated(tls_dir, "server", ["10.1.2.3", "cp.example"])
    assert (again.cert_file, again.key_file, again.pin, again.ca_pem) == (
        first.cert_file,
        first.key_file,
        first.pin,
        first.ca_pem,
    )
    assert first.names == ("10.1.2.3", "cp.example", "127.0.0.1")
    assert {p.name: p.read_bytes() for p in tls_dir.iterdir()} == before


def test_a_new_name_or_a_near_end_reissues_the_certificate_from_the_same_ca(tmp_path: Path) -> None:
    first = ensure_generated(tmp_path, "server", ["10.1.2.3"])
    old_leaf = first.cert_file.read_bytes()
    widened = ensure_generated(tmp_path, "server", ["10.1.2.3", "10.9.9.9"])
    widened_leaf = widened.cert_file.read_bytes()
    assert widened.pin == first.pin and widened_leaf != old_leaf
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=820)
    renewed = ensure_generated(tmp_path, "server", ["10.1.2.3"], now=later)
    assert renewed.pin == first.pin and renewed.cert_file.read_bytes() != widened_leaf
    leaf = x509.load_pem_x509_certificates(renewed.cert_file.read_bytes())[0]
    assert leaf.not_valid_after_utc > later + dt.timedelta(days=30)


def test_the_gateway_shares_the_servers_ca_with_a_certificate_of_its_own(tmp_path: Path) -> None:
    server = ensure_generated(tmp_path, "server", ["10.1.2.3"])
    gateway = ensure_generated(tmp_path, "gateway", ["10.1.2.4"])
    assert gateway.pin == server.pin and gateway.cert_file != server.cert_file


def test_listen_tls_plain_on_loopback_generated_off_it_and_plain_off_it_only_with_insecure(
    tmp_path: Path,
) -> None:
    common = {"cert": None, "key": None, "tls_dir": tmp_path / "tls", "role": "server"}
    assert listen_tls("127.0.0.1", **common) is None  # type: ignore[arg-type]
    assert listen_tls("::1", **common) is None  # type: ignore[arg-type]
    assert not (tmp_path / "tls").exists()
    assert listen_tls("0.0.0.0", insecure=True, **common) is None  # type: ignore[arg-type]
    served = listen_tls("0.0.0.0", sans=["cp.example"], **common)  # type: ignore[arg-type]
    assert served is not None and served.pin is not None
    forced = listen_tls("127.0.0.1", force=True, **common)  # type: ignore[arg-type]
    assert forced is not None and forced.pin == served.pin


def test_listen_tls_takes_the_operators_pair_and_refuses_half_of_one(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    with pytest.raises(TlsError, match="both --tls-cert and --tls-key"):
        listen_tls("0.0.0.0", cert=cert, key=None, tls_dir=tmp_path, role="server")
    with pytest.raises(TlsError, match="no such file"):
        listen_tls("0.0.0.0", cert=cert, key=key, tls_dir=tmp_path, role="server")
    cert.write_text("x")
    key.write_text("y")
    assert listen_tls("127.0.0.1", cert=cert, key=key, tls_dir=tmp_path, role="server") == ServerTls(
        cert, key
    )


def test_the_certificate_names_the_listen_address_and_loopback_and_a_wildcard_names_the_machine() -> None:
    assert default_sans("10.0.0.5", ["cp.lan"]) == ["cp.lan", "10.0.0.5", "127.0.0.1", "::1", "localhost"]
    assert default_sans("[fd00::5]", ["CP.lan", "[fd00::6]"]) == [
        "cp.lan",
        "fd00::6",
        "fd00::5",
        "127.0.0.1",
        "::1",
        "localhost",
    ]
    wild = default_sans("0.0.0.0")
    assert socket.gethostname().lower() in wild and "127.0.0.1" in wild
    assert public_host("0.0.0.0", ["cp.lan", "127.0.0.1"]) == "cp.lan"
    assert public_host("10.0.0.5", ["cp.lan"]) == "10.0.0.5"


# --- clients --------------------------------------------------------------------------------------


def test_plain_http_to_a_non_loopback_host_is_refused_unless_insecure() -> None:
    with pytest.raises(PlainHttpRefused, match=r"http://192\.0\.2\.7:8080: plain HTTP .* --insecure"):
        check_plain("http://192.0.2.7:8080", insecure=False)
    with pytest.raises(PlainHttpRefused):
        client_verify("http://cp.example:8080", ServerTrust())
    check_plain("http://192.0.2.7:8080", insecure=True)
    check_plain("http://127.0.0.2:8080", insecure=False)
    check_plain("http://[::1]:8080", insecure=False)
    check_plain("https://192.0.2.7:8080", insecure=False)


def test_a_pin_that_is_not_the_cas_is_refused_naming_both_hashes(tmp_path: Path) -> None:
    served = ensure_generated(tmp_path, "server", ["127.0.0.1"])
    assert served.ca_pem is not None and served.pin is not None
    assert pinned_ca(served.ca_pem, served.pin, "here") == served.ca_pem
    wrong = CaPin("0" * 64)
    with pytest.raises(PinMismatch) as caught:
        pinned_ca(served.ca_pem, wrong, "https://10.0.0.1:8080")
    assert str(served.pin) in str(caught.value) and str(wrong) in str(caught.value)
    ca_file = tmp_path / "ca.crt"
    with pytest.raises(PinMismatch):
        client_verify("https://127.0.0.1:1", ServerTrust(ca_file=ca_file, ca_hash=wrong))


@contextmanager
def tls_listener(served: ServerTls) -> Iterator[int]:
    """A TLS server on 127.0.0.1 with ``served``'s certificate that completes handshakes."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(served.cert_file, served.key_file)
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        sock.close()


def handshake(port: int, context: ssl.SSLContext, name: str = "127.0.0.1") -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=name) as tls,
    ):
        return tls.recv(2)


def test_the_ca_file_verifies_the_generated_certificate_and_another_ca_does_not(tmp_path: Path) -> None:
    served = ensure_generated(tmp_path / "a", "server", ["127.0.0.1", "localhost"])
    other = ensure_generated(tmp_path / "b", "server", ["127.0.0.1"])
    assert served.ca_file is not None and other.ca_file is not None
    with tls_listener(served) as port:
        context = client_verify(
            "https://127.0.0.1:1", ServerTrust(ca_file=served.ca_file, ca_hash=served.pin)
        )
        assert isinstance(context, ssl.SSLContext)
        assert handshake(port, context) == b"ok"
        assert handshake(port, context, "localhost") == b"ok"
        with pytest.raises(ssl.SSLCertVerificationError, match=r"Hostname mismatch|IP address mismatch"):
            handshake(port, context, "cp.example")
        foreign = client_verify("https://127.0.0.1:1", ServerTrust(ca_file=other.ca_file))
        assert isinstance(foreign, ssl.SSLContext)
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            handshake(port, foreign)
        system = client_verify("https://127.0.0.1:1", ServerTrust())
        assert isinstance(system, ssl.SSLContext)
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(port, system)
