"""Self-signed TLS certificates for the tests of the servers (OpenSSL's command line)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(directory: Path, dns: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """(certificate, key) PEM files in `directory` (made if missing): a certificate for the names
    `dns` and the addresses `ips` (its subjectAltName), valid two days."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    names = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{name}" for name in dns)])
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={(dns or ips)[0]}",
                    "-keyout", str(key), "-out", str(cert), "-addext", f"subjectAltName={names}"],
                   cwd=directory, check=True, capture_output=True)  # fmt: skip
    return cert, key
