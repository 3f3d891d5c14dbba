"""deploy/kubernetes/ without a cluster: every manifest against the Kubernetes API schema (offline,
kubernetes-validate's bundled schemas), and the references between them checked the way the
cluster would resolve them: selectors, ports, Secrets and their keys, TLS names, the grace period
against --preempt-grace, and every container's arguments parsed by our own argparse parsers.

The manifests have not run on a cluster here; these checks are what can be known without one.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import uuid
from typing import Dict, List, Tuple

import kubernetes_validate
import pytest
import yaml

from elastic.launch.flags import parse as parse_launch
from elastic.launch.launcher import JobBelowMinNp
from rendezvous.cli import _parser as rendezvous_parser, config_from_args
from tests.certs import make_pki

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(REPO, "deploy", "kubernetes")
CERT_MANAGER = os.path.join(BASE, "cert-manager")
# The oldest Kubernetes whose Job has backoffLimitPerIndex and podFailurePolicy GA (1.33), and
# the newest schema the pinned kubernetes-validate bundles.
VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
WORKLOADS = ("StatefulSet", "Deployment", "Job")


def load(path: str) -> List[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def kustomization(directory: str) -> dict:
    return load(os.path.join(directory, "kustomization.yaml"))[0]


def base_docs() -> List[Tuple[str, dict]]:
    return [(name, d) for name in kustomization(BASE)["resources"] for d in load(os.path.join(BASE, name))]


DOCS = base_docs()
NAMESPACE = kustomization(BASE)["namespace"]


def of_kind(kind: str) -> List[dict]:
    return [d for _, d in DOCS if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    found = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> Dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: Dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def workloads_selected(selector: dict) -> List[dict]:
    return [w for k in WORKLOADS for w in of_kind(k) if selects(selector, pod_labels(w))]


def container_ports(workload: dict) -> Dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}


def expand(value: str, env: Dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's args from its env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], value)


def pod_env(workload: dict, container: dict) -> Dict[str, str]:
    """The values the downward API would give this pod's env (a pod of the workload, index 0)."""
    name = workload["metadata"]["name"]
    pod_name = f"{name}-0" if workload["kind"] == "StatefulSet" else f"{name}-0-x7k2p"
    by_field = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE, "status.podIP": "10.42.0.17",
                "metadata.labels['batch.kubernetes.io/controller-uid']": str(uuid.uuid4())}
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = by_field[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def container_args(workload: dict, container_name: str) -> Tuple[List[str], Dict[str, str]]:
    container = next(c for c in pod_spec(workload)["containers"] if c["name"] == container_name)
    env = pod_env(workload, container)
    return [expand(a, env) for a in container.get("command", []) + container.get("args", [])], env


def dns_name(address: str) -> str:
    return re.sub(r"^https?://", "", address).rsplit(":", 1)[0]


# ---------------------------------------------------------------------- the API schema
def test_the_kustomization_lists_every_manifest_of_the_directory():
    listed = set(kustomization(BASE)["resources"])
    present = {f for f in os.listdir(BASE) if f.endswith(".yaml") and f != "kustomization.yaml"}
    assert listed == present
    assert kustomization(CERT_MANAGER)["resources"] == ["..", "certificate.yaml"]
    assert kustomization(CERT_MANAGER)["namespace"] == NAMESPACE


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_api_schema_offline(version, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"kubernetes-validate tried the network: {args}")

    # Offline: any connection or name lookup fails the test (the schemas are bundled with the package).
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    for name, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} is not valid for Kubernetes {version}: "
                        f"{'.'.join(str(p) for p in e.path)}: {e.message}")
    kinds = sorted({d["kind"] for _, d in DOCS})
    assert kinds == ["Job", "Namespace", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"]


def test_the_schema_check_catches_a_misspelt_field():
    job = yaml.safe_load(yaml.safe_dump(named("Job", "elastic-train")))
    job["spec"]["backoffLimitPerIndx"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="backoffLimitPerIndx"):
        kubernetes_validate.validate(job, VERSIONS[0], strict=True)


def test_the_cert_manager_overlay_holds_only_cert_manager_kinds_whose_issuers_exist():
    # cert-manager's kinds are CRDs: no Kubernetes schema covers them, their references are checked.
    docs = load(os.path.join(CERT_MANAGER, "certificate.yaml"))
    assert {(d["apiVersion"], d["kind"]) for d in docs} == {("cert-manager.io/v1", "Issuer"),
                                                            ("cert-manager.io/v1", "Certificate")}
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certificates = {d["spec"]["secretName"]: d for d in docs if d["kind"] == "Certificate"}
    for cert in certificates.values():
        assert cert["spec"]["issuerRef"]["kind"] == "Issuer" and cert["spec"]["issuerRef"]["name"] in issuers
    ca_issuers = [i for i in issuers.values() if "ca" in i["spec"]]
    assert all(i["spec"]["ca"]["secretName"] in certificates and certificates[i["spec"]["ca"]["secretName"]]["spec"]
               ["isCA"] for i in ca_issuers)


# ---------------------------------------------------------------------- references between them
def test_every_service_selects_pods_that_serve_its_ports():
    for svc in of_kind("Service"):
        targets = workloads_selected({"matchLabels": svc["spec"]["selector"]})
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        ports = container_ports(targets[0])
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            assert (target in ports) if isinstance(target, str) else (target in ports.values()), \
                f"Service {svc['metadata']['name']} port {p['name']}: no container port {target}"
            assert ports.get(target, target) == p["port"], f"Service {svc['metadata']['name']}: port numbers differ"


def test_each_statefulset_has_its_headless_service_and_a_selector_matching_its_pods():
    for sts in of_kind("StatefulSet"):
        svc = named("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None", "per-pod DNS names need a headless Service"
        assert selects(sts["spec"]["selector"], pod_labels(sts))
        assert workloads_selected({"matchLabels": svc["spec"]["selector"]}) == [sts]


def test_pod_disruption_budgets_select_one_workload_each_and_keep_quorum_and_min_np():
    budgets = {p["metadata"]["name"]: p for p in of_kind("PodDisruptionBudget")}
    assert set(budgets) == {"etcd", "elastic-rendezvous", "elastic-train"}
    for name, pdb in budgets.items():
        assert len(workloads_selected(pdb["spec"]["selector"])) == 1, name
    assert budgets["etcd"]["spec"]["maxUnavailable"] == 1 and named("StatefulSet", "etcd")["spec"]["replicas"] == 3
    cfg = worker_config()
    assert budgets["elastic-train"]["spec"]["minAvailable"] * cfg.np == cfg.min_np


def test_network_policies_admit_only_the_pods_and_ports_their_clients_use():
    admitted = {}   # (policy target, source) -> ports (None: every port)
    for pol in of_kind("NetworkPolicy"):
        targets = workloads_selected(pol["spec"]["podSelector"])
        assert len(targets) == 1 and pol["spec"]["policyTypes"] == ["Ingress"], pol["metadata"]["name"]
        target = targets[0]["metadata"]["name"]
        for rule in pol["spec"]["ingress"]:
            assert rule["from"], "an empty 'from' admits everyone"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{pol['metadata']['name']}: only pods of this namespace"
                sources = workloads_selected(peer["podSelector"])
                assert len(sources) == 1, pol["metadata"]["name"]
                ports = None
                if "ports" in rule:
                    ports = {p["port"] for p in rule["ports"]}
                    assert ports <= set(container_ports(targets[0]).values()), (target, ports)
                admitted[(target, sources[0]["metadata"]["name"])] = ports
    assert admitted == {("etcd", "elastic-rendezvous"): {2379}, ("etcd", "etcd"): {2379, 2380},
                        ("elastic-rendezvous", "elastic-train"): {29400},
                        ("elastic-train", "elastic-train"): None}


def secrets_defined() -> Dict[str, set]:
    """Secret name -> its keys: the kustomization's generators and cert-manager's Certificates."""
    defined = {g["name"]: {os.path.basename(f.split("=")[0]) for f in g["files"]}
               for g in kustomization(BASE)["secretGenerator"]}
    assert kustomization(BASE)["generatorOptions"]["disableNameSuffixHash"], "pods name the Secrets as written"
    for d in load(os.path.join(CERT_MANAGER, "certificate.yaml")):
        if d["kind"] == "Certificate":
            defined[d["spec"]["secretName"]] = {"tls.crt", "tls.key", "ca.crt"}
    return defined


def test_every_secret_a_pod_mounts_is_defined_with_the_keys_it_reads():
    defined = secrets_defined()
    for k in WORKLOADS:
        for w in of_kind(k):
            for vol in pod_spec(w).get("volumes", []):
                if "secret" not in vol:
                    continue
                name = vol["secret"]["secretName"]
                assert name in defined, f"{w['metadata']['name']} mounts Secret {name}, which nothing defines"
                keys = {i["key"] for i in vol["secret"].get("items", [])}
                assert keys <= defined[name], (name, keys)


def test_workers_get_only_the_ca_certificate_of_the_tls_secret():
    # With the key, a worker could reach etcd (client certificates are all etcd asks for).
    job = named("Job", "elastic-train")
    tls = [v for v in pod_spec(job)["volumes"] if v.get("secret", {}).get("secretName") == "elastic-ring-tls"]
    assert len(tls) == 1 and tls[0]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


# ---------------------------------------------------------------------- the arguments, parsed by our parsers
@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """A directory standing in for /etc/elastic-ring: what each pod's Secret volumes would hold
    (real PEM files and a token), so the parsers' own checks of the files run."""
    root = tmp_path_factory.mktemp("etc-elastic-ring")
    pki = make_pki(str(root))
    files = {"tls/tls.crt": open(pki.server_cert).read(), "tls/tls.key": open(pki.server_key).read(),
             "tls/ca.crt": open(pki.ca).read(), "ca/ca.crt": open(pki.ca).read(), "token/token": uuid.uuid4().hex}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        path.chmod(0o600)
    return str(root)


def on_disk(args: List[str], workload: dict, container: str, mounted: str) -> List[str]:
    """The args with the pod's mount paths moved under `mounted`; every path used must be mounted."""
    mounts = [m["mountPath"] for c in pod_spec(workload)["containers"] if c["name"] == container
              for m in c.get("volumeMounts", [])]
    out = []
    for a in args:
        for path in re.findall(r"/etc/elastic-ring/[\w./-]+", a):
            assert any(path.startswith(m + "/") for m in mounts), f"{path} is not on a mounted volume"
        out.append(a.replace("/etc/elastic-ring", mounted))
    return out


def rendezvous_config(mounted: str):
    sts = named("StatefulSet", "elastic-rendezvous")
    args, env = container_args(sts, "rendezvous")
    assert args[0] == "elastic-rendezvous"
    return config_from_args(rendezvous_parser().parse_args(on_disk(args[1:], sts, "rendezvous", mounted))), env


def worker_config(mounted: str = ""):
    job = named("Job", "elastic-train")
    args, env = container_args(job, "worker")
    assert args[0] == "elastic-run"
    if mounted:
        args = on_disk(args, job, "worker", mounted)
    sep = args.index("--")
    assert args[sep + 1] == "python"
    # The image's python runs the command; here, this one (elastic-run checks it exists).
    argv = args[1:sep + 1] + [sys.executable] + args[sep + 2:]
    if not mounted:   # only the numbers: no files to read
        argv = [a for a in argv if not a.startswith(("--token-file", "--tls-ca"))]
    return parse_launch(argv, env={**env, "HOME": "/nonexistent"})


def test_the_rendezvous_replicas_args_parse_and_name_etcd_and_themselves_as_clients_dial_them(mounted):
    cfg, env = rendezvous_config(mounted)
    etcd = named("StatefulSet", "etcd")
    members = [f"etcd-{i}.etcd.{NAMESPACE}.svc:2379" for i in range(etcd["spec"]["replicas"])]
    assert list(cfg.etcd_endpoints) == members
    assert cfg.tokens and cfg.tls_cert and cfg.etcd_ca and cfg.etcd_cert and not cfg.insecure
    assert cfg.port == named("Service", "elastic-rendezvous")["spec"]["ports"][0]["port"]
    # The leader hint a follower sends is the address a worker was given: its failover follows it.
    assert cfg.advertise_address == f"{env['POD_NAME']}.elastic-rendezvous.{NAMESPACE}.svc:{cfg.port}"
    assert cfg.advertise_address in worker_config(mounted).rendezvous


def test_the_workers_args_parse_and_join_every_replica_with_the_token_over_tls(mounted):
    cfg = worker_config(mounted)
    replicas = named("StatefulSet", "elastic-rendezvous")["spec"]["replicas"]
    assert cfg.rendezvous == tuple(f"elastic-rendezvous-{i}.elastic-rendezvous.{NAMESPACE}.svc:29400"
                                   for i in range(replicas))
    assert cfg.token and cfg.tls_ca and cfg.tls_ca.endswith("/ca/ca.crt")
    assert not cfg.embedded and cfg.slurm is None
    job = named("Job", "elastic-train")
    assert cfg.max_np == job["spec"]["parallelism"] * cfg.np == job["spec"]["completions"] * cfg.np
    assert re.fullmatch(r"[0-9a-f-]{36}", cfg.job_id) and cfg.host.startswith("elastic-train-0-")


def test_the_grace_period_outlasts_preempt_grace_and_the_stop_timeout():
    # An eviction must end as a graceful leave: elastic-run SIGKILLs a worker that reached no commit
    # after --preempt-grace + --stop-timeout; the kubelet SIGKILLs elastic-run after the pod's grace.
    cfg = worker_config()
    grace = pod_spec(named("Job", "elastic-train"))["terminationGracePeriodSeconds"]
    assert grace > cfg.preempt_grace + cfg.stop_timeout, (grace, cfg.preempt_grace, cfg.stop_timeout)


def test_a_lost_worker_pod_is_replaced_and_a_failed_job_is_not_retried():
    job = named("Job", "elastic-train")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and pod_spec(job)["restartPolicy"] == "Never"
    assert spec["backoffLimitPerIndex"] >= 1 and spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    fail_job = [r for r in rules if r["action"] == "FailJob"]
    assert len(fail_job) == 1 and fail_job[0]["onExitCodes"]["containerName"] == "worker"
    # Our own exit statuses: bad flags (2) and a world below --min-np (3).
    assert set(fail_job[0]["onExitCodes"]["values"]) == {2, JobBelowMinNp.exit_code}


def test_every_name_a_client_dials_is_in_the_tls_certificate(mounted):
    cert = next(d for d in load(os.path.join(CERT_MANAGER, "certificate.yaml"))
                if d["kind"] == "Certificate" and d["spec"]["secretName"] == "elastic-ring-tls")
    names = set(cert["spec"]["dnsNames"])
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    dialed = {dns_name(a) for a in worker_config(mounted).rendezvous}
    dialed |= {dns_name(a) for a in rendezvous_config(mounted)[0].etcd_endpoints}
    etcd = named("StatefulSet", "etcd")
    for i in range(etcd["spec"]["replicas"]):   # each member, as its peers and clients reach it
        args, _ = container_args(etcd, "etcd")
        args = [a.replace("etcd-0", f"etcd-{i}") if a.startswith("--advertise") or a.startswith("--initial-advertise")
                else a for a in args]
        for a in args:
            if a.startswith(("--advertise-client-urls=", "--initial-advertise-peer-urls=", "--initial-cluster=")):
                dialed |= {dns_name(u.split("=", 1)[-1]) for u in a.split("=", 1)[1].split(",")}
    assert dialed <= names, sorted(dialed - names)
    assert not any("*" in n for n in names), "etcd checks a peer's names against its address: no wildcards"


def test_etcd_serves_and_verifies_tls_from_the_mounted_secret(mounted):
    etcd = named("StatefulSet", "etcd")
    args, env = container_args(etcd, "etcd")
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in on_disk(args[1:], etcd, "etcd", mounted))
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in flags
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file", "--peer-trusted-ca-file", "--peer-cert-file",
                 "--peer-key-file"):
        assert os.path.isfile(flags[flag]), flag
    members = flags["--initial-cluster"].split(",")
    assert [m.split("=")[0] for m in members] == [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    assert flags["--name"] == env["POD_NAME"] and flags["--listen-client-urls"].startswith("https://")
    ports = container_ports(etcd)
    assert flags["--listen-client-urls"].endswith(f":{ports['client']}")
    assert flags["--listen-peer-urls"].endswith(f":{ports['peer']}")
