"""deploy/kubernetes/ hardened as a cluster's security review expects, one property a test: no
service account token, non-root numeric users, the runtime's seccomp profile, read-only root
filesystems, no privilege escalation or capabilities, the restricted Pod Security Standard,
requests and limits, egress denied but for the flows the pieces use, owner-only Secret files,
etcd behind certificates of its own CA, etcd metrics on loopback, images pinned by digest.

The last test starts a real etcd with the manifest's own TLS flags (addresses moved to loopback):
it admits the rendezvous replicas' etcd client certificate and refuses the rendezvous service's
own certificate, which a worker's stolen key would be.
"""

from __future__ import annotations

import pytest
import http.client
import os
import re
import ssl
import subprocess
from typing import Dict, List
from urllib.parse import urlsplit

from rendezvous.server.etcd_process import find_etcd, free_port
from tests.waiting import wait_until

from .manifests import (CERT_MANAGER, NAMESPACE, all_containers, certificates, container_args, load, named, of_kind,
                        on_disk, pod_spec, pod_workloads, policy_flows, rendezvous_config, secret_at)

RESTRICTED = "restricted"
PINNED = re.compile(r"[^\s@]+@sha256:[0-9a-f]{64}")
QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|Ki|Mi|Gi|Ti)?")
FACTOR = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}


def containers() -> List[tuple]:
    """(workload name, container) for every container of every pod, init containers included."""
    return [(w["metadata"]["name"], c) for w in pod_workloads() for c in all_containers(w)]


def flags(args: List[str]) -> Dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in args)


def etcd_flags() -> Dict[str, str]:
    args, _ = container_args(named("StatefulSet", "etcd"), "etcd")
    assert args[0] == "etcd"
    return flags(args[1:])


def quantity(value) -> float:
    m = QUANTITY.fullmatch(str(value))
    assert m, f"not a Kubernetes quantity: {value!r}"
    return float(m.group(1)) * FACTOR[m.group(2)]


# ---------------------------------------------------------------------- the pods
def test_no_pod_mounts_a_service_account_token():
    # None of the pieces calls the Kubernetes API: a token in the pod would only serve an intruder.
    for w in pod_workloads():
        assert pod_spec(w).get("automountServiceAccountToken") is False, w["metadata"]["name"]


def test_every_pod_runs_under_the_runtime_default_seccomp_profile():
    for w in pod_workloads():
        assert pod_spec(w)["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"}, w["metadata"]["name"]
    for name, c in containers():   # and no container opts out
        assert c.get("securityContext", {}).get("seccompProfile", {"type": "RuntimeDefault"}) == \
            {"type": "RuntimeDefault"}, (name, c["name"])


def test_every_pod_runs_as_a_numeric_non_root_user_and_group():
    for w in pod_workloads():
        ctx = pod_spec(w)["securityContext"]
        assert ctx.get("runAsNonRoot") is True, w["metadata"]["name"]
        for key in ("runAsUser", "runAsGroup"):   # numeric: runAsNonRoot cannot check a user name in the image
            assert type(ctx.get(key)) is int and ctx[key] > 0, (w["metadata"]["name"], key, ctx.get(key))
    for name, c in containers():
        ctx = c.get("securityContext", {})
        assert ctx.get("runAsNonRoot", True) is True, (name, c["name"])
        assert ctx.get("runAsUser", 1) != 0 and ctx.get("runAsGroup", 1) != 0, (name, c["name"])


