"""The Secret files deploy/kubernetes's pods mount, made real on disk for the tests here."""

import uuid

import pytest

from tests.certs import make_pki


@pytest.fixture(scope="session")
def mounted(tmp_path_factory):
    """A directory standing in for /etc/elastic-ring: what each pod's Secret volumes would hold
    (real PEM files and a token), so the parsers' own checks of the files run, and a real etcd can
    start from them. Two CAs, as cert-manager/certificate.yaml issues them: the rendezvous
    service's (tls/, and the workers' ca/) and etcd's own (etcd-server/, etcd-peer/,
    etcd-client/). The rendezvous certificate may also act as a client (the worst case: one issued
    for both), so etcd can refuse it only for its CA."""
    root = tmp_path_factory.mktemp("etc-elastic-ring")
    rdzv = make_pki(str(root / "pki-rendezvous"), server_also_client=True)
    etcd = make_pki(str(root / "pki-etcd"), client_cn="elastic-rendezvous", server_also_client=True)
    files = {"tls/tls.crt": rdzv.server_cert, "tls/tls.key": rdzv.server_key, "tls/ca.crt": rdzv.ca,
             "ca/ca.crt": rdzv.ca,
             "etcd-server/tls.crt": etcd.server_cert, "etcd-server/tls.key": etcd.server_key,
             "etcd-server/ca.crt": etcd.ca,
             # One member here: its peer certificate is never shown to another; any of etcd's CA will do.
             "etcd-peer/tls.crt": etcd.server_cert, "etcd-peer/tls.key": etcd.server_key, "etcd-peer/ca.crt": etcd.ca,
             "etcd-client/tls.crt": etcd.client_cert, "etcd-client/tls.key": etcd.client_key,
             "etcd-client/ca.crt": etcd.ca}
    texts = {rel: open(src).read() for rel, src in files.items()}
    texts["token/token"] = uuid.uuid4().hex
    for rel, text in texts.items():
        path = root / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        path.chmod(0o400)   # as the pods' defaultMode
    return str(root)
