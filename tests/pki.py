"""Test certificates from deploy/make-certs.sh (so the script users run is the one tested): a CA, a certificate
it signed for 127.0.0.1 (server and client use: one host both serving and calling), and an unrelated CA."""

import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "make-certs.sh"


def make_pki(directory) -> dict[str, str]:
    """PEM paths: ca.pem, other.pem (a CA that signed nothing here), host.pem and host.key."""
    directory = pathlib.Path(directory)
    for sub, name in (("pki", "host"), ("other", "stranger")):
        subprocess.run(["bash", str(SCRIPT), str(directory / sub), name, "IP:127.0.0.1,DNS:localhost"], check=True,
                       capture_output=True)
    return {"ca.pem": str(directory / "pki" / "ca.pem"), "other.pem": str(directory / "other" / "ca.pem"),
            "host.pem": str(directory / "pki" / "host.pem"), "host.key": str(directory / "pki" / "host.key")}