def writes(container: dict) -> List[str]:
    """Where the container's process writes: etcd its --data-dir; a Python process (the
    elastic-ring image) /tmp and its HOME; and any TMPDIR."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    paths = [v for k, v in env.items() if k in ("HOME", "TMPDIR") and v]
    if container["image"].startswith("elastic-ring"):
        paths.append("/tmp")
    paths += [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith("--data-dir=")]
    return paths


def test_every_container_has_a_read_only_root_filesystem_and_writes_only_to_its_volumes():
    for w in pod_workloads():
        name = w["metadata"]["name"]
        writable = {v["name"] for v in pod_spec(w).get("volumes", []) if "emptyDir" in v}
        writable |= {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in all_containers(w):
            assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, (name, c["name"])
            paths = writes(c)
            assert paths, (name, c["name"])
            for path in paths:
                mounts = [m for m in c.get("volumeMounts", [])
                          if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
                assert any(m["name"] in writable and not m.get("readOnly") for m in mounts), \
                    f"{name}/{c['name']} writes {path}, on no writable volume"


def test_no_container_can_gain_privileges():
    for name, c in containers():
        ctx = c.get("securityContext", {})
        assert ctx.get("allowPrivilegeEscalation") is False and not ctx.get("privileged"), (name, c["name"])


def test_every_container_drops_all_capabilities():
    for name, c in containers():
        assert c.get("securityContext", {}).get("capabilities") == {"drop": ["ALL"]}, (name, c["name"])


def test_the_namespace_enforces_the_restricted_pod_security_standard():
    [ns] = of_kind("Namespace")
    assert ns["metadata"]["name"] == NAMESPACE   # the namespace every manifest is applied to
    labels = ns["metadata"].get("labels", {})
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == RESTRICTED, mode


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for name, c in containers():
        res = c.get("resources", {})
        for resource in ("cpu", "memory"):
            request, limit = res.get("requests", {}).get(resource), res.get("limits", {}).get(resource)
            assert request is not None and limit is not None, (name, c["name"], resource)
            assert 0 < quantity(request) <= quantity(limit), (name, c["name"], resource, request, limit)


def test_every_image_is_pinned_by_digest():
    # A tag can be moved to another image; a digest cannot. kustomization.yaml says how to pin yours.
    for name, c in containers():
        assert PINNED.fullmatch(c["image"]), f"{name}/{c['name']}: {c['image']} is not pinned by its sha256 digest"


# ---------------------------------------------------------------------- the network
def test_egress_is_denied_by_default_and_allowed_only_for_the_flows_the_pieces_use():
    everyone = {p["metadata"]["name"]: p["spec"] for p in of_kind("NetworkPolicy") if p["spec"]["podSelector"] == {}}
    assert set(everyone) == {"default-deny", "dns"}, sorted(everyone)
    deny = everyone["default-deny"]
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"} and "egress" not in deny and "ingress" not in deny
    dns = everyone["dns"]
    assert dns["policyTypes"] == ["Egress"] and len(dns["egress"]) == 1
    [to] = dns["egress"][0]["to"]
    assert to == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                  "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    assert sorted((p["protocol"], p["port"]) for p in dns["egress"][0]["ports"]) == [("TCP", 53), ("UDP", 53)]
    # (from, to) -> ports (None: every port: the ring's listeners take ephemeral ones)
    egress = policy_flows("Egress")
    assert egress == {("etcd", "etcd"): {2379, 2380}, ("elastic-rendezvous", "etcd"): {2379},
                      ("elastic-train", "elastic-rendezvous"): {29400}, ("elastic-train", "elastic-train"): None}
    # What one end may send, the other may receive, and the reverse: no flow is half open.
    assert {(dst, src): ports for (src, dst), ports in egress.items()} == policy_flows("Ingress")


# ---------------------------------------------------------------------- secrets and certificates
def test_every_secret_volume_is_readable_by_the_pods_own_group_only():
    for w in pod_workloads():
        name, spec = w["metadata"]["name"], pod_spec(w)
        secrets = [v for v in spec.get("volumes", []) if "secret" in v]
        for v in secrets:
            assert v["secret"].get("defaultMode") == 0o400, (name, v["name"], v["secret"].get("defaultMode"))
            assert all(i.get("mode", 0o400) == 0o400 for i in v["secret"].get("items", [])), (name, v["name"])
        if secrets:   # root's 0400 files are the pod's own only through fsGroup (the kubelet makes them 0440)
            ctx = spec["securityContext"]
            assert ctx.get("fsGroup") == ctx.get("runAsGroup"), name


def test_etcd_requires_client_certificates_of_its_own_ca_not_the_rendezvous_services():
    etcd = named("StatefulSet", "etcd")
    f = etcd_flags()
    assert "--client-cert-auth" in f and "--peer-client-cert-auth" in f
    server = {flag: secret_at(etcd, "etcd", f[flag]) for flag in ("--trusted-ca-file", "--cert-file", "--key-file")}
    peer = {flag: secret_at(etcd, "etcd", f[flag]) for flag in ("--peer-trusted-ca-file", "--peer-cert-file",
                                                                  "--peer-key-file")}
    assert set(server.values()) == {"elastic-ring-etcd-server"}, server
    assert set(peer.values()) == {"elastic-ring-etcd-peer"}, peer
    # Only a peer certificate joins as a member; the client certificate, of the same CA, does not.
    certs = certificates()
    assert f["--peer-cert-allowed-cn"] == certs["elastic-ring-etcd-peer"]["spec"]["commonName"]
    assert certs["elastic-ring-etcd-client"]["spec"]["commonName"] != f["--peer-cert-allowed-cn"]
    # The rendezvous service's Secret is nowhere in etcd's pod.
    assert all(v.get("secret", {}).get("secretName") != "elastic-ring-tls" for v in pod_spec(etcd)["volumes"])


def test_the_rendezvous_replicas_reach_etcd_with_their_own_client_certificate():
    sts = named("StatefulSet", "elastic-rendezvous")
    args, _ = container_args(sts, "rendezvous")
    f = flags(args[1:])
    assert {secret_at(sts, "rendezvous", f[k]) for k in ("--etcd-ca", "--etcd-cert", "--etcd-key")} == \
        {"elastic-ring-etcd-client"}
    assert {secret_at(sts, "rendezvous", f[k]) for k in ("--tls-cert", "--tls-key")} == {"elastic-ring-tls"}
    # Only the replicas hold it: with it one owns etcd.
    holders = [w["metadata"]["name"] for w in pod_workloads() for v in pod_spec(w).get("volumes", [])
               if v.get("secret", {}).get("secretName") == "elastic-ring-etcd-client"]
    assert holders == ["elastic-rendezvous"]


def test_cert_manager_issues_etcds_peer_server_and_client_certificates_from_a_ca_of_its_own():
    docs = load(os.path.join(CERT_MANAGER, "certificate.yaml"))
    issuer_ca = {d["metadata"]["name"]: d["spec"]["ca"]["secretName"] for d in docs
                 if d["kind"] == "Issuer" and "ca" in d["spec"]}
    certs = certificates()

    def ca_of(secret: str) -> str:
        ref = certs[secret]["spec"]["issuerRef"]
        assert ref["kind"] == "Issuer" and ref["name"] in issuer_ca, secret
        ca = issuer_ca[ref["name"]]
        assert certs[ca]["spec"]["isCA"], ca
        return ca

    etcd_cas = {ca_of(s) for s in ("elastic-ring-etcd-server", "elastic-ring-etcd-peer", "elastic-ring-etcd-client")}
    assert len(etcd_cas) == 1 and etcd_cas != {ca_of("elastic-ring-tls")}
    assert certs["elastic-ring-etcd-client"]["spec"]["usages"].count("server auth") == 0
    assert "client auth" in certs["elastic-ring-etcd-client"]["spec"]["usages"]
    # The rendezvous service's certificate serves; it is no client of anything.
    assert "client auth" not in certs["elastic-ring-tls"]["spec"]["usages"]


def test_etcd_serves_metrics_on_loopback_only():
    f = etcd_flags()
    for url in f["--listen-metrics-urls"].split(","):
        parts = urlsplit(url)
        assert parts.scheme == "https" or parts.hostname in ("127.0.0.1", "localhost", "::1"), url
    for flag in ("--listen-client-urls", "--listen-peer-urls"):
        assert all(u.startswith("https://") for u in f[flag].split(",")), flag
    ports = {p["containerPort"] for c in all_containers(named("StatefulSet", "etcd")) for p in c.get("ports", [])}
    assert all(urlsplit(u).port not in ports for u in f["--listen-metrics-urls"].split(","))


# ---------------------------------------------------------------------- a real etcd
@pytest.mark.slow
def test_a_real_etcd_with_the_manifests_tls_flags_admits_etcds_client_certificate_and_refuses_the_rendezvous_one(
        mounted, tmp_path):
    etcd = named("StatefulSet", "etcd")
    args, _ = container_args(etcd, "etcd")
    args = on_disk(args[1:], etcd, "etcd", mounted)
    client, peer, metrics = free_port(), free_port(), free_port()
    metrics_url = urlsplit(flags(args)["--listen-metrics-urls"])
    moved = {"--name": "etcd-0", "--data-dir": str(tmp_path / "data"),
             "--listen-client-urls": f"https://127.0.0.1:{client}",
             "--advertise-client-urls": f"https://127.0.0.1:{client}",
             "--listen-peer-urls": f"https://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer}",
             "--initial-cluster": f"etcd-0=https://127.0.0.1:{peer}",
             "--listen-metrics-urls": f"{metrics_url.scheme}://{metrics_url.hostname}:{metrics}"}
    assert set(moved) <= set(flags(args)), "only the manifest's own addressing flags are moved"
    argv = [find_etcd()] + [f"{a.split('=', 1)[0]}={moved[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in moved else a
                            for a in args]
    # The readiness probe, as the kubelet runs it in the pod (its client port moved too).
    [container] = pod_spec(etcd)["containers"]
    probe = on_disk(container["readinessProbe"]["exec"]["command"], etcd, "etcd", mounted)
    assert probe[0] == "etcdctl" and "--endpoints=https://127.0.0.1:2379" in probe
    probe = [find_etcd("etcdctl")] + [a.replace(":2379", f":{client}") for a in probe[1:]]
    rdzv = rendezvous_config(mounted)[0]   # the files the replicas' --etcd-* and --tls-* flags name

    def etcdctl(*command: str, cert=None, key=None) -> subprocess.CompletedProcess:
        creds = [f"--cert={cert}", f"--key={key}"] if cert else []
        return subprocess.run([find_etcd("etcdctl"), f"--endpoints=https://127.0.0.1:{client}",
                               f"--cacert={rdzv.etcd_ca}", "--dial-timeout=2s", "--command-timeout=3s",
                               *creds, *command], capture_output=True, text=True, timeout=30)

    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None
                   or subprocess.run(probe, capture_output=True, timeout=30).returncode == 0,
                   60, "etcd's readiness probe to pass")
        assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
        assert etcdctl("put", "/elastic-ring/who", "replica", cert=rdzv.etcd_cert, key=rdzv.etcd_key).returncode == 0
        # The rendezvous service's own certificate: a valid client certificate, of the wrong CA.
        intruder = etcdctl("put", "/elastic-ring/who", "intruder", cert=rdzv.tls_cert, key=rdzv.tls_key)
        assert intruder.returncode != 0, intruder.stdout
        assert etcdctl("get", "/elastic-ring/who").returncode != 0   # and no certificate at all
        got = etcdctl("get", "/elastic-ring/who", "--print-value-only", cert=rdzv.etcd_cert, key=rdzv.etcd_key)
        assert got.returncode == 0 and got.stdout.strip() == "replica", got
        # Metrics: in clear text on loopback (where the manifest listens), and over the client port
        # to a holder of an etcd client certificate, as etcd.yaml says.
        plain = http.client.HTTPConnection("127.0.0.1", metrics, timeout=5)
        tls = ssl.create_default_context(cafile=rdzv.etcd_ca)
        tls.load_cert_chain(rdzv.etcd_cert, rdzv.etcd_key)
        for conn in (plain, http.client.HTTPSConnection("127.0.0.1", client, context=tls, timeout=5)):
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and b"etcd_server_has_leader 1" in response.read()
            conn.close()
    finally:
        proc.kill()
        proc.wait(10)
