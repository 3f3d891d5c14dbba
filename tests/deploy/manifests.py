"""deploy/kubernetes/'s manifests as the tests read them: the documents, the workloads and their pods,
the references between them resolved the way a cluster would, and each container's arguments as
its process would see them (the downward API's values, Secret files under a local directory)."""

from __future__ import annotations

import os
import re
import sys
import uuid
from typing import Dict, List, Optional, Tuple

import yaml

from elastic.launch.flags import parse as parse_launch
from rendezvous.cli import parser as rendezvous_parser, config_from_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(REPO, "deploy", "kubernetes")
CERT_MANAGER = os.path.join(BASE, "cert-manager")
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


def pod_workloads() -> List[dict]:
    """Every workload that makes pods."""
    return [w for k in WORKLOADS for w in of_kind(k)]


def all_containers(workload: dict) -> List[dict]:
    """The pod's containers, its init containers included."""
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def certificates() -> Dict[str, dict]:
    """cert-manager's Certificates, by the Secret each writes."""
    return {d["spec"]["secretName"]: d for d in load(os.path.join(CERT_MANAGER, "certificate.yaml"))
            if d["kind"] == "Certificate"}


def secret_at(workload: dict, container: str, path: str) -> str:
    """The Secret whose volume holds the file at ``path`` in that container."""
    c = next(c for c in all_containers(workload) if c["name"] == container)
    mount = next((m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")), None)
    assert mount is not None, f"{workload['metadata']['name']}/{container}: {path} is not on a mounted volume"
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"{path} is on volume {volume['name']}, not a Secret"
    return volume["secret"]["secretName"]


def policy_flows(direction: str) -> Dict[Tuple[str, str], Optional[set]]:
    """What the per-workload NetworkPolicies allow in ``direction`` ("Ingress" or "Egress"): (the
    workload a policy selects, the workload at the other end) -> TCP ports (None: every port).
    The namespace-wide policies (podSelector {}) are left to their own test."""
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    flows: Dict[Tuple[str, str], Optional[set]] = {}
    for pol in of_kind("NetworkPolicy"):
        name = pol["metadata"]["name"]
        if pol["spec"]["podSelector"] == {}:
            continue
        targets = workloads_selected(pol["spec"]["podSelector"])
        assert len(targets) == 1, name
        assert direction in pol["spec"]["policyTypes"], f"{name}: its pods are not isolated for {direction}"
        for rule in pol["spec"].get(rules_key, []):
            assert rule.get(peers_key), f"{name}: an empty '{peers_key}' allows everyone"
            for peer in rule[peers_key]:
                assert set(peer) == {"podSelector"}, f"{name}: only pods of this namespace"
                others = workloads_selected(peer["podSelector"])
                assert len(others) == 1, name
                ports = None
                if "ports" in rule:
                    assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"]), name
                    ports = {p["port"] for p in rule["ports"]}
                    listener = targets[0] if direction == "Ingress" else others[0]
                    assert ports <= set(container_ports(listener).values()), (name, ports)
                flows[(targets[0]["metadata"]["name"], others[0]["metadata"]["name"])] = ports
    return flows


def secrets_defined() -> Dict[str, set]:
    """Secret name -> its keys: the kustomization's generators and cert-manager's Certificates."""
    defined = {g["name"]: {os.path.basename(f.split("=")[0]) for f in g["files"]}
               for g in kustomization(BASE)["secretGenerator"]}
    assert kustomization(BASE)["generatorOptions"]["disableNameSuffixHash"], "pods name the Secrets as written"
    for d in load(os.path.join(CERT_MANAGER, "certificate.yaml")):
        if d["kind"] == "Certificate":
            defined[d["spec"]["secretName"]] = {"tls.crt", "tls.key", "ca.crt"}
    return defined



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

