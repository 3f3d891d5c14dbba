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

import kubernetes_validate
import pytest
import yaml

from elastic.launch.launcher import JobBelowMinNp

from .manifests import (BASE, CERT_MANAGER, DOCS, NAMESPACE, WORKLOADS, certificates, container_args, container_ports,
                        dns_name, kustomization, load, named, of_kind, on_disk, pod_labels, pod_spec, policy_flows,
                        rendezvous_config, secrets_defined, selects, worker_config, workloads_selected)

# The oldest Kubernetes whose Job has backoffLimitPerIndex and podFailurePolicy GA (1.33), and
# the newest schema the pinned kubernetes-validate bundles.
VERSIONS = ("1.33.0", kubernetes_validate.latest_version())


# ---------------------------------------------------------------------- the API schema
def test_the_kustomization_lists_every_manifest_of_the_directory():
    listed = set(kustomization(BASE)["resources"])
    present = {f for f in os.listdir(BASE) if f.endswith(".yaml") and f != "kustomization.yaml"}
    assert listed == present
    assert kustomization(CERT_MANAGER)["resources"] == ["..", "certificate.yaml"]
    assert kustomization(CERT_MANAGER)["namespace"] == NAMESPACE


@pytest.mark.slow
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
    # (policy target, source) -> ports (None: every port); the namespace-wide policies admit
    # nothing in (test_kubernetes_hardening.py checks them).
    assert policy_flows("Ingress") == {("etcd", "elastic-rendezvous"): {2379}, ("etcd", "etcd"): {2379, 2380},
                                       ("elastic-rendezvous", "elastic-train"): {29400},
                                       ("elastic-train", "elastic-train"): None}
    assert all("ingress" not in p["spec"] for p in of_kind("NetworkPolicy") if p["spec"]["podSelector"] == {})


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
    # With the key, a worker could pose as a rendezvous replica to the other workers.
    job = named("Job", "elastic-train")
    tls = [v for v in pod_spec(job)["volumes"] if v.get("secret", {}).get("secretName") == "elastic-ring-tls"]
    assert len(tls) == 1 and tls[0]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


# ---------------------------------------------------------------------- the arguments, parsed by our parsers

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


def test_every_name_a_client_dials_is_in_its_servers_certificate(mounted):
    certs = certificates()
    rendezvous, etcd_server, etcd_peer = (certs[n] for n in ("elastic-ring-tls", "elastic-ring-etcd-server",
                                                               "elastic-ring-etcd-peer"))
    assert "server auth" in rendezvous["spec"]["usages"] and "server auth" in etcd_server["spec"]["usages"]
    assert {"server auth", "client auth"} <= set(etcd_peer["spec"]["usages"])   # a member dials and is dialed
    dialed = {"elastic-ring-tls": {dns_name(a) for a in worker_config(mounted).rendezvous},
              "elastic-ring-etcd-server": {dns_name(a) for a in rendezvous_config(mounted)[0].etcd_endpoints},
              "elastic-ring-etcd-peer": set()}
    etcd = named("StatefulSet", "etcd")
    for i in range(etcd["spec"]["replicas"]):   # each member, as its peers and clients reach it
        args, _ = container_args(etcd, "etcd")
        args = [a.replace("etcd-0", f"etcd-{i}") if a.startswith("--advertise") or a.startswith("--initial-advertise")
                else a for a in args]
        for a in args:
            flag, _, value = a.partition("=")
            urls = {dns_name(u.split("=", 1)[-1]) for u in value.split(",")}
            if flag == "--advertise-client-urls":
                dialed["elastic-ring-etcd-server"] |= urls
            elif flag in ("--initial-advertise-peer-urls", "--initial-cluster"):
                dialed["elastic-ring-etcd-peer"] |= urls
    for secret, names in dialed.items():
        assert names and names <= set(certs[secret]["spec"]["dnsNames"]), (secret, sorted(names))
        assert not any("*" in n for n in certs[secret]["spec"]["dnsNames"]), \
            f"{secret}: etcd checks a peer's names against its address: no wildcards"


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
