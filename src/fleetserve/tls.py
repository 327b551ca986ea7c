"""TLS for fleetserve's listeners and the clients of the control plane.

Who serves what (design.md, "Trust"):

- A listener on a loopback address (127.0.0.0/8, ::1, ``localhost``) may serve plain HTTP: that is
  ``fleetserve up``. Off loopback, ``fleetserve server`` and ``fleetserve gateway`` serve TLS: with
  the operator's ``--tls-cert``/``--tls-key``, or else with a certificate from a CA fleetserve
  generates on first start in its TLS directory (``ensure_generated``: ``ca.crt``, ``ca.key`` and
  one ``ROLE.crt``/``ROLE.key`` per process kind; keys 0600, written atomically, reused after).
  Plain HTTP off loopback only with ``--insecure`` (``listen_tls``).
- The CA is pinned by the SHA-256 of its SubjectPublicKeyInfo, written ``sha256:HEX`` (``CaPin``),
  as ``kubeadm join --discovery-token-ca-cert-hash`` does. The server prints the join command
  with it and publishes its CA (public, no token) at ``CA_PATH``. A client given only the pin
  fetches that CA over an unverified connection, checks it against the pin, and from then on
  verifies the server normally against that CA alone (chain and host name): someone in between
  can copy the CA, never a certificate it signed (``client_verify``).
- A client refuses ``http://`` to a non-loopback host unless told ``insecure`` (``PlainHttpRefused``).

Errors (drawn in ``fleetserve.errors``)::

    TlsError              TLS cannot be set up, or the server cannot be verified
    ├── PlainHttpRefused  plain HTTP on or to a non-loopback address without --insecure
    ├── PinMismatch       the server's CA does not have the pinned hash
    └── CaUnavailable     the server could not be reached to fetch its CA (worth a retry)
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import secrets
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetserve.errors import FleetserveError
from fleetserve.secretfile import write_secret

CA_PATH = "/tls/ca.crt"
"""Where a server with a generated CA publishes it (PEM; no credentials needed, the pin checks it)."""

PIN_PREFIX = "sha256:"
CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_BEFORE = dt.timedelta(days=30)
"""A generated server certificate this close to its end is issued again at start."""


class TlsError(FleetserveError):
    """TLS cannot be set up, or the server cannot be verified."""


class PlainHttpRefused(TlsError):
    """Plain HTTP on or to a non-loopback address, without ``--insecure``."""


class PinMismatch(TlsError):
    """The server's CA does not have the pinned hash: another server, or someone in between."""


class CaUnavailable(TlsError):
    """The server could not be reached to fetch its CA (it may not be up yet: worth a retry)."""


# --- addresses ---------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, IPv4-mapped loopback) or ``localhost``.

    Other host names are not resolved: a name could point anywhere, so it is not loopback."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every address of the machine (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


def machine_addresses() -> list[str]:
    """This machine's interface addresses (IPv4 first, no link-local ones), then its host name."""
    import psutil  # type: ignore[import-untyped]

    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(addr.address.split("%", 1)[0])
            except ValueError:
                continue
            if not ip.is_link_local:
                found.append(ip)
    found.sort(key=lambda ip: ip.version)  # stable: interface order within each family
    return [*(str(ip) for ip in found), socket.gethostname()]


def default_sans(listen_host: str, extra: Iterable[str] = ()) -> list[str]:
    """The names a server certificate must carry: ``extra`` (``--tls-san``) first, the listen
    address (or, for a wildcard, the machine's host name and addresses), and always loopback."""
    names = [*extra]
    names += machine_addresses() if is_wildcard(listen_host) else [listen_host.strip("[]")]
    names += ["127.0.0.1", "::1", "localhost"]
    seen: dict[str, None] = {}
    for name in names:
        name = name.strip().strip("[]").lower()
        if name:
            seen.setdefault(name, None)
    return list(seen)


def public_host(listen_host: str, sans: Iterable[str]) -> str:
    """The host a join command names: the listen address, or for a wildcard the first name of the
    certificate that is not loopback (the operator's ``--tls-san`` first)."""
    if not is_wildcard(listen_host):
        return listen_host
    for name in sans:
        if not is_loopback(name):
            return name
    return "127.0.0.1"


