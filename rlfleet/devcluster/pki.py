"""Throwaway certificates for a local control plane (as envtest does): a CA, the API server's serving
certificate for loopback, an admin client certificate in group system:masters, the API server's client
certificate for kubelets (the node agent's log endpoint accepts only clients the CA signed), and the
service-account token signing key. Keys are ECDSA P-256: fast to generate and accepted everywhere they
are used here. `write_self_signed_serving` makes the node agent's serving certificate (it has no CA key).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)
SERVING_DNS_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                     "kubernetes.default.svc.cluster.local")
SERVING_IPS = ("127.0.0.1", "10.0.0.1")  # loopback, and the first address of the service range


@dataclass(frozen=True)
class ControlPlanePki:
    """Paths of the PEM files, all under one directory."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path
    sa_key: Path
    sa_pub: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY))


def _leaf(ca_key, ca_name: x509.Name, subject: x509.Name, usage, now, san: x509.SubjectAlternativeName | None = None):
    key = _new_key()
    builder = (_builder(subject, ca_name, key.public_key(), now)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def write_control_plane_pki(directory: Path, admin_user: str = "rlfleet-admin") -> ControlPlanePki:
    """Generate every key and certificate into directory (mode 0700) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    now = datetime.datetime.now(datetime.UTC)

    ca_key = _new_key()
    ca_name = _name("rlfleet-dev-cluster-ca")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key(), now)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    san = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in SERVING_DNS_NAMES] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVING_IPS])
    serving_key, serving_cert = _leaf(ca_key, ca_name, _name("kube-apiserver"),
                                      ExtendedKeyUsageOID.SERVER_AUTH, now, san)
    # Group system:masters is bound to cluster-admin by the API server's bootstrap RBAC policy.
    admin_key, admin_cert = _leaf(ca_key, ca_name, _name(admin_user, "system:masters"),
                                  ExtendedKeyUsageOID.CLIENT_AUTH, now)
    # What the API server presents to kubelets (`kubectl logs`); it belongs to no group: the node agent
    # checks only that the cluster CA signed it, and the API server grants this name nothing.
    kubelet_key, kubelet_cert = _leaf(ca_key, ca_name, _name("kube-apiserver-kubelet-client"),
                                      ExtendedKeyUsageOID.CLIENT_AUTH, now)
    sa_key = _new_key()

    paths = ControlPlanePki(
        ca_cert=directory / "ca.crt", ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt", serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt", admin_key=directory / "admin.key",
        kubelet_client_cert=directory / "apiserver-kubelet-client.crt",
        kubelet_client_key=directory / "apiserver-kubelet-client.key",
        sa_key=directory / "sa.key", sa_pub=directory / "sa.pub",
    )
    pem = serialization.Encoding.PEM
    contents = {
        paths.ca_cert: ca_cert.public_bytes(pem), paths.ca_key: _key_pem(ca_key),
        paths.serving_cert: serving_cert.public_bytes(pem), paths.serving_key: _key_pem(serving_key),
        paths.admin_cert: admin_cert.public_bytes(pem), paths.admin_key: _key_pem(admin_key),
        paths.kubelet_client_cert: kubelet_cert.public_bytes(pem), paths.kubelet_client_key: _key_pem(kubelet_key),
        paths.sa_key: _key_pem(sa_key),
        paths.sa_pub: sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
    }
    for path, data in contents.items():
        path.write_bytes(data)
        path.chmod(0o600)
    return paths


def write_self_signed_serving(directory: Path, common_name: str, ips: tuple[str, ...] = ("127.0.0.1",),
                              dns_names: tuple[str, ...] = ("localhost",)) -> tuple[Path, Path]:
    """A self-signed serving certificate and its key in directory (mode 0700, files 0600): (cert, key).

    For a server that cannot get the cluster CA's key (the node agent): its clients must not verify it
    against the CA (kube-apiserver without --kubelet-certificate-authority skips the check).
    """
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    now = datetime.datetime.now(datetime.UTC)
    key = _new_key()
    name = _name(common_name)
    san = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips])
    cert = (_builder(name, name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(san, critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "serving.crt", directory / "serving.key"
    for path, data in ((cert_path, cert.public_bytes(serialization.Encoding.PEM)), (key_path, _key_pem(key))):
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return cert_path, key_path
