"""Test certificates made with the openssl command: a CA, a certificate it signed for 127.0.0.1 (server and
client use: one host both serving and calling), and an unrelated CA."""

import subprocess


def make_pki(directory) -> dict[str, str]:
    """PEM paths: ca.pem, other.pem (a CA that signed nothing here), host.pem and host.key."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}")
    (directory / "host.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    run("req", *key, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=host")
    run("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "host.pem",
        "-days", "2", "-extfile", "host.ext")
    return {name: str(directory / name) for name in ("ca.pem", "other.pem", "host.pem", "host.key")}