def url_of(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with an IPv6 address in brackets."""
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{bracketed}:{port}"


# --- the pin -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaPin:
    """A CA pinned by the SHA-256 of its SubjectPublicKeyInfo (DER), written ``sha256:HEX``."""

    digest: str

    @classmethod
    def parse(cls, text: str) -> CaPin:
        """``sha256:`` and 64 hex digits; TlsError naming the expected form otherwise."""
        value = text.strip().lower()
        hex_part = value.removeprefix(PIN_PREFIX)
        if not value.startswith(PIN_PREFIX) or len(hex_part) != 64:
            raise TlsError(f"a CA pin is written sha256:<64 hex digits>, not {text[:80]!r}")
        try:
            bytes.fromhex(hex_part)
        except ValueError:
            raise TlsError(f"a CA pin is written sha256:<64 hex digits>, not {text[:80]!r}") from None
        return cls(hex_part)

    @classmethod
    def of(cls, cert: x509.Certificate) -> CaPin:
        """The pin of a certificate's public key."""
        spki = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(hashlib.sha256(spki).hexdigest())

    def __str__(self) -> str:
        return PIN_PREFIX + self.digest


def _certificates(pem: bytes, where: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise TlsError(f"{where}: not a PEM certificate bundle ({exc})") from exc


def pinned_ca(pem: bytes, pin: CaPin, where: str) -> bytes:
    """The certificate of ``pem`` whose key has the hash ``pin``, as PEM; PinMismatch if none has."""
    certs = _certificates(pem, where)
    for cert in certs:
        if CaPin.of(cert) == pin:
            return cert.public_bytes(serialization.Encoding.PEM)
    found = ", ".join(str(CaPin.of(c)) for c in certs) or "none"
    raise PinMismatch(
        f"{where}: the server's CA has the hash {found}, not the pinned {pin}; this is not the server "
        "the pin was printed by (or someone is in between). Check the pin the server printed "
        "(--ca-hash / FLEETSERVE_CA_HASH)"
    )


# --- generating a CA and server certificates ----------------------------------------------------


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    """A CA signs certificates (and CRLs); a server certificate signs its handshakes."""
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _new_ca(now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fleetserve CA {secrets.token_hex(4)}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _new_server_cert(
    ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, role: str, sans: list[str], now: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fleetserve {role}")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=SERVER_DAYS), ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in sans]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _names_of(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n.value).lower() for n in ext}


@dataclass(frozen=True)
class ServerTls:
    """What a listener serves TLS with: its certificate chain and key files, and, when fleetserve
    generated them, the CA (its file; PEM, published at ``CA_PATH``) and its pin."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    ca_pem: bytes | None = None
    pin: CaPin | None = None
    # The names the generated certificate carries (the operator's first), for the join command.
    names: tuple[str, ...] = ()


def ensure_generated(tls_dir: Path, role: str, sans: list[str], now: dt.datetime | None = None) -> ServerTls:
    """The generated CA and ``role``'s server certificate in ``tls_dir``: made on first start,
    reused after. A certificate missing one of ``sans``, or near its end, is issued again by the
    same CA, so the pin agents were given stays valid."""
    now = now or dt.datetime.now(dt.UTC)
    tls_dir = tls_dir.absolute()
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_file, ca_key_file = tls_dir / "ca.crt", tls_dir / "ca.key"
    if ca_file.exists() and ca_key_file.exists():
        ca = _certificates(ca_file.read_bytes(), str(ca_file))[0]
        loaded = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise TlsError(f"{ca_key_file}: not the EC key of a CA fleetserve generated")
        ca_key = loaded
    else:
        ca, ca_key = _new_ca(now)
        write_secret(ca_key_file, _key_pem(ca_key))
        write_secret(ca_file, ca.public_bytes(serialization.Encoding.PEM), mode=0o644)
    cert_file, key_file = tls_dir / f"{role}.crt", tls_dir / f"{role}.key"
    current: x509.Certificate | None = None
    if cert_file.exists() and key_file.exists():
        current = _certificates(cert_file.read_bytes(), str(cert_file))[0]
    fresh = (
        current is not None
        and current.issuer == ca.subject
        and {s.lower() for s in sans} <= _names_of(current)
        and current.not_valid_after_utc - RENEW_BEFORE > now
    )
    if not fresh:
        cert, key = _new_server_cert(ca, ca_key, role, sans, now)
        write_secret(key_file, _key_pem(key))
        chain = cert.public_bytes(serialization.Encoding.PEM) + ca.public_bytes(serialization.Encoding.PEM)
        write_secret(cert_file, chain, mode=0o644)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    return ServerTls(cert_file, key_file, ca_file, ca_pem, CaPin.of(ca), tuple(sans))


def listen_tls(
    host: str,
    *,
    cert: Path | None,
    key: Path | None,
    tls_dir: Path,
    role: str,
    sans: Iterable[str] = (),
    insecure: bool = False,
    force: bool = False,
) -> ServerTls | None:
    """How a listener on ``host`` serves: the operator's certificate, a generated one (off loopback,
    or with ``force``), or plain HTTP (None: on loopback, or off it with ``insecure``)."""
    if (cert is None) != (key is None):
        raise TlsError("give both --tls-cert and --tls-key, or neither (then fleetserve generates a CA)")
    if cert is not None and key is not None:
        for path in (cert, key):
            if not path.is_file():
                raise TlsError(f"{path}: no such file")
        return ServerTls(cert, key)
    if not force and (is_loopback(host) or insecure):
        return None
    return ensure_generated(tls_dir, role, default_sans(host, sans))


# --- clients -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTrust:
    """How a client trusts the control plane: a CA file, a pinned CA (fetched from the server and
    checked), or the system's CAs when neither; ``insecure`` allows plain HTTP off loopback."""

    ca_file: Path | None = None
    ca_hash: CaPin | None = None
    insecure: bool = False

    @classmethod
    def of(cls, ca_file: str | Path | None, ca_hash: str | None, insecure: bool = False) -> ServerTrust:
        """From flags, environment or a config file (a malformed pin is a TlsError)."""
        return cls(Path(ca_file) if ca_file else None, CaPin.parse(ca_hash) if ca_hash else None, insecure)


def check_plain(url: str, insecure: bool) -> None:
    """PlainHttpRefused for ``http://`` to a host that is not loopback, unless ``insecure``."""
    parts = urlsplit(url)
    if parts.scheme == "http" and not insecure and not is_loopback(parts.hostname or ""):
        raise PlainHttpRefused(
            f"{url}: plain HTTP to a non-loopback address would send tokens in the clear; use "
            "https:// with the CA pin the server printed (--ca-hash sha256:..., FLEETSERVE_CA_HASH), "
            "or allow it anyway with --insecure (FLEETSERVE_INSECURE=1 for the admin commands)"
        )


def fetch_ca(server: str, timeout: float = 10.0) -> bytes:
    """The CA a server publishes at ``CA_PATH``, fetched without verification (check it with a pin)."""
    url = server.rstrip("/") + CA_PATH
    try:
        # verify=False on purpose: the answer is checked against the pin before it is trusted.
        response = httpx.get(url, verify=False, timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        raise CaUnavailable(f"cannot fetch the CA of {server}: {type(exc).__name__}: {exc}") from exc
    if response.status_code == 404:
        raise TlsError(
            f"{server} publishes no CA (it serves a certificate of the operator's): verify it with "
            "--ca-file instead of --ca-hash"
        )
    if response.status_code != 200:
        raise TlsError(f"cannot fetch the CA of {server}: HTTP {response.status_code}")
    return response.content


def client_verify(server: str, trust: ServerTrust) -> ssl.SSLContext | bool:
    """What an httpx client of ``server`` passes as ``verify``: PlainHttpRefused for plain HTTP off
    loopback without ``insecure``; for https, a context trusting exactly the CA file, the pinned
    CA, or the system's CAs."""
    check_plain(server, trust.insecure)
    if urlsplit(server).scheme != "https":
        return True
    if trust.ca_file is not None:
        try:
            pem = trust.ca_file.read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read the CA file {trust.ca_file}: {exc.strerror or exc}") from exc
        if trust.ca_hash is not None:
            pem = pinned_ca(pem, trust.ca_hash, str(trust.ca_file))
    elif trust.ca_hash is not None:
        pem = pinned_ca(fetch_ca(server), trust.ca_hash, server)
    else:
        return ssl.create_default_context()
    _certificates(pem, str(trust.ca_file or server))
    return ssl.create_default_context(cadata=pem.decode("ascii"))
