"""Writes deploy/base/ (kustomize) from the Helm chart's default render, so the two never differ:
`make deploy-base` runs it, and deploy/tests/test_manifests.py fails when deploy/base is stale.

Usage: gen_base.py HELM OUT_DIR. Helm-only labels (helm.sh/chart, managed-by: Helm) are dropped;
the CRDs are copied from crds/ as they are; a Namespace with the restricted Pod Security level is added.
The chart needs the API server's addresses for its NetworkPolicies and kustomize cannot look them up:
the base holds API_SERVER, an address of the documentation range that matches no API server, for
every install to patch with its own (deploy/README.md; the example overlay shows the patch)."""

import os
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMESPACE = "sluice-system"
HEADER = "# Generated from charts/sluice (default values) by `make deploy-base`: edit the chart, not this file.\n"
FILES = {  # kind -> file of deploy/base
    "ServiceAccount": "rbac.yaml",
    "ClusterRole": "rbac.yaml",
    "ClusterRoleBinding": "rbac.yaml",
    "Role": "rbac.yaml",
    "RoleBinding": "rbac.yaml",
    "RuntimeClass": "runtimeclass.yaml",
    "NetworkPolicy": "networkpolicies.yaml",
    "FlowSchema": "apipriority.yaml",
    "PriorityLevelConfiguration": "apipriority.yaml",
}
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
API_SERVER = "192.0.2.1/32"  # RFC 5737 TEST-NET-1: never a real API server
NOTES = {  # file of deploy/base -> what its reader must do
    "networkpolicies.yaml": f"# The API server's address {API_SERVER} is a placeholder that matches nothing: patch in yours\n"
                            "# (kubectl get endpointslice kubernetes -n default), as deploy/overlays/example does.\n",
}


def strip_helm_labels(obj):
    if isinstance(obj, dict):
        labels = obj.get("labels")
        if isinstance(labels, dict):
            for key in HELM_LABELS:
                labels.pop(key, None)
        for value in obj.values():
            strip_helm_labels(value)
    elif isinstance(obj, list):
        for value in obj:
            strip_helm_labels(value)


def file_for(obj):
    if obj["kind"] in FILES:
        return FILES[obj["kind"]]
    return f"{obj['metadata']['labels']['app.kubernetes.io/component']}.yaml"  # operator.yaml, gateway.yaml


def render(helm):
    out = subprocess.run([helm, "template", "sluice", os.path.join(ROOT, "charts", "sluice"), "--namespace", NAMESPACE,
                          "--set", f"networkPolicy.apiServer.cidrs={{{API_SERVER}}}"],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def main(helm, out_dir):
    files = {"namespace.yaml": [{
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": {
            "app.kubernetes.io/part-of": "sluice",
            "pod-security.kubernetes.io/enforce": "restricted"}}}]}
    for obj in render(helm):
        strip_helm_labels(obj)
        files.setdefault(file_for(obj), []).append(obj)
    os.makedirs(os.path.join(out_dir, "crds"), exist_ok=True)
    crds = sorted(f for f in os.listdir(os.path.join(ROOT, "crds")) if f.endswith(".yaml"))
    for name in crds:
        shutil.copyfile(os.path.join(ROOT, "crds", name), os.path.join(out_dir, "crds", name))
    for name, objs in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(HEADER)
            f.write(NOTES.get(name, ""))
            f.write(yaml.safe_dump_all(objs, sort_keys=False, width=120))
    resources = [f"crds/{c}" for c in crds] + sorted(files)
    with open(os.path.join(out_dir, "kustomization.yaml"), "w") as f:
        f.write(HEADER)
        f.write(yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                "resources": resources}, sort_keys=False))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
