"""Validation of every manifest Sluice ships, with real tools (`make test-manifests`, run by the
.venv-tools python that `make tools` installs):

- Kubernetes objects: kubernetes-validate, strict (unknown fields fail, as with `kubectl apply`),
  against the OpenAPI schemas it bundles for the oldest Kubernetes the chart supports and for the one
  the code is built against;
- HookChain and Capability objects: jsonschema against the openAPIV3Schema of crds/*.yaml;
- the chart: `helm lint --strict` and `helm template` with default and non-default values;
- deploy/: `kubectl kustomize` of the base and the example overlay;
- `sluice-operator render` of the examples (target/debug/sluice-operator, built by test-rust).

deploy/tests/invalid/ holds broken manifests: each must fail, or the validator proves nothing."""

import atexit
import base64
import copy
import filecmp
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("SLUICE_TOOLS_BIN", os.path.dirname(sys.executable))
HELM = os.path.join(BIN, "helm")
KUBECTL = os.path.join(BIN, "kubectl")
OPERATOR = os.path.join(ROOT, "target", "debug", "sluice-operator")
KUBE_VERSIONS = ("1.27.0", "1.33.0")  # the chart's kubeVersion floor; the k8s-openapi feature (v1_33)
# API versions newer than the chart's floor, rendered only where the cluster serves them.
API_SINCE = {"flowcontrol.apiserver.k8s.io/v1": "1.29.0"}
CHART = os.path.join(ROOT, "charts", "sluice")
NAMESPACE = "sluice-system"
# The NetworkPolicies need the API server's addresses, which the chart looks up only when it installs
# into a cluster: every render here gives one, as any render without a cluster must.
API_SERVER = "192.0.2.1/32"


VALUES_DIR = tempfile.mkdtemp(prefix="sluice-values-")
atexit.register(shutil.rmtree, VALUES_DIR, True)


def values_file(values):
    """A file of Helm values (a later -f overrides an earlier one; every --set overrides them all)."""
    with tempfile.NamedTemporaryFile("w", dir=VALUES_DIR, suffix=".yaml", delete=False) as f:
        yaml.safe_dump(values, f)
    return f.name


CLUSTER_VALUES = ("-f", values_file({"networkPolicy": {"apiServer": {"cidrs": [API_SERVER]}}}))

# The rules each component needs, by where (chains, sandboxes, release): derived from the requests
# the real operator and gateway make by e2e/tests/e2e/kube_rbac.rs. The chart must grant exactly these.
def load_required():
    with open(os.path.join(ROOT, "deploy", "tests", "rbac_required.yaml")) as f:
        required = yaml.safe_load(f)
    return {who: {scope: {(r["apiGroup"], r["resource"], v) for r in rules for v in r["verbs"]}
                  for scope, rules in scopes.items()}
            for who, scopes in required.items()}


REQUIRED_RBAC = load_required()
SANDBOXES = "sluice-sandboxes"


def granted(objs, namespace=NAMESPACE):
    """What the rendered RBAC grants each of the two ServiceAccounts of the release in `namespace`,
    as a set of (namespace or "*" for cluster-wide, apiGroup, resource, verb). A binding to anyone
    else fails."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objs if o["kind"] in ("Role", "ClusterRole")}
    out = {}
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = b["roleRef"]
        role_ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles[(ref["kind"], role_ns, ref["name"])]
        where = b["metadata"].get("namespace") if b["kind"] == "RoleBinding" else "*"
        for subject in b["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == namespace, subject
            who = subject["name"].removeprefix("sluice-")
            for rule in role["rules"]:
                out.setdefault(who, set()).update(
                    (where, g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])
    return out


def expected_rbac(watch_namespace, sandbox_namespace, platform_namespace=NAMESPACE, release_namespace=NAMESPACE,
                  objs=()):
    """REQUIRED_RBAC placed in the namespaces an install shape puts each scope in, and, when the
    operator of `objs` makes certificates, what that takes (certificate_rbac)."""
    chains = {"*"} if not watch_namespace else {watch_namespace, platform_namespace}
    where = {"chains": chains, "sandboxes": {sandbox_namespace} if sandbox_namespace else chains,
             "release": {release_namespace},
             # Nodes: read by an operator not confined to watchNamespace (operator.watchNodes).
             "cluster": set() if watch_namespace else {"*"}}
    out = {who: {(ns, *rule) for scope, rules in scopes.items() for ns in where[scope] for rule in rules}
           for who, scopes in REQUIRED_RBAC.items()}
    out["operator"] |= certificate_rbac(objs, release_namespace)
    return out


def operator_args(objs):
    for o in objs:
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "sluice-operator":
            return o["spec"]["template"]["spec"]["containers"][0]["args"]
    return []


def certificate_rbac(objs, release_namespace=NAMESPACE):
    """The operator's rules for the certificates it makes (operator/src/certs): its Secrets and
    ConfigMap in the release namespace, and the webhook configuration whose caBundle it keeps. Not
    derived by kube_rbac.rs (the fake API server has no Secrets); the cluster suite installs with
    exactly these under a real RBAC authorizer, so a missing one fails there."""
    args = operator_args(objs)
    if not any(a.startswith("--ca-secret=") for a in args):
        return set()
    ns = release_namespace
    rules = {(ns, "", "secrets", v) for v in ("create", "get", "update", "delete")}
    rules |= {(ns, "", "configmaps", v) for v in ("create", "get", "update")}
    if any(a.startswith("--webhook-configuration=") for a in args):
        rules |= {("*", "admissionregistration.k8s.io", "validatingwebhookconfigurations", v) for v in ("get", "update")}
    return rules


def run(*cmd, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc.stdout


def load_all(text):
    return [d for d in yaml.safe_load_all(text) if d is not None]


def load_file(path):
    with open(path) as f:
        return load_all(f.read())


def helm_args(sets=(), values=None):
    """`--set` for each of `sets`, and `-f` of a file holding `values` (lists of strings that --set
    would split or misread)."""
    args = list(CLUSTER_VALUES)
    if values is not None:
        args += ["-f", values_file(values)]
    return args + [a for v in sets for a in ("--set", v)]


def helm_template(*sets, values=None, release="sluice", namespace=NAMESPACE):
    return load_all(run(HELM, "template", release, CHART, "--namespace", namespace, "--include-crds",
                        *helm_args(sets, values)))


def helm_refusal(*sets, values=None, release="sluice"):
    """The error of a render that must fail."""
    proc = subprocess.run([HELM, "template", release, CHART, "--namespace", NAMESPACE, *helm_args(sets, values)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, f"rendered: {sets} {values}"
    return proc.stderr


# The egress every NetworkPolicy of the operator and the gateway starts with.
DNS_RULE = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
API_SERVER_RULE = {"to": [{"ipBlock": {"cidr": API_SERVER}}],
                   "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
# The ClusterRoles for people (templates/roles.yaml) of release "sluice", by default.
USER_ROLES = ("sluice-hookchain-edit", "sluice-view", "sluice-platform")


def open_egress(policy):
    """What lets a NetworkPolicy's pods reach more than named places: an egress rule without `to`
    (every destination), a peer selecting every namespace (`namespaceSelector: {}`), a peer with no
    selector, an ipBlock of /0."""
    found = []
    for i, rule in enumerate(policy["spec"].get("egress") or []):
        if not rule.get("to"):
            found.append(f"egress[{i}] has no `to`")
        for peer in rule.get("to") or []:
            if not peer or ("namespaceSelector" in peer and not peer["namespaceSelector"]):
                found.append(f"egress[{i}] selects every namespace: {peer}")
            if peer.get("ipBlock", {}).get("cidr", "").endswith("/0"):
                found.append(f"egress[{i}] allows every address: {peer}")
    if "Egress" not in policy["spec"].get("policyTypes", []):
        found.append("egress is not restricted (no Egress in policyTypes)")
    return found


def kustomize(path):
    return load_all(run(KUBECTL, "kustomize", os.path.join(ROOT, path)))


def crd_schema(schema):
    """A CRD's openAPIV3Schema as plain JSON Schema: `nullable` becomes a null type, int-or-string
    takes both, and objects with listed properties refuse others (the API server prunes unknown fields,
    and `kubectl apply` rejects them with strict field validation). CEL rules are not evaluated here."""
    schema = copy.deepcopy(schema)

    def fix(node):
        if isinstance(node, list):
            for n in node:
                fix(n)
            return
        if not isinstance(node, dict):
            return
        if node.pop("nullable", False) and "type" in node:
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = list(node["enum"]) + [None]
        if node.pop("x-kubernetes-int-or-string", False):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in ("properties", "patternProperties"):
                for v in value.values():
                    fix(v)
            elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "not"):
                fix(value)

    fix(schema)
    # The API server adds these to every root schema.
    schema["properties"].setdefault("apiVersion", {"type": "string"})
    schema["properties"].setdefault("kind", {"type": "string"})
    schema["properties"].setdefault("metadata", {"type": "object"})
    return schema


def cert_manager_errors(what, obj):
    """No schema for cert-manager's CRDs here: check the fields Sluice sets (the gateway's TLS)."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "Issuer":
        kinds = [k for k in ("selfSigned", "ca", "acme", "vault", "venafi") if k in spec]
        ok = len(kinds) == 1 and (kinds[0] != "ca" or spec["ca"].get("secretName"))
        return [] if ok else [f"{what}: needs exactly one issuer type (selfSigned, ca with a secretName, ...)"]
    ref = spec.get("issuerRef") or {}
    errors = []
    if not spec.get("secretName"):
        errors.append(f"{what}: spec.secretName is required")
    if not ref.get("name") or ref.get("kind", "Issuer") not in ("Issuer", "ClusterIssuer"):
        errors.append(f"{what}: spec.issuerRef needs a name and kind Issuer or ClusterIssuer")
    if not spec.get("isCA") and not (spec.get("dnsNames") or spec.get("uris") or spec.get("ipAddresses")):
        errors.append(f"{what}: a serving certificate needs dnsNames, uris or ipAddresses")
    unknown = set(spec) - {"secretName", "issuerRef", "isCA", "commonName", "duration", "renewBefore", "privateKey",
                           "usages", "dnsNames", "uris", "ipAddresses", "subject", "secretTemplate"}
    if unknown:
        errors.append(f"{what}: unknown fields {sorted(unknown)}")
    return errors


class Validator:
    """Validates any object Sluice ships; `errors(obj)` lists what is wrong (empty when valid)."""

    def __init__(self):
        self.crds = {}
        for path in sorted(glob.glob(os.path.join(ROOT, "crds", "*.yaml"))):
            (crd,) = load_file(path)
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                self.crds[key] = jsonschema.Draft7Validator(crd_schema(version["schema"]["openAPIV3Schema"]))

    def errors(self, obj):
        if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
            return ["not a Kubernetes object (no apiVersion and kind)"]
        what = f"{obj['kind']} {obj.get('metadata', {}).get('name', '?')}"
        key = (obj["apiVersion"], obj["kind"])
        if key in self.crds:
            errors = [f"{what}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                      for e in self.crds[key].iter_errors(obj)]
            if not obj.get("metadata", {}).get("name"):
                errors.append(f"{what}: metadata.name is required")
            return errors
        if key in (("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer")):
            return cert_manager_errors(what, obj)
        if key == ("monitoring.coreos.com/v1", "PrometheusRule"):
            # No schema here either; promtool checks the rules themselves (test_monitoring.py).
            groups = obj.get("spec", {}).get("groups") or []
            ok = groups and all(g.get("name") and g.get("rules") for g in groups)
            return [] if ok else [f"{what}: needs spec.groups, each with a name and rules"]
        if key == ("cilium.io/v2", "CiliumNetworkPolicy"):
            # No schema for Cilium's CRDs here either: the selector and the API-server entity.
            spec = obj.get("spec", {})
            ok = spec.get("endpointSelector", {}).get("matchLabels") and \
                spec.get("egress") == [{"toEntities": ["kube-apiserver"]}]
            return [] if ok else [f"{what}: needs spec.endpointSelector.matchLabels and egress toEntities kube-apiserver"]
        if key == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            # No schema for the Prometheus Operator's CRDs here: check the fields Sluice sets.
            spec = obj.get("spec", {})
            ok = spec.get("selector", {}).get("matchLabels") and all(e.get("port") for e in spec.get("endpoints") or [{}])
            return [] if ok else [f"{what}: needs spec.selector.matchLabels and endpoints with a port"]
        errors = []
        # An API the chart renders only where the cluster serves it (.Capabilities.APIVersions) is
        # checked against the versions that have it.
        since = tuple(int(p) for p in API_SINCE.get(obj["apiVersion"], "0").split("."))
        for version in [v for v in KUBE_VERSIONS if tuple(int(p) for p in v.split(".")) >= since]:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                errors.append(f"{what}: no schema for {obj['apiVersion']} {obj['kind']} in Kubernetes {version}")
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{what} (Kubernetes {version}): {'.'.join(map(str, e.path)) or '(root)'}: {e.message}")
        return errors


VALIDATOR = Validator()


class ManifestCase(unittest.TestCase):
    def assertValid(self, objs, source):
        self.assertTrue(objs, f"{source}: no objects")
        errors = [e for obj in objs for e in VALIDATOR.errors(obj)]
        self.assertEqual(errors, [], f"{source} is invalid")

    def find(self, objs, kind, name):
        found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
        self.assertEqual(len(found), 1, f"exactly one {kind} {name}")
        return found[0]


class ValidatorTest(ManifestCase):
    def test_every_invalid_manifest_fails(self):
        paths = sorted(glob.glob(os.path.join(ROOT, "deploy", "tests", "invalid", "*.yaml")))
        self.assertGreaterEqual(len(paths), 7)
        for path in paths:
            (obj,) = load_file(path)
            self.assertNotEqual(VALIDATOR.errors(obj), [], f"{os.path.basename(path)} passed validation")

    def test_crds_are_valid_custom_resource_definitions(self):
        for path in sorted(glob.glob(os.path.join(ROOT, "crds", "*.yaml"))):
            self.assertValid(load_file(path), path)

    def test_examples_match_the_crd_schemas(self):
        paths = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
        kinds = set()
        for path in paths:
            objs = load_file(path)
            kinds |= {o["kind"] for o in objs}
            self.assertValid(objs, path)
        self.assertEqual(kinds, {"HookChain", "Capability"})


class ChartTest(ManifestCase):
    VARIANTS = {
        "defaults": [],
        "everything on": ["serviceMonitor.enabled=true", "podDisruptionBudget.enabled=true", "operator.replicas=2",
                          "grafanaDashboard.enabled=true", "prometheusRule.enabled=true",
                          "image.pullSecrets[0]=regcred", "runtimeClass.nodeSelector.sandbox=gvisor"],
        "one namespace": ["watchNamespace=team-a"],
        "single namespace": ["watchNamespace=team-a", "sandboxNamespace.name="],
        "cilium": ["networkPolicy.cilium.enabled=true", "sandboxNamespace.create=false"],
        "features off": ["networkPolicy.enabled=false", "runtimeClass.create=false", "rbac.create=false",
                         "serviceAccount.create=false"],
        "webhook (cert-manager)": ["webhook.enabled=true", "operator.replicas=2"],
        "webhook (own issuer, one namespace)": ["webhook.enabled=true", "webhook.certificate.issuerRef.kind=ClusterIssuer",
                                                "webhook.certificate.issuerRef.name=internal-ca", "watchNamespace=team-a"],
        "webhook (own Secret)": ["webhook.enabled=true", "webhook.certificate.source=secret",
                                 "webhook.certificate.secretName=my-webhook-tls", "webhook.certificate.caBundle=Y2E=",
                                 "webhook.failurePolicy=Ignore", "webhook.timeoutSeconds=5"],
        "gateway TLS from a Secret, mutual TLS": ["gateway.tls.mode=secret", "gateway.tls.secretName=gw-tls",
                                                  "gateway.tls.clientCA.enabled=true",
                                                  "gateway.callers.existingConfigMap=my-callers"],
        "gateway TLS from an issuer": ["gateway.tls.certManager.issuerRef.name=corp-ca",
                                       "gateway.tls.certManager.issuerRef.kind=ClusterIssuer",
                                       "gateway.tls.certManager.dnsNames[0]=sluice.example.com"],
        "gateway plain (insecure)": ["gateway.tls.mode=none", "gateway.callers.enabled=false", "gateway.insecure=true"],
        "capabilities": ["capabilities.allowedEndpoints={billing/ledger:7002,llm/*,api.example.com:443,10.1.2.3}",
                         "capabilities.egressCIDRs={203.0.113.0/24}", "capabilities.credentials[0].name=ledger",
                         "capabilities.credentials[0].secretName=ledger-credentials",
                         "networkPolicy.gateway.otlpCollector.namespace=observability",
                         "rbac.aggregateCapabilitiesToAdmin=true"],
        "GKE DNS": ["networkPolicy.dns.resolvers={cloudDNS,nodeLocalDNSCache}", "networkPolicy.dns.cidrs={10.96.0.10/32}"],
        "names of a second release": ["fullnameOverride=sluice-canary", "runtimeClass.create=false",
                                      "webhook.enabled=true", "grafanaDashboard.enabled=true"],
    }

    def test_helm_lint_strict(self):
        for name, values in self.VARIANTS.items():
            with self.subTest(name):
                run(HELM, "lint", "--strict", CHART, *helm_args(values))

    def test_values_schema_refuses_typos_and_wrong_types(self):
        for bad in ("gateway.tls.mode=plain", "gateway.callers.callers[0].name=x", "gateway.tls.clientCA.enabled=yes",
                    "operator.replica=2", "gateway.claimTimeout=soon", "operator.claimDeadline=300", "operator.claimDeadline=5d", "operator.startDeadline=2", "gateway.claimTimeout=5", "image.pullPolicy=Sometimes", "gateway.replicas=0",
                    "networkPolicy.apiServer.ports[0]=https",
                    "webhook.failurePolicy=Sometimes", "webhook.timeoutSeconds=60", "webhook.certificate.source=vault",
                    "webhook.certificat.source=secret", "gateway.exec.pingEvery=0s", "gateway.exec.pingDeadline=soon",
                    "gateway.exec.pingevery=5s"):
            proc = subprocess.run([HELM, "template", "sluice", CHART, *CLUSTER_VALUES, "--set", bad],
                                  capture_output=True, text=True, timeout=120)
            self.assertNotEqual(proc.returncode, 0, f"--set {bad} was accepted")
            self.assertIn("schema", proc.stderr, bad)

    def test_every_variant_renders_valid_objects(self):
        for name, values in self.VARIANTS.items():
            with self.subTest(name):
                self.assertValid(helm_template(*values), f"helm template ({name})")

    # Install shapes: (values, watchNamespace, sandbox namespace).
    SHAPES = {
        "dedicated sandbox namespace": ([], "", SANDBOXES),
        "dedicated sandbox namespace, one watched namespace": (["watchNamespace=team-a"], "team-a", SANDBOXES),
        "single namespace": (["watchNamespace=team-a", "sandboxNamespace.name="], "team-a", ""),
        "single namespace, baselines there": (["watchNamespace=sluice-system", "sandboxNamespace.name="], "sluice-system", ""),
    }

    def test_rbac_grants_exactly_what_the_components_use_in_every_shape(self):
        for shape, (values, watch, sandboxes) in self.SHAPES.items():
            with self.subTest(shape):
                objs = helm_template(*values)
                got, want = granted(objs), expected_rbac(watch, sandboxes, objs=objs)
                for who in ("operator", "gateway"):
                    self.assertEqual(sorted(got[who] - want[who]), [], f"{shape}: {who} is granted more than it uses")
                    self.assertEqual(sorted(want[who] - got[who]), [], f"{shape}: {who} lacks what it uses")
                # Pods, exec and NetworkPolicies: never cluster-wide, never outside the sandbox
                # namespace when there is one.
                for who in ("operator", "gateway"):
                    pod_rules = {ns for ns, g, r, v in got[who] if r in ("pods", "pods/exec", "networkpolicies")}
                    self.assertNotIn("*", pod_rules, shape)
                    if sandboxes:
                        self.assertEqual(pod_rules, {sandboxes}, f"{shape}: {who}")
                if watch:
                    # Cluster-wide: only the roles for people, which bind nobody.
                    self.assertFalse([o for o in objs if o["kind"] == "ClusterRoleBinding"], shape)
                    self.assertEqual({o["metadata"]["name"] for o in objs if o["kind"] == "ClusterRole"},
                                     set(USER_ROLES), shape)
                self.assertEqual([o for o in objs if o["kind"] == "Namespace"] != [], bool(sandboxes), shape)

    def test_the_rbac_check_fails_on_a_missing_or_extra_rule(self):
        objs = helm_template()
        want = expected_rbac("", SANDBOXES, objs=objs)
        role = self.find(objs, "Role", "sluice-gateway-sandboxes")
        role["rules"][0]["verbs"].append("update")
        self.assertNotEqual(granted(objs)["gateway"], want["gateway"], "an extra verb went unnoticed")
        role["rules"][0]["verbs"] = [v for v in role["rules"][0]["verbs"] if v not in ("update", "delete")]
        self.assertTrue(want["gateway"] - granted(objs)["gateway"], "a missing verb went unnoticed")

    def test_shapes_that_would_widen_rights_are_refused(self):
        for bad, why in ((["sandboxNamespace.name="], "watchNamespace"),
                         (["sandboxNamespace.name=sluice-system"], "namespace of its own"),
                         (["sandboxNamespace.name=team-a", "watchNamespace=team-a"], "namespace of its own")):
            proc = subprocess.run([HELM, "template", "sluice", CHART, "--namespace", NAMESPACE, *helm_args(bad)],
                                  capture_output=True, text=True, timeout=120)
            self.assertNotEqual(proc.returncode, 0, f"{bad} rendered")
            self.assertIn(why, proc.stderr, bad)

    def test_sandbox_namespace_is_restricted_and_denied_all_traffic(self):
        objs = helm_template()
        ns = self.find(objs, "Namespace", SANDBOXES)
        self.assertEqual(ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"], "restricted")
        deny = self.find(objs, "NetworkPolicy", "sluice-sandboxes-deny-all")
        self.assertEqual(deny["metadata"]["namespace"], SANDBOXES)
        self.assertEqual(deny["spec"], {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
        single = helm_template("watchNamespace=team-a", "sandboxNamespace.name=")
        self.assertFalse([o for o in single if o["metadata"]["name"] == "sluice-sandboxes-deny-all"],
                         "no namespace-wide deny-all where the operator and tenants live")

    def test_notes_point_at_what_a_user_can_run(self):
        out = run(HELM, "install", "--dry-run=client", "sluice", CHART, "--namespace", NAMESPACE, *CLUSTER_VALUES)
        notes = out[out.index("NOTES:"):]
        self.assertNotIn("sluice call", notes, "no sluice binary ships with the chart")
        self.assertIn("grpcurl -cacert ca.crt -servername sluice-gateway.sluice-system.svc", notes)
        self.assertNotIn("-plaintext", notes, "the gateway serves TLS by default")
        plain = run(HELM, "install", "--dry-run=client", "sluice", CHART, "--namespace", NAMESPACE, *CLUSTER_VALUES,
                    "--set", "gateway.tls.mode=none", "--set", "gateway.callers.enabled=false",
                    "--set", "gateway.insecure=true")
        self.assertIn("grpcurl -plaintext", plain[plain.index("NOTES:"):])
        self.assertIn("kubectl get pods -n sluice-sandboxes", notes)
        # The chain the notes apply is a valid HookChain.
        lines = notes.splitlines()
        start = lines.index("  kubectl apply -f - <<'EOF'") + 1
        end = lines.index("  EOF", start)
        (chain,) = load_all("\n".join(line[2:] for line in lines[start:end]))
        self.assertValid([chain], "the HookChain in NOTES.txt")

    def test_cilium_policy_allows_the_api_server_entity(self):
        self.assertFalse([o for o in helm_template() if o["kind"] == "CiliumNetworkPolicy"])
        objs = helm_template("networkPolicy.cilium.enabled=true")
        for component in ("operator", "gateway"):
            cnp = self.find(objs, "CiliumNetworkPolicy", f"sluice-{component}-kube-apiserver")
            self.assertEqual(cnp["spec"]["egress"], [{"toEntities": ["kube-apiserver"]}])
            self.assertEqual(cnp["spec"]["endpointSelector"]["matchLabels"]["app.kubernetes.io/component"], component)

    def test_deployments_follow_the_contract(self):
        objs = helm_template()
        ports = {"sluice-operator": {"metrics": 9465}, "sluice-gateway": {"grpc": 50051, "metrics": 9464}}
        for name, want_ports in ports.items():
            pod = self.find(objs, "Deployment", name)["spec"]["template"]["spec"]
            self.assertEqual(pod["serviceAccountName"], name)
            (c,) = pod["containers"]
            self.assertEqual(c["image"], f"ghcr.io/sluice-dev/{name}:0.2.0")
            self.assertEqual({p["name"]: p["containerPort"] for p in c["ports"]}, want_ports)
            env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
            self.assertEqual((env["POD_NAME"], env["POD_NAMESPACE"]), ("metadata.name", "metadata.namespace"))
            self.assertEqual((c["livenessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["port"]), ("/healthz", "metrics"))
            sc = c["securityContext"]
            self.assertEqual((sc["runAsNonRoot"], sc["runAsUser"], sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"]),
                             (True, 65534, True, False))
            self.assertEqual((sc["capabilities"]["drop"], sc["seccompProfile"]["type"]), (["ALL"], "RuntimeDefault"))
            self.assertIn("limits", c["resources"])
        gateway = self.find(objs, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(gateway["args"], ["--kube", f"--platform-namespace={NAMESPACE}", "--listen=0.0.0.0:50051",
                                           "--metrics=0.0.0.0:9464", "--claim-timeout=2s",
                                           "--kube-hold=1", "--exec-timeout=20s", "--exec-ping-every=5s",
                                           "--exec-ping-deadline=15s", "--runtime-class=gvisor",
                                           f"--sandbox-namespace={SANDBOXES}",
                                           "--tls-cert=/etc/sluice/tls/tls.crt", "--tls-key=/etc/sluice/tls/tls.key",
                                           "--callers=/etc/sluice/callers/callers.yaml"])
        self.assertEqual(gateway["readinessProbe"]["httpGet"]["path"], "/readyz")
        operator = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(operator["args"], ["run", "--runtime-class=gvisor",
                                            "--supervisor-image=ghcr.io/sluice-dev/sluice-supervisor:0.2.0",
                                            "--metrics=0.0.0.0:9465", "--lease-namespace=$(POD_NAMESPACE)",
                                            "--lease-name=sluice-operator", "--claim-deadline=300s", "--start-deadline=120s",
                                            f"--platform-namespace={NAMESPACE}", f"--sandbox-namespace={SANDBOXES}",
                                            "--sandbox-cpu-limit=1",
                                            # The gateway's certificate, made and kept by the operator (the default).
                                            "--ca-secret=sluice-ca", "--ca-configmap=sluice-ca", "--ca-lifetime=87600h",
                                            "--certificate-lifetime=2160h", "--certificate-check=1m",
                                            "--serving-certificate=sluice-gateway-tls=sluice-gateway,"
                                            f"sluice-gateway.{NAMESPACE},sluice-gateway.{NAMESPACE}.svc,"
                                            f"sluice-gateway.{NAMESPACE}.svc.cluster.local"])
        service = self.find(objs, "Service", "sluice-gateway")
        self.assertEqual({p["name"]: p["port"] for p in service["spec"]["ports"]}, {"grpc": 50051, "metrics": 9464})
        runtime_class = self.find(objs, "RuntimeClass", "gvisor")
        self.assertEqual(runtime_class["handler"], "runsc")
        self.assertEqual(runtime_class["overhead"]["podFixed"], {"cpu": "50m", "memory": "64Mi"})
        one_ns = helm_template("watchNamespace=team-a")
        for name in ports:
            args = self.find(one_ns, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]
            self.assertIn("--namespace=team-a", args)

    def test_gateway_is_secured_by_default_and_plain_only_when_asked(self):
        objs = helm_template()
        pod = self.find(objs, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.assertEqual(volumes["tls"]["secret"]["secretName"], "sluice-gateway-tls")
        self.assertEqual(volumes["callers"]["configMap"]["name"], "sluice-gateway-callers")
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        self.assertEqual((mounts["tls"], mounts["callers"]), ("/etc/sluice/tls", "/etc/sluice/callers"))
        # By default the operator makes the certificate: nothing of cert-manager's is rendered.
        self.assertFalse([o for o in objs if o["kind"] in ("Certificate", "Issuer")])
        # With cert-manager, the chart-made CA signs the serving certificate, for the Service's names.
        objs = helm_template("gateway.tls.mode=certManager")
        self.assertNotIn("--ca-secret=sluice-ca", args_of(objs, "sluice-operator"))
        cert = self.find(objs, "Certificate", "sluice-gateway")["spec"]
        self.assertEqual(cert["secretName"], "sluice-gateway-tls")
        self.assertEqual(cert["issuerRef"]["name"], "sluice-gateway-ca")
        self.assertIn(f"sluice-gateway.{NAMESPACE}.svc", cert["dnsNames"])
        self.assertTrue(self.find(objs, "Certificate", "sluice-gateway-ca")["spec"]["isCA"])
        self.assertEqual(self.find(objs, "Issuer", "sluice-gateway-ca")["spec"]["ca"]["secretName"], "sluice-gateway-ca")
        # The callers ConfigMap is a CallerPolicy as the gateway reads it; empty by default.
        policy = yaml.safe_load(self.find(objs, "ConfigMap", "sluice-gateway-callers")["data"]["callers.yaml"])
        self.assertEqual((policy["apiVersion"], policy["kind"], policy["callers"]),
                         ("sluice.dev/v1alpha1", "CallerPolicy", []))
        listed = helm_template("gateway.callers.callers[0].name=app",
                               "gateway.callers.callers[0].match.uriSAN=spiffe://example.org/ns/a/sa/app",
                               "gateway.callers.callers[0].namespaces[0]=team-a")
        policy = yaml.safe_load(self.find(listed, "ConfigMap", "sluice-gateway-callers")["data"]["callers.yaml"])
        self.assertEqual(policy["callers"], [{"name": "app", "match": {"uriSAN": "spiffe://example.org/ns/a/sa/app"},
                                              "namespaces": ["team-a"]}])
        # An issuer of the user's: no chart-made CA.
        issued = helm_template("gateway.tls.mode=certManager", "gateway.tls.certManager.issuerRef.name=corp-ca",
                               "gateway.tls.certManager.issuerRef.kind=ClusterIssuer")
        self.assertFalse([o for o in issued if o["kind"] == "Issuer"])
        self.assertEqual(self.find(issued, "Certificate", "sluice-gateway")["spec"]["issuerRef"],
                         {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
        # Mutual TLS against the serving Secret's ca.crt.
        mtls = helm_template("gateway.tls.clientCA.enabled=true")
        args = self.find(mtls, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]["containers"][0]["args"]
        self.assertIn("--client-ca=/etc/sluice/client-ca/ca.crt", args)
        # Plain gRPC or no caller policy only with gateway.insecure, which the gateway then gets.
        for plain in (["gateway.tls.mode=none"], ["gateway.callers.enabled=false"]):
            proc = subprocess.run([HELM, "template", "sluice", CHART, *helm_args(plain)],
                                  capture_output=True, text=True, timeout=120)
            self.assertNotEqual(proc.returncode, 0, plain)
            self.assertIn("gateway.insecure=true", proc.stderr)
        plain = helm_template("gateway.tls.mode=none", "gateway.callers.enabled=false", "gateway.insecure=true")
        pod = self.find(plain, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]
        self.assertEqual([a for a in pod["containers"][0]["args"] if a.startswith(("--tls", "--callers", "--insecure"))],
                         ["--insecure"])
        self.assertEqual([v["name"] for v in pod["volumes"]], ["tmp"])
        self.assertFalse([o for o in plain if o["kind"] in ("Certificate", "Issuer", "ConfigMap")])

    def test_gateway_network_policy_allows_clients_api_server_and_dns_only_by_default(self):
        objs = helm_template()
        policy = self.find(objs, "NetworkPolicy", "sluice-gateway")["spec"]
        self.assertEqual(policy["policyTypes"], ["Ingress", "Egress"])
        self.assertEqual([p["port"] for rule in policy["ingress"] for p in rule["ports"]], [50051, 9464])
        # No capability endpoint is allowed by default (built-ins need no network).
        self.assertEqual(policy["egress"], [DNS_RULE, API_SERVER_RULE])
        self.assertEqual(self.find(objs, "NetworkPolicy", "sluice-operator")["spec"]["egress"], [DNS_RULE, API_SERVER_RULE])
        self.assertFalse([o for o in helm_template("networkPolicy.enabled=false") if o["kind"] == "NetworkPolicy"])

    WEBHOOK_KINDS = ("ValidatingWebhookConfiguration", "Certificate", "Issuer")

    def webhook_objects(self, objs):
        # The gateway's own Certificates and Issuers (its TLS) are not the webhook's.
        return sorted((o["kind"], o["metadata"]["name"]) for o in objs
                      if (o["kind"] in self.WEBHOOK_KINDS or o["metadata"]["name"] == "sluice-operator-webhook")
                      and not o["metadata"]["name"].startswith("sluice-gateway"))

    def test_the_webhook_is_off_by_default(self):
        objs = helm_template()
        self.assertEqual(self.webhook_objects(objs), [])
        operator = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]
        self.assertFalse([a for a in operator["containers"][0]["args"] if a.startswith("--webhook")])
        self.assertEqual([v["name"] for v in operator["volumes"]], ["tmp"])
        policy = self.find(objs, "NetworkPolicy", "sluice-operator")["spec"]
        self.assertEqual([p["port"] for rule in policy["ingress"] for p in rule["ports"]], [9465])

    def test_webhook_with_cert_manager_is_wired_end_to_end(self):
        objs = helm_template("webhook.enabled=true", "webhook.certificate.source=certManager")
        self.assertEqual(self.webhook_objects(objs), [
            ("Certificate", "sluice-operator-webhook"), ("Certificate", "sluice-operator-webhook-ca"),
            ("Issuer", "sluice-operator-webhook-ca"), ("Issuer", "sluice-operator-webhook-selfsigned"),
            ("Service", "sluice-operator-webhook"), ("ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}")])
        config = self.find(objs, "ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}")
        certificate = self.find(objs, "Certificate", "sluice-operator-webhook")
        # cert-manager injects the CA of this very Certificate.
        self.assertEqual(config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
                         f"{NAMESPACE}/sluice-operator-webhook")
        (hook,) = config["webhooks"]
        self.assertEqual((hook["failurePolicy"], hook["timeoutSeconds"], hook["sideEffects"], hook["admissionReviewVersions"]),
                         ("Fail", 10, "None", ["v1"]))
        (rule,) = hook["rules"]
        self.assertEqual((rule["apiGroups"], sorted(rule["operations"]), sorted(rule["resources"])),
                         (["sluice.dev"], ["CREATE", "UPDATE"], ["capabilities", "hookchains"]))
        self.assertEqual(hook["namespaceSelector"], {})
        # Metadata-only updates (labels, finalizers) are not judged: an unreachable webhook with
        # failurePolicy Fail must not block the operator's finalizer (the cluster suite shows it).
        (condition,) = hook["matchConditions"]
        self.assertIn("object.spec != oldObject.spec", condition["expression"])
        self.assertNotIn("caBundle", hook["clientConfig"])
        # The Service the API server calls reaches the operator's webhook port, and the certificate names it.
        ref = hook["clientConfig"]["service"]
        self.assertEqual((ref["namespace"], ref["path"]), (NAMESPACE, "/validate"))
        service = self.find(objs, "Service", ref["name"])
        (port,) = service["spec"]["ports"]
        self.assertEqual((port["port"], port["targetPort"]), (ref["port"], "webhook"))
        self.assertIn(f"{ref['name']}.{NAMESPACE}.svc", certificate["spec"]["dnsNames"])
        # Signed by the chart's CA, which is what the API server trusts: a renewed leaf is trusted
        # at once (a self-signed leaf is not until cert-manager injects it).
        self.assertEqual(certificate["spec"]["issuerRef"], {"kind": "Issuer", "name": "sluice-operator-webhook-ca"})
        ca = self.find(objs, "Certificate", "sluice-operator-webhook-ca")
        self.assertTrue(ca["spec"]["isCA"])
        self.assertEqual(ca["spec"]["issuerRef"]["name"], "sluice-operator-webhook-selfsigned")
        self.assertEqual(self.find(objs, "Issuer", "sluice-operator-webhook-ca")["spec"], {"ca": {"secretName": ca["spec"]["secretName"]}})
        deployment = self.find(objs, "Deployment", "sluice-operator")
        self.assertEqual(service["spec"]["selector"], deployment["spec"]["selector"]["matchLabels"])
        pod = deployment["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        self.assertEqual({p["name"]: p["containerPort"] for p in c["ports"]}, {"metrics": 9465, "webhook": 9443})
        self.assertEqual([a for a in c["args"] if a.startswith("--webhook")],
                         ["--webhook-listen=0.0.0.0:9443", "--webhook-cert=/etc/sluice/webhook/tls.crt",
                          "--webhook-key=/etc/sluice/webhook/tls.key", "--webhook-review-timeout=8s"])
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "webhook-tls"]
        self.assertEqual(mount["mountPath"], "/etc/sluice/webhook")
        self.assertNotIn("subPath", mount, "a subPath mount would never see the rotated certificate")
        (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
        self.assertEqual(volume["secret"]["secretName"], certificate["spec"]["secretName"])
        # The API server (matched by address, it is not a pod) may reach the webhook port.
        policy = self.find(objs, "NetworkPolicy", "sluice-operator")["spec"]
        webhook_rules = [r for r in policy["ingress"] if any(p["port"] == 9443 for p in r["ports"])]
        self.assertEqual(webhook_rules, [{"from": [{"ipBlock": {"cidr": API_SERVER}},
                                                   {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                                                    "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}],
                                          "ports": [{"protocol": "TCP", "port": 9443}]}])

    def test_webhook_with_an_own_secret_or_issuer(self):
        objs = helm_template("webhook.enabled=true", "webhook.certificate.source=secret",
                             "webhook.certificate.secretName=my-webhook-tls", "webhook.certificate.caBundle=Y2E=",
                             "webhook.failurePolicy=Ignore", "webhook.timeoutSeconds=5")
        self.assertFalse([o for o in objs if o["kind"] in ("Certificate", "Issuer")
                          and not o["metadata"]["name"].startswith("sluice-gateway")])
        config = self.find(objs, "ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}")
        self.assertNotIn("annotations", config["metadata"])
        (hook,) = config["webhooks"]
        self.assertEqual((hook["clientConfig"]["caBundle"], hook["failurePolicy"], hook["timeoutSeconds"]), ("Y2E=", "Ignore", 5))
        pod = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
        self.assertEqual(volume["secret"]["secretName"], "my-webhook-tls")
        self.assertIn("--webhook-review-timeout=3s", pod["containers"][0]["args"], "2 s under timeoutSeconds")
        short = self.find(helm_template("webhook.enabled=true", "webhook.timeoutSeconds=2"), "Deployment", "sluice-operator")
        self.assertIn("--webhook-review-timeout=1s", short["spec"]["template"]["spec"]["containers"][0]["args"])
        proc = subprocess.run([HELM, "template", "sluice", CHART, *CLUSTER_VALUES, "--set", "webhook.enabled=true",
                               "--set", "webhook.certificate.source=secret"], capture_output=True, text=True, timeout=120)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("needs webhook.certificate.secretName and webhook.certificate.caBundle", proc.stderr)

        objs = helm_template("webhook.enabled=true", "webhook.certificate.source=certManager",
                             "webhook.certificate.issuerRef.kind=ClusterIssuer",
                             "webhook.certificate.issuerRef.name=internal-ca", "watchNamespace=team-a")
        self.assertFalse([o for o in objs if o["kind"] == "Issuer" and not o["metadata"]["name"].startswith("sluice-gateway")])
        self.assertEqual(self.find(objs, "Certificate", "sluice-operator-webhook")["spec"]["issuerRef"],
                         {"kind": "ClusterIssuer", "name": "internal-ca"})
        (hook,) = self.find(objs, "ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}")["webhooks"]
        self.assertEqual(hook["namespaceSelector"], {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", NAMESPACE]}]})

    def test_certificates_made_by_the_operator_by_default(self):
        """The default TLS needs nothing installed beforehand (issue 29): the operator makes a CA, the
        gateway's and the webhook's certificates, keeps the webhook's caBundle, and may touch those
        objects only, by name."""
        objs = helm_template("webhook.enabled=true")
        self.assertFalse([o for o in objs if o["kind"] in ("Certificate", "Issuer")])
        config = self.find(objs, "ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}")
        self.assertNotIn("annotations", config["metadata"], "no cert-manager injection")
        (hook,) = config["webhooks"]
        self.assertNotIn("caBundle", hook["clientConfig"], "the operator keeps it; a rendered one would fight it")
        args = args_of(objs, "sluice-operator")
        webhook_dns = f"sluice-operator-webhook.{NAMESPACE}.svc,sluice-operator-webhook.{NAMESPACE}.svc.cluster.local"
        for flag in ("--ca-secret=sluice-ca", f"--serving-certificate=sluice-operator-webhook-tls={webhook_dns}",
                     f"--webhook-configuration=sluice-validate-{NAMESPACE}", "--webhook-cert-secret=sluice-operator-webhook-tls",
                     "--webhook-cert=/etc/sluice/webhook/tls.crt", "--webhook-key=/etc/sluice/webhook/tls.key"):
            self.assertIn(flag, args)
        self.assertTrue(any(a.startswith("--serving-certificate=sluice-gateway-tls=") for a in args))
        # The operator writes the pair it made: an emptyDir it may write, not the Secret.
        pod = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
        self.assertEqual(volume["emptyDir"]["medium"], "Memory")
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "webhook-tls"]
        self.assertFalse(mount["readOnly"])
        # The gateway mounts the Secret the operator makes (the kubelet waits for it on first install).
        gateway = self.find(objs, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]
        (tls,) = [v for v in gateway["volumes"] if v["name"] == "tls"]
        self.assertEqual(tls["secret"]["secretName"], "sluice-gateway-tls")
        # By name: the CA's Secret and ConfigMap and the two serving Secrets; the one webhook configuration.
        role = self.find(objs, "Role", "sluice-operator-certificates")
        named = {(tuple(r["resources"]), tuple(r.get("resourceNames", ()))) for r in role["rules"]}
        self.assertEqual(named, {(("secrets", "configmaps"), ()),
                                 (("secrets",), ("sluice-ca", "sluice-gateway-tls", "sluice-operator-webhook-tls")),
                                 (("configmaps",), ("sluice-ca",))})
        self.assertEqual([r["verbs"] for r in role["rules"] if not r.get("resourceNames")], [["create"]])
        (rule,) = self.find(objs, "ClusterRole", "sluice-operator-webhook-ca")["rules"]
        self.assertEqual((rule["resourceNames"], rule["verbs"]), ([f"sluice-validate-{NAMESPACE}"], ["get", "update"]))
        # Nothing made by the operator, nothing granted: certificates from Secrets of one's own.
        own = helm_template("webhook.enabled=true", "webhook.certificate.source=secret",
                            "webhook.certificate.secretName=w", "webhook.certificate.caBundle=Y2E=",
                            "gateway.tls.mode=secret", "gateway.tls.secretName=g")
        self.assertFalse([a for a in args_of(own, "sluice-operator") if a.startswith(("--ca-", "--serving-"))])
        self.assertFalse([o for o in own if o["metadata"]["name"] in ("sluice-operator-certificates", "sluice-operator-webhook-ca")])
        self.assertEqual(certificate_rbac(own), set())

    def test_optional_objects_follow_their_toggles(self):
        kinds = lambda objs: sorted(o["kind"] for o in objs)  # noqa: E731
        defaults = kinds(helm_template())
        self.assertNotIn("ServiceMonitor", defaults)
        # By default: the gateway's (two replicas) and the claimed sandboxes'.
        budgets = lambda objs: sorted(o["metadata"]["name"] for o in objs if o["kind"] == "PodDisruptionBudget")  # noqa: E731
        self.assertEqual(budgets(helm_template()), ["sluice-claimed-sandboxes", "sluice-gateway"])
        self.assertEqual(budgets(helm_template("podDisruptionBudget.enabled=false",
                                               "sandboxNamespace.claimedDisruptionBudget=false")), [])
        on = helm_template("serviceMonitor.enabled=true", "podDisruptionBudget.enabled=true", "operator.replicas=2")
        self.assertEqual(kinds(o for o in on if o["kind"] in ("ServiceMonitor", "PodDisruptionBudget")),
                         ["PodDisruptionBudget"] * 3 + ["ServiceMonitor"] * 2)
        # The chain's `namespace` label survives scraping (the alerts group by it).
        for monitor in (o for o in on if o["kind"] == "ServiceMonitor"):
            self.assertTrue(all(e.get("honorLabels") is True for e in monitor["spec"]["endpoints"]),
                            monitor["metadata"]["name"])
        self.assertNotIn("RuntimeClass", kinds(helm_template("runtimeClass.create=false")))


class CapabilitiesChartTest(ManifestCase):
    """capabilities.* and the narrowed NetworkPolicies (issue 26): the gateway and the operator reach
    the API server, DNS and, for the gateway, the allowed endpoints and the OTLP collector; nothing
    else. Roles for people."""

    ENDPOINTS = {"capabilities": {
        "allowedEndpoints": ["billing/ledger:7002", "llm/*", "api.example.com:443", "*.example.org",
                             "10.1.2.3:8443", "[fd00::1]", "Billing/Ledger:7002"],
        "egressCIDRs": ["203.0.113.0/24"],
        "credentials": [{"name": "ledger", "secretName": "ledger-credentials"},
                        {"name": "llm_api", "secretName": "llm-token"}]}}

    def policies(self, objs):
        return {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}

    def test_no_policy_opens_egress_in_any_variant(self):
        variants = {name: (values, None) for name, values in ChartTest.VARIANTS.items()}
        variants["endpoints, CIDRs, credentials"] = ([], self.ENDPOINTS)
        variants["tracing"] = (["networkPolicy.gateway.otlpCollector.namespace=observability",
                                "networkPolicy.gateway.otlpCollector.cidrs={198.51.100.7/32}"], None)
        for name, (sets, values) in variants.items():
            with self.subTest(name):
                objs = helm_template(*sets, values=values)
                for policy in self.policies(objs).values():
                    self.assertEqual(open_egress(policy), [], f"{name}: NetworkPolicy {policy['metadata']['name']}")
                self.assertNotIn("0.0.0.0/0", yaml.safe_dump_all(objs), name)

    def test_the_open_egress_check_finds_what_the_old_chart_allowed(self):
        policy = self.find(helm_template(), "NetworkPolicy", "sluice-gateway")
        self.assertEqual(open_egress(policy), [])
        for rule in ({"to": [{"namespaceSelector": {}}]}, {"ports": [{"port": 443}]},
                     {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443}]}):
            broken = copy.deepcopy(policy)
            broken["spec"]["egress"].append(rule)
            self.assertTrue(open_egress(broken), f"{rule} went unnoticed")

    def test_gateway_egress_follows_the_allowed_endpoints(self):
        objs = helm_template(values=self.ENDPOINTS)
        namespace = lambda ns: {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}  # noqa: E731
        self.assertEqual(self.policies(objs)["sluice-gateway"]["spec"]["egress"], [
            DNS_RULE, API_SERVER_RULE,
            # A Service: its namespace, on the entry's port (the same entry in capitals is one rule).
            {"to": [namespace("billing")], "ports": [{"protocol": "TCP", "port": 7002}]},
            {"to": [namespace("llm")]},
            # Host names are not matched (egressCIDRs are their addresses); addresses are.
            {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"protocol": "TCP", "port": 8443}]},
            {"to": [{"ipBlock": {"cidr": "fd00::1/128"}}]},
            {"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]},
        ])
        # The operator only checks the list: it calls no endpoint.
        self.assertEqual(self.policies(objs)["sluice-operator"]["spec"]["egress"], [DNS_RULE, API_SERVER_RULE])

    def test_otlp_collector_egress_and_a_collector_the_policy_would_cut_off(self):
        collector = {"namespace": "observability", "podSelector": {"matchLabels": {"app": "otel-collector"}},
                     "cidrs": ["198.51.100.7/32"]}
        objs = helm_template(values={"networkPolicy": {"gateway": {"otlpCollector": collector}}})
        self.assertEqual(self.policies(objs)["sluice-gateway"]["spec"]["egress"][2:], [
            {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
                     "podSelector": {"matchLabels": {"app": "otel-collector"}}},
                    {"ipBlock": {"cidr": "198.51.100.7/32"}}],
             "ports": [{"protocol": "TCP", "port": 4317}, {"protocol": "TCP", "port": 4318}]}])
        env = [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector.observability:4318"}]
        err = helm_refusal(values={"gateway": {"extraEnv": env}})
        self.assertIn("set networkPolicy.gateway.otlpCollector.namespace", err)
        helm_template(values={"gateway": {"extraEnv": env}, "networkPolicy": {"gateway": {"otlpCollector": collector}}})
        helm_template("networkPolicy.enabled=false", values={"gateway": {"extraEnv": env}})
        # A collector beside the gateway (localhost) needs no rule.
        local = [{"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "value": "http://127.0.0.1:4318/v1/traces"}]
        objs = helm_template(values={"gateway": {"extraEnv": local}})
        self.assertEqual(self.policies(objs)["sluice-gateway"]["spec"]["egress"], [DNS_RULE, API_SERVER_RULE])

    def test_what_would_open_every_pod_or_address_is_refused(self):
        for values, why in (
                ({"capabilities": {"allowedEndpoints": ["*/ledger"]}}, "name the namespaces"),
                ({"capabilities": {"allowedEndpoints": ["*/*:80"]}}, "name the namespaces"),
                ({"capabilities": {"allowedEndpoints": ["billing/ledger:70000"]}}, "from 1 to 65535"),
                ({"capabilities": {"egressCIDRs": ["0.0.0.0/0"]}}, "schema"),
                ({"networkPolicy": {"apiServer": {"cidrs": ["::/0"]}}}, "schema"),
                ({"networkPolicy": {"gateway": {"capabilityEgress": [{"to": [{"namespaceSelector": {}}]}]}}},
                 "selects every namespace"),
                ({"networkPolicy": {"gateway": {"capabilityEgress": [{"ports": [{"port": 80}]}]}}}, "needs a `to`"),
                ({"networkPolicy": {"gateway": {"capabilityEgress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]}}},
                 "every address"),
                ({"capabilities": {"credentials": [{"name": "a", "secretName": "s"}, {"name": "a", "secretName": "t"}]}},
                 "listed twice"),
                ({"capabilities": {"credentials": [{"name": "Ledger.v1", "secretName": "s"}]}}, "schema")):
            with self.subTest(values):
                self.assertIn(why, helm_refusal(values=values))
        # Without NetworkPolicies nothing has to follow a `*` namespace.
        helm_template("networkPolicy.enabled=false", values={"capabilities": {"allowedEndpoints": ["*/ledger"]}})
        # User rules that name their places are kept as they are.
        rule = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "billing"}},
                        "podSelector": {"matchLabels": {"app": "ledger"}}}], "ports": [{"protocol": "TCP", "port": 8080}]}
        objs = helm_template(values={"networkPolicy": {"gateway": {"capabilityEgress": [rule]}}})
        self.assertEqual(self.policies(objs)["sluice-gateway"]["spec"]["egress"][-1], rule)

    def test_the_api_server_address_is_required_and_looked_up_only_in_a_cluster(self):
        # No cluster to look it up in and no value: the render says what to set.
        proc = subprocess.run([HELM, "template", "sluice", CHART, "--namespace", NAMESPACE],
                              capture_output=True, text=True, timeout=120)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("set networkPolicy.apiServer.cidrs", proc.stderr)
        proc = subprocess.run([HELM, "template", "sluice", CHART, "--namespace", NAMESPACE, "--set", "networkPolicy.enabled=false"],
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        objs = helm_template("networkPolicy.apiServer.cidrs={10.0.0.10/32,10.0.0.11/32}", "webhook.enabled=true")
        operator = self.policies(objs)["sluice-operator"]["spec"]
        cidrs = [{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "10.0.0.11/32"}}]
        self.assertEqual(operator["egress"][1]["to"], cidrs)
        self.assertEqual([p for p in operator["ingress"][1]["from"] if "ipBlock" in p], cidrs, "the webhook's callers")

    def test_allowed_endpoints_and_credentials_reach_the_components_only_when_set(self):
        def containers(objs):
            return {name: self.find(objs, "Deployment", f"sluice-{name}")["spec"]["template"]["spec"]
                    for name in ("operator", "gateway")}

        for pod in containers(helm_template()).values():
            args = pod["containers"][0]["args"]
            self.assertFalse([a for a in args if a.startswith(("--allowed-endpoints", "--capability-credentials",
                                                               "--cluster-domain"))])
            self.assertFalse([v for v in pod["volumes"] if v["name"].startswith("capability-credentials")])

        # Another cluster domain reaches both, with the list or without it.
        for values in ({"capabilities": {"clusterDomain": "corp.internal"}},
                       {"capabilities": {**self.ENDPOINTS["capabilities"], "clusterDomain": "corp.internal"}}):
            for name, pod in containers(helm_template(values=values)).items():
                args = pod["containers"][0]["args"]
                self.assertEqual([a for a in args if a.startswith("--cluster-domain")],
                                 ["--cluster-domain=corp.internal"], name)

        pods = containers(helm_template(values=self.ENDPOINTS))
        listed = "--allowed-endpoints=" + ",".join(self.ENDPOINTS["capabilities"]["allowedEndpoints"])
        for name, pod in pods.items():
            self.assertEqual([a for a in pod["containers"][0]["args"] if a.startswith("--allowed-endpoints")], [listed], name)
        self.assertNotIn("--capability-credentials=/etc/sluice/capability-credentials", pods["operator"]["containers"][0]["args"])
        self.assertEqual([v["name"] for v in pods["operator"]["volumes"]], ["tmp"])

        gateway = pods["gateway"]
        (c,) = gateway["containers"]
        self.assertIn("--capability-credentials=/etc/sluice/capability-credentials", c["args"])
        volumes = {v["name"]: v for v in gateway["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"] if m["mountPath"].startswith("/etc/sluice/capability-credentials")}
        self.assertEqual(sorted(mounts), ["/etc/sluice/capability-credentials/ledger",
                                          "/etc/sluice/capability-credentials/llm_api"])
        for path, secret in (("ledger", "ledger-credentials"), ("llm_api", "llm-token")):
            mount = mounts[f"/etc/sluice/capability-credentials/{path}"]
            self.assertTrue(mount.get("readOnly"), path)
            self.assertNotIn("subPath", mount, "a subPath mount would never see a renewed Secret")
            self.assertEqual(volumes[mount["name"]]["secret"]["secretName"], secret)
        self.assertValid(helm_template(values=self.ENDPOINTS), "helm template with capabilities set")

    def test_the_openai_proxy_is_served_only_when_enabled_with_its_key_from_a_secret(self):
        def gateway(objs):
            return self.find(objs, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]

        pod = gateway(helm_template())
        self.assertFalse([a for a in pod["containers"][0]["args"] if a.startswith("--openai")])
        self.assertNotIn("openai", [p["name"] for p in self.find(helm_template(), "Service", "sluice-gateway")["spec"]["ports"]])

        # A host outside the cluster is reachable only at addresses the NetworkPolicy lists: without
        # them every proxied call would time out, so the render is refused, saying what to do.
        values = {"gateway": {"openai": {"enabled": True, "upstream": "https://api.openai.com/v1",
                                         "apiKeySecret": "openai-key"}}}
        refusal = helm_refusal(values=values)
        self.assertIn("capabilities.egressCIDRs", refusal)
        self.assertIn("https://api.openai.com/v1", refusal)
        values["capabilities"] = {"egressCIDRs": ["162.159.140.245/32"]}
        objs = helm_template(values=values)
        self.assertIn({"to": [{"ipBlock": {"cidr": "162.159.140.245/32"}}]},
                      self.find(objs, "NetworkPolicy", "sluice-gateway")["spec"]["egress"])
        # An upstream in the cluster (a Service) or at an address: the gateway's egress follows it.
        for upstream, rule in [
            ("http://vllm.models.svc:8000/v1",
             {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "models"}}}],
              "ports": [{"protocol": "TCP", "port": 8000}]}),
            ("https://10.20.30.40/v1",
             {"to": [{"ipBlock": {"cidr": "10.20.30.40/32"}}], "ports": [{"protocol": "TCP", "port": 443}]}),
        ]:
            policy = self.find(helm_template(values={"gateway": {"openai": {"enabled": True, "upstream": upstream}}}),
                               "NetworkPolicy", "sluice-gateway")
            self.assertIn(rule, policy["spec"]["egress"], upstream)
            self.assertEqual(open_egress(policy), [])
        (c,) = gateway(objs)["containers"]
        self.assertIn("--openai-listen=0.0.0.0:8080", c["args"])
        self.assertIn("--openai-upstream=https://api.openai.com/v1", c["args"])
        self.assertIn("--openai-api-key-file=/etc/sluice/openai/api-key", c["args"])
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/sluice/openai")
        self.assertTrue(mount.get("readOnly"))
        self.assertNotIn("subPath", mount, "a subPath mount would never see a rotated key")
        volume = next(v for v in gateway(objs)["volumes"] if v["name"] == mount["name"])
        self.assertEqual(volume["secret"]["secretName"], "openai-key")
        self.assertIn({"name": "openai", "port": 8080, "targetPort": "openai", "protocol": "TCP", "appProtocol": "http"},
                      self.find(objs, "Service", "sluice-gateway")["spec"]["ports"])
        self.assertValid(objs, "helm template with the OpenAI proxy")
        # No default target and no unguarded model unless the platform names them (an unknown
        # model is refused).
        self.assertFalse([a for a in c["args"] if a.startswith(("--openai-default-target", "--openai-unguarded-model"))])
        values["gateway"]["openai"].update(defaultTarget="support-bot", unguardedModels=["fake-llm", "other"])
        (c,) = gateway(helm_template(values=values))["containers"]
        self.assertIn("--openai-default-target=support-bot", c["args"])
        self.assertIn("--openai-unguarded-model=fake-llm", c["args"])
        self.assertIn("--openai-unguarded-model=other", c["args"])
        with self.assertRaises(AssertionError) as e:
            helm_template(values={"gateway": {"openai": {"enabled": True}}})
        self.assertIn("gateway.openai.upstream", str(e.exception))

    def test_the_chart_makes_a_callers_token_its_policy_admits(self):
        values = {"gateway": {"callers": {
            "callers": [{"name": "svc", "match": {"dnsSAN": "svc.internal"}, "namespaces": ["a"]}],
            "tokens": [{"name": "support-app", "namespaces": ["support"]},
                       {"name": "batch", "namespaces": ["*"], "secretNamespace": "jobs"}]}}}
        objs = helm_template(values=values)
        policy = yaml.safe_load(self.find(objs, "ConfigMap", "sluice-gateway-callers")["data"]["callers.yaml"])
        by_name = {c["name"]: c for c in policy["callers"]}
        self.assertEqual(by_name["svc"]["match"], {"dnsSAN": "svc.internal"})
        for name, namespace, allowed in [("support-app", NAMESPACE, ["support"]), ("batch", "jobs", ["*"])]:
            secret = self.find(objs, "Secret", f"sluice-gateway-caller-{name}")
            self.assertEqual(secret["metadata"]["namespace"], namespace)
            token = base64.b64decode(secret["data"]["token"])
            self.assertGreaterEqual(len(token), 43)
            # The policy matches the token by its SHA-256, as the gateway compares a bearer token.
            self.assertEqual(by_name[name]["match"], {"tokenSha256": hashlib.sha256(token).hexdigest()})
            self.assertEqual(by_name[name]["namespaces"], allowed)
        self.assertValid(objs, "helm template with caller tokens")
        self.assertIn("listed twice", helm_refusal(values={"gateway": {"callers": {
            "callers": [{"name": "x", "match": {"dnsSAN": "x"}, "namespaces": ["a"]}],
            "tokens": [{"name": "x", "namespaces": ["a"]}]}}}))

    def test_the_mcp_proxy_is_served_only_when_enabled_with_its_port_egress_and_a_shared_session_key(self):
        def gateway(objs):
            return self.find(objs, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]

        objs = helm_template()
        self.assertFalse([a for a in gateway(objs)["containers"][0]["args"] if a.startswith("--mcp")])
        self.assertFalse([o for o in objs if o["metadata"]["name"] == "sluice-gateway-mcp-session"])

        values = {"gateway": {"mcp": {"enabled": True, "servers": [
            {"name": "github", "url": "http://github-mcp.tools.svc:8080/mcp"},
            {"name": "search", "url": "https://mcp.example.com/mcp", "passNonText": True}]}}}
        objs = helm_template(values=values)
        (c,) = gateway(objs)["containers"]
        mcp_args = [a for a in c["args"] if a.startswith("--mcp")]
        self.assertEqual(mcp_args, [
            "--mcp-listen=0.0.0.0:8090",
            "--mcp-server=github=http://github-mcp.tools.svc:8080/mcp",
            "--mcp-server=search=https://mcp.example.com/mcp",
            "--mcp-pass-non-text=search",
            "--mcp-upstream-timeout=60s",
            "--mcp-session-key-file=/etc/sluice/mcp-session/key",
        ])
        self.assertIn({"name": "mcp", "port": 8090, "targetPort": "mcp", "protocol": "TCP", "appProtocol": "http"},
                      self.find(objs, "Service", "sluice-gateway")["spec"]["ports"])
        # Every replica reads the same key, from a Secret the chart made.
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/sluice/mcp-session")
        volume = next(v for v in gateway(objs)["volumes"] if v["name"] == mount["name"])
        secret = self.find(objs, "Secret", volume["secret"]["secretName"])
        self.assertGreaterEqual(len(base64.b64decode(secret["data"]["key"])), 32)
        # Clients reach the port; the gateway reaches the in-cluster server's namespace on its port.
        policy = self.find(objs, "NetworkPolicy", "sluice-gateway")["spec"]
        self.assertIn(8090, [p["port"] for rule in policy["ingress"] for p in rule["ports"]])
        self.assertIn({"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tools"}}}],
                       "ports": [{"protocol": "TCP", "port": 8080}]}, policy["egress"])
        self.assertEqual(open_egress(self.find(objs, "NetworkPolicy", "sluice-gateway")), [])
        self.assertValid(objs, "helm template with the MCP proxy")
        # A key of the platform's replaces the chart's.
        values["gateway"]["mcp"]["sessionKeySecret"] = "my-key"
        objs = helm_template(values=values)
        self.assertFalse([o for o in objs if o["metadata"]["name"] == "sluice-gateway-mcp-session"])
        self.assertIn({"name": "mcp-session-key", "secret": {"secretName": "my-key", "items": [{"key": "key", "path": "key"}]}},
                      gateway(objs)["volumes"])
        self.assertIn("gateway.mcp.servers", helm_refusal(values={"gateway": {"mcp": {"enabled": True}}}))

    def test_the_operator_and_gateway_have_a_priority_level_of_their_own_unless_turned_off(self):
        objs = helm_template()
        name = f"sluice-{NAMESPACE}"
        level = self.find(objs, "PriorityLevelConfiguration", name)["spec"]
        self.assertEqual(level["type"], "Limited")
        self.assertEqual(level["limited"]["limitResponse"]["type"], "Queue")
        schema = self.find(objs, "FlowSchema", name)["spec"]
        self.assertEqual(schema["priorityLevelConfiguration"], {"name": name})
        # Ahead of the built-in service-accounts schema (9000), which would put them in workload-low.
        self.assertLess(schema["matchingPrecedence"], 9000)
        (rule,) = schema["rules"]
        self.assertEqual(sorted(s["serviceAccount"]["name"] for s in rule["subjects"]), ["sluice-gateway", "sluice-operator"])
        self.assertEqual({s["serviceAccount"]["namespace"] for s in rule["subjects"]}, {NAMESPACE})
        self.assertValid(objs, "helm template with API Priority and Fairness")
        # Another release in another namespace gets objects of its own.
        other = helm_template(release="other", namespace="elsewhere")
        self.find(other, "FlowSchema", "other-sluice-elsewhere")
        self.assertFalse([o for o in helm_template("apiPriority.enabled=false")
                          if o["kind"] in ("FlowSchema", "PriorityLevelConfiguration")])

    def role_rules(self, role):
        return {(g, r): sorted(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}

    def test_roles_for_people(self):
        objs = helm_template()
        roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] in USER_ROLES}
        self.assertEqual(sorted(roles), sorted(USER_ROLES))
        aggregate = lambda role: sorted(k.rsplit("-", 1)[1] for k, v in role["metadata"]["labels"].items()  # noqa: E731
                                        if k.startswith("rbac.authorization.k8s.io/aggregate-to-") and v == "true")
        read, write = ["get", "list", "watch"], sorted(["get", "list", "watch", "create", "update", "patch", "delete"])
        edit = roles["sluice-hookchain-edit"]
        self.assertEqual(aggregate(edit), ["admin", "edit"])
        self.assertEqual(self.role_rules(edit), {("sluice.dev", "hookchains"): write, ("sluice.dev", "capabilities"): read})
        view = roles["sluice-view"]
        self.assertIn("view", aggregate(view))
        self.assertEqual(self.role_rules(view), {("sluice.dev", "hookchains"): read, ("sluice.dev", "capabilities"): read,
                                                 ("sluice.dev", "hookchains/status"): ["get"],
                                                 ("sluice.dev", "capabilities/status"): ["get"]})
        platform = roles["sluice-platform"]
        self.assertEqual(aggregate(platform), [], "bound by hand, never aggregated")
        self.assertEqual(self.role_rules(platform), {("sluice.dev", "hookchains"): sorted(write + ["deletecollection"]),
                                                     ("sluice.dev", "capabilities"): sorted(write + ["deletecollection"]),
                                                     ("sluice.dev", "hookchains/status"): ["get"],
                                                     ("sluice.dev", "capabilities/status"): ["get"]})
        # Nothing aggregated to edit or admin writes Capabilities by default.
        for role in roles.values():
            if set(aggregate(role)) & {"edit", "admin"}:
                self.assertNotIn("create", self.role_rules(role).get(("sluice.dev", "capabilities"), []), role["metadata"]["name"])
        # The roles bind nobody: people get them through the built-in roles or a binding of their own.
        bound = {b["roleRef"]["name"] for b in objs if b["kind"] in ("RoleBinding", "ClusterRoleBinding")}
        self.assertFalse(bound & set(USER_ROLES))
        self.assertValid([o for o in objs if o["kind"] == "ClusterRole"], "the ClusterRoles")

        opted = helm_template("rbac.aggregateCapabilitiesToAdmin=true")
        admin = self.find(opted, "ClusterRole", "sluice-capability-admin")
        self.assertEqual(aggregate(admin), ["admin"])
        self.assertEqual(self.role_rules(admin), {("sluice.dev", "capabilities"): write})
        self.assertFalse([o for o in objs if o["metadata"]["name"] == "sluice-capability-admin"])

        # One set per release: two releases in a cluster do not fight over the names.
        other = {o["metadata"]["name"] for o in helm_template(release="tenants") if o["kind"] == "ClusterRole"}
        self.assertLessEqual({"tenants-hookchain-edit", "tenants-view", "tenants-platform"}, other)
        for off in ("rbac.userRoles=false", "rbac.create=false"):
            self.assertFalse([o for o in helm_template(off) if o["metadata"]["name"] in USER_ROLES], off)


def args_of(objs, deployment):
    """The container arguments of one of the release's Deployments."""
    (d,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment]
    return d["spec"]["template"]["spec"]["containers"][0]["args"]


def cluster_shared(objs):
    """The cluster-scoped objects of a render (the CRDs aside, which every release shares), as
    (kind, name)."""
    return sorted((o["kind"], o["metadata"]["name"]) for o in objs
                  if o["kind"] != "CustomResourceDefinition" and "namespace" not in o["metadata"])


class ReleasesTest(ManifestCase):
    """Several releases in one cluster (issue 29): every cluster-scoped name, the sandbox namespace,
    the webhook configuration and the Lease follow the release, and the release `sluice` keeps the
    names a single install has always had."""

    # Everything optional on, so that every object the chart can make is rendered.
    EVERYTHING = ["webhook.enabled=true", "prometheusRule.enabled=true", "grafanaDashboard.enabled=true",
                  "grafanaDashboard.namespace=monitoring", "serviceMonitor.enabled=true",
                  "podDisruptionBudget.enabled=true", "operator.replicas=2", "networkPolicy.cilium.enabled=true",
                  "rbac.aggregateCapabilitiesToAdmin=true"]
    # Production as installed today, and staging beside it: its own namespace, release name and sandbox
    # namespace; the RuntimeClass is production's (one object per cluster). Each watches namespaces of
    # its own: two operators watching the same chains would both keep pools for them (docs/kubernetes.md).
    PRODUCTION = ("sluice", NAMESPACE, ["watchNamespace=team-a"])
    STAGING = ("staging", "sluice-staging", ["watchNamespace=team-a-staging", "runtimeClass.create=false"])

    def render(self, release, namespace, sets, *more):
        return helm_template(*self.EVERYTHING, *sets, *more, release=release, namespace=namespace)

    def test_the_release_sluice_keeps_the_names_of_a_single_install(self):
        objs = self.render("sluice", NAMESPACE, [])
        self.assertEqual(cluster_shared(objs), sorted([
            ("ClusterRole", "sluice-operator"), ("ClusterRoleBinding", "sluice-operator"),
            ("ClusterRole", "sluice-gateway"), ("ClusterRoleBinding", "sluice-gateway"),
            ("ClusterRole", "sluice-hookchain-edit"), ("ClusterRole", "sluice-view"), ("ClusterRole", "sluice-platform"),
            ("ClusterRole", "sluice-capability-admin"), ("Namespace", SANDBOXES), ("RuntimeClass", "gvisor"),
            ("ClusterRole", "sluice-operator-webhook-ca"), ("ClusterRoleBinding", "sluice-operator-webhook-ca"),
            ("ClusterRole", "sluice-operator-nodes"), ("ClusterRoleBinding", "sluice-operator-nodes"),
            ("ValidatingWebhookConfiguration", f"sluice-validate-{NAMESPACE}"),
            ("FlowSchema", f"sluice-{NAMESPACE}"), ("PriorityLevelConfiguration", f"sluice-{NAMESPACE}")]))
        names = lambda kind: sorted(o["metadata"]["name"] for o in objs if o["kind"] == kind)  # noqa: E731
        self.assertEqual(names("Role"), ["sluice-gateway-sandboxes", "sluice-operator-certificates",
                                         "sluice-operator-leader-election", "sluice-operator-sandboxes"])
        self.assertEqual(names("PrometheusRule"), ["sluice"])
        self.assertIn("sluice-grafana-dashboard", names("ConfigMap"))
        self.assertIn("--lease-name=sluice-operator", args_of(objs, "sluice-operator"))
        # A release whose name says sluice is that name; any other is <release>-sluice.
        for release, fullname in (("sluice-staging", "sluice-staging"), ("staging", "staging-sluice")):
            objs = self.render(release, "sluice-staging", [])
            self.assertIn(("ClusterRole", f"{fullname}-operator"), cluster_shared(objs), release)
            self.assertIn(("Namespace", f"{fullname}-sandboxes"), cluster_shared(objs), release)
            self.assertIn(f"--lease-name={fullname}-operator", args_of(objs, "sluice-operator"), release)

    def test_overrides(self):
        objs = self.render("staging", "sluice-staging", ["fullnameOverride=sluice-canary"])
        self.assertIn(("ClusterRole", "sluice-canary-gateway"), cluster_shared(objs))
        self.assertIn(("ValidatingWebhookConfiguration", "sluice-canary-validate-sluice-staging"), cluster_shared(objs))
        self.assertIn("--sandbox-namespace=sluice-canary-sandboxes", args_of(objs, "sluice-gateway"))
        objs = self.render("staging", "sluice-staging", ["sandboxNamespace.name=canary-pods", "operator.leaseName=canary"])
        for deployment in ("sluice-operator", "sluice-gateway"):
            self.assertIn("--sandbox-namespace=canary-pods", args_of(objs, deployment))
        self.assertIn("--lease-name=canary", args_of(objs, "sluice-operator"))
        self.assertIn(("Namespace", "canary-pods"), cluster_shared(objs))
        # Empty still means beside the chains (with one watched namespace).
        objs = self.render("staging", "sluice-staging", ["watchNamespace=team-b", "sandboxNamespace.name="])
        self.assertFalse([o for o in objs if o["kind"] == "Namespace"])
        self.assertFalse([a for a in args_of(objs, "sluice-gateway") if a.startswith("--sandbox-namespace")])
        # A derived sandbox namespace too long for a namespace name is refused, not cut short.
        self.assertIn("longer than 63 characters", helm_refusal(release="a" * 50))
        self.assertIn("schema", helm_refusal("fullnameOverride=Not_A_Name"))

    def test_two_releases_side_by_side(self):
        layouts = {
            "each watching its namespaces": (self.PRODUCTION, self.STAGING),
            # Cluster-wide releases would both serve every chain; their names must still not collide.
            "both cluster-wide (names only)": (("sluice", NAMESPACE, []),
                                               ("staging", "sluice-staging", ["runtimeClass.create=false"])),
        }
        for layout, releases in layouts.items():
            with self.subTest(layout):
                renders = {release: (namespace, self.render(release, namespace, sets))
                           for release, namespace, sets in releases}
                combined = [o for _, objs in renders.values() for o in objs]
                self.assertValid(combined, f"{layout}: both releases")
                # The CRDs are the cluster's, installed once (Helm skips the second copy): the same text.
                crds = [o for o in combined if o["kind"] == "CustomResourceDefinition"]
                self.assertEqual(len({yaml.safe_dump(o) for o in crds}), 2, layout)
                keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
                        for o in combined if o["kind"] != "CustomResourceDefinition"]
                self.assertEqual(sorted({k for k in keys if keys.count(k) > 1}), [], f"{layout}: objects in both releases")
                for release, (namespace, objs) in renders.items():
                    self.assert_own_rbac(release, namespace, objs)

    def test_two_cluster_wide_releases_split_the_chains_by_label(self):
        """Production keeps every chain but staging's, staging only its own: the operator's and the
        gateway's --selector, and each webhook judges only its release's objects."""
        releases = {"sluice": (NAMESPACE, "sluice.dev/release!=staging"),
                    "staging": ("sluice-staging", "sluice.dev/release=staging")}
        want = {"sluice": {"key": "sluice.dev/release", "operator": "NotIn", "values": ["staging"]},
                "staging": {"key": "sluice.dev/release", "operator": "In", "values": ["staging"]}}
        for release, (namespace, selector) in releases.items():
            objs = helm_template(*self.EVERYTHING, "runtimeClass.create=false", values={"chainSelector": selector},
                                 release=release, namespace=namespace)
            for deployment in ("sluice-operator", "sluice-gateway"):
                self.assertIn(f"--selector={selector}", args_of(objs, deployment), release)
            (config,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
            (hook,) = config["webhooks"]
            self.assertEqual(hook["objectSelector"], {"matchExpressions": [want[release]]}, release)
        # An explicit objectSelector wins; a set-based selector needs one.
        objs = helm_template(*self.EVERYTHING, "webhook.objectSelector.matchLabels.team=a",
                             values={"chainSelector": "tier"}, release="staging", namespace="sluice-staging")
        (config,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
        self.assertEqual(config["webhooks"][0]["objectSelector"], {"matchLabels": {"team": "a"}})
        self.assertIn("needs webhook.objectSelector",
                      helm_refusal("webhook.enabled=true", values={"chainSelector": "tier in (a)"}))
        # Without one, nothing narrows anything.
        objs = self.render("sluice", NAMESPACE, [])
        self.assertFalse([a for a in args_of(objs, "sluice-gateway") if a.startswith("--selector")])
        (config,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
        self.assertEqual(config["webhooks"][0]["objectSelector"], {})

    def assert_own_rbac(self, release, namespace, objs):
        """Each release binds its own roles to its own ServiceAccounts, and grants them what they use
        where its values put them."""
        accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "ServiceAccount"}
        roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs
                 if o["kind"] in ("Role", "ClusterRole")}
        for b in objs:
            if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            ref = b["roleRef"]
            role = (ref["kind"], b["metadata"].get("namespace") if ref["kind"] == "Role" else None, ref["name"])
            self.assertIn(role, roles, f"{release}: {b['metadata']['name']} binds a role it does not make")
            for subject in b["subjects"]:
                self.assertIn((subject["namespace"], subject["name"]), accounts,
                              f"{release}: {b['metadata']['name']} binds {subject}")
        args = args_of(objs, "sluice-operator")
        value = lambda flag: next((a.split("=", 1)[1] for a in args if a.startswith(flag + "=")), "")  # noqa: E731
        watch, sandboxes = value("--namespace"), value("--sandbox-namespace")
        self.assertEqual(granted(objs, namespace), expected_rbac(watch, sandboxes, namespace, namespace, objs), release)
        self.assertEqual(value("--sandbox-namespace"), next(a.split("=", 1)[1] for a in args_of(objs, "sluice-gateway")
                                                            if a.startswith("--sandbox-namespace=")), release)
        self.assertIn(("Namespace", sandboxes), cluster_shared(objs), release)
        # The webhook calls this release's operator, whose CA this release's operator keeps in it.
        (config,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
        (hook,) = config["webhooks"]
        self.assertEqual(hook["clientConfig"]["service"]["namespace"], namespace, release)
        self.assertIn(f"--webhook-configuration={config['metadata']['name']}", args)
        self.assertIn(f"--ca-secret={release if 'sluice' in release else release + '-sluice'}-ca", args)


class DnsTest(ManifestCase):
    """networkPolicy.dns (issue 29): the resolvers the operator and the gateway may ask, on UDP and
    TCP 53: the DNS pods by default, GKE's Cloud DNS, NodeLocal DNSCache, addresses of one's own."""

    PORTS = DNS_RULE["ports"]
    KUBE_DNS = DNS_RULE["to"][0]
    CLOUD_DNS = {"ipBlock": {"cidr": "169.254.169.254/32"}}
    NODE_LOCAL = [{"ipBlock": {"cidr": "169.254.20.10/32"}},
                  {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": {"k8s-app": "node-local-dns"}}}]
    PRESETS = {
        "kube-dns (default)": ({}, [KUBE_DNS]),
        "Cloud DNS": ({"resolvers": ["cloudDNS"]}, [CLOUD_DNS]),
        "NodeLocal DNSCache": ({"resolvers": ["nodeLocalDNSCache"]}, NODE_LOCAL),
        "Cloud DNS and NodeLocal DNSCache": ({"resolvers": ["cloudDNS", "nodeLocalDNSCache"]}, [CLOUD_DNS, *NODE_LOCAL]),
        "all three": ({"resolvers": ["kubeDNS", "cloudDNS", "nodeLocalDNSCache"]}, [KUBE_DNS, CLOUD_DNS, *NODE_LOCAL]),
        "another cache address": ({"resolvers": ["nodeLocalDNSCache"], "nodeLocalDNSCache": {"address": "169.254.0.53/32"}},
                                  [{"ipBlock": {"cidr": "169.254.0.53/32"}}, NODE_LOCAL[1]]),
        "CoreDNS and the kube-dns Service address": (
            {"podSelector": {"matchLabels": {"k8s-app": "coredns"}}, "cidrs": ["10.96.0.10/32"]},
            [{**KUBE_DNS, "podSelector": {"matchLabels": {"k8s-app": "coredns"}}}, {"ipBlock": {"cidr": "10.96.0.10/32"}}]),
        "addresses only": ({"resolvers": [], "cidrs": ["10.96.0.10/32", "fd00::a/128"]},
                           [{"ipBlock": {"cidr": "10.96.0.10/32"}}, {"ipBlock": {"cidr": "fd00::a/128"}}]),
    }

    def test_each_preset_renders_its_egress_and_nothing_more(self):
        for name, (dns, peers) in self.PRESETS.items():
            with self.subTest(name):
                objs = helm_template(values={"networkPolicy": {"dns": dns}})
                self.assertValid(objs, name)
                for component in ("operator", "gateway"):
                    policy = self.find(objs, "NetworkPolicy", f"sluice-{component}")
                    self.assertEqual(policy["spec"]["egress"][:2],
                                     [{"to": peers, "ports": self.PORTS}, API_SERVER_RULE], f"{name}: {component}")
                    self.assertEqual(open_egress(policy), [], f"{name}: {component}")
                self.assertNotIn("0.0.0.0/0", yaml.safe_dump_all(objs), name)
                run(HELM, "lint", "--strict", CHART, *helm_args(values={"networkPolicy": {"dns": dns}}))

    def test_what_would_leave_no_resolver_or_open_one_is_refused(self):
        for dns, why in (({"resolvers": []}, "no resolver is allowed"),
                         ({"resolvers": ["coreDNS"]}, "schema"),
                         ({"resolvers": ["cloudDNS", "cloudDNS"]}, "schema"),
                         ({"cidrs": ["0.0.0.0/0"]}, "schema"),
                         ({"resolvers": ["nodeLocalDNSCache"], "nodeLocalDNSCache": {"address": "::/0"}}, "schema"),
                         ({"namespaceSelector": None}, "namespaceSelector is empty"),
                         ({"resolvers": ["nodeLocalDNSCache"], "nodeLocalDNSCache": {"namespaceSelector": None}},
                          "namespaceSelector is empty")):
            with self.subTest(dns):
                self.assertIn(why, helm_refusal(values={"networkPolicy": {"dns": dns}}))


class KustomizeTest(ManifestCase):
    def test_base_is_the_charts_default_render(self):
        with tempfile.TemporaryDirectory() as out:
            run(sys.executable, os.path.join(ROOT, "deploy", "tools", "gen_base.py"), HELM, out)
            base = os.path.join(ROOT, "deploy", "base")
            compare = filecmp.dircmp(out, base)
            stale = compare.diff_files + compare.left_only + compare.right_only
            stale += [f"crds/{f}" for f in compare.subdirs["crds"].diff_files] if "crds" in compare.subdirs else ["crds/"]
            self.assertEqual(stale, [], "deploy/base is stale: run `make deploy-base`")

    def test_base_renders_valid_objects_with_the_required_rbac(self):
        objs = kustomize("deploy/base")
        self.assertValid(objs, "kubectl kustomize deploy/base")
        self.assertEqual(self.find(objs, "Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
                         "restricted")
        chart = {(o["kind"], o["metadata"]["name"]) for o in helm_template()}
        self.assertEqual({(o["kind"], o["metadata"]["name"]) for o in objs} - {("Namespace", NAMESPACE)}, chart)
        self.assertEqual(granted(objs), expected_rbac("", SANDBOXES, objs=objs))

    def test_konnectivity_agents_may_call_the_webhook(self):
        # GKE's API server reaches pods through konnectivity: the call comes from its agents' pods,
        # which an address-only rule drops (and with failurePolicy Fail, every apply fails).
        objs = helm_template("webhook.enabled=true")
        policy = self.find(objs, "NetworkPolicy", "sluice-operator")
        (rule,) = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 9443} in r["ports"]]
        self.assertIn({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                       "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}}}, rule["from"])
        objs = helm_template("webhook.enabled=true", "networkPolicy.apiServer.konnectivity.enabled=false")
        policy = self.find(objs, "NetworkPolicy", "sluice-operator")
        (rule,) = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 9443} in r["ports"]]
        self.assertTrue(all("ipBlock" in f for f in rule["from"]))

    def test_gke_overlay_leaves_the_runtime_class_to_gke(self):
        # GKE's own RuntimeClass gvisor has handler gvisor and is immutable: applying the base's
        # (handler runsc) fails there. Everything else is the base, and pods still ask for gvisor.
        objs = kustomize("deploy/overlays/gke")
        self.assertValid(objs, "kubectl kustomize deploy/overlays/gke")
        self.assertFalse([o for o in objs if o["kind"] == "RuntimeClass"])
        base = kustomize("deploy/base")
        self.assertEqual({(o["kind"], o["metadata"]["name"]) for o in objs},
                         {(o["kind"], o["metadata"]["name"]) for o in base if o["kind"] != "RuntimeClass"})
        args = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        self.assertIn("--runtime-class=gvisor", args)

    def test_example_overlay_renders_valid_objects_crds_before_chains(self):
        objs = kustomize("deploy/overlays/example")
        self.assertValid(objs, "kubectl kustomize deploy/overlays/example")
        self.assertEqual(self.find(objs, "Deployment", "sluice-operator")["spec"]["replicas"], 2)
        self.assertEqual(self.find(objs, "Deployment", "sluice-gateway")["spec"]["replicas"], 3)
        # The install holds the CRDs and no custom resource: those come in the second apply.
        self.assertEqual(len([o for o in objs if o["kind"] == "CustomResourceDefinition"]), 2)
        self.assertFalse([o for o in objs if o["kind"] in ("HookChain", "Capability")])
        # Only the supervisor image is patched: every other operator argument is the base's.
        base_args = self.find(kustomize("deploy/base"), "Deployment", "sluice-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        args = self.find(objs, "Deployment", "sluice-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        self.assertEqual(args, base_args)
        self.assertIn(f"--sandbox-namespace={SANDBOXES}", args)
        chains = kustomize("deploy/overlays/example/chains")
        self.assertValid(chains, "kubectl kustomize deploy/overlays/example/chains")
        self.assertEqual({o["kind"] for o in chains}, {"HookChain", "Capability"})
        self.assertEqual(self.find(chains, "HookChain", "support-input")["spec"]["target"], "support-bot")
        self.assertEqual(self.find(chains, "Capability", "echo")["spec"]["endpoint"], {"builtin": "echo"})
        self.assertTrue(filecmp.cmp(os.path.join(ROOT, "examples", "pii-redaction.yaml"),
                                    os.path.join(ROOT, "deploy", "overlays", "example", "chains", "pii-redaction.yaml"), shallow=False),
                        "deploy/overlays/example/chains/pii-redaction.yaml is no longer a copy of examples/pii-redaction.yaml")


class OperatorRenderTest(ManifestCase):
    def test_render_of_every_example_chain(self):
        # `make test` runs this after test-rust, which builds the operator.
        self.assertTrue(os.path.exists(OPERATOR),
                        f"{os.path.relpath(OPERATOR, ROOT)} is not built: run `cargo build -p sluice-operator` first")
        for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml"))):
            chains = [o for o in load_file(path) if o["kind"] == "HookChain"]
            if not chains:
                continue
            objs = load_all(run(OPERATOR, "render", path))
            self.assertValid(objs, f"sluice-operator render {os.path.relpath(path, ROOT)}")
            for chain in chains:
                name = chain["metadata"]["name"]
                pods = [o for o in objs if o["kind"] == "Pod" and o["metadata"]["labels"].get("sluice.dev/chain") == name]
                self.assertEqual(len(pods), chain["spec"].get("pool", {}).get("warm", 2), f"warm pods of {name}")
                for pod in pods:
                    self.assertEqual(pod["metadata"]["labels"]["sluice.dev/pool"], "warm")
                    spec = pod["spec"]
                    self.assertEqual((spec["runtimeClassName"], spec["restartPolicy"]), ("gvisor", "Never"))
                    self.assertFalse(spec["automountServiceAccountToken"])
                    (c,) = spec["containers"]
                    self.assertEqual(c["name"], "supervisor")
                    # The supervisor itself, listening, with the chain's limits (nothing of its hooks).
                    command = c["command"]
                    self.assertEqual(command[:4], ["/opt/sluice/sluice-supervisor", "--listen", "--runtime", "/opt/sluice/sluice-cell.cwasm"])
                    flags = dict(zip(command[4::2], command[5::2]))
                    self.assertNotIn("--workers", flags, name)
                    self.assertEqual(flags["--pids"], str(chain["spec"].get("resources", {}).get("pids", 64)), name)
                    self.assertGreater(int(flags["--memory-bytes"]), 0)
                    self.assertEqual(c["startupProbe"]["exec"]["command"], ["/opt/sluice/sluice-supervisor", "attach", "--probe"])
                    self.assertNotIn("readinessProbe", c, "no exec per period into a pod that serves trigger points")
                policy = self.find(objs, "NetworkPolicy", f"sluice-{name}-deny-all")["spec"]
                self.assertEqual(policy["podSelector"], {"matchLabels": {"sluice.dev/chain": name}})
                self.assertEqual(sorted(policy["policyTypes"]), ["Egress", "Ingress"])

    def test_render_into_a_sandbox_namespace(self):
        path = os.path.join(ROOT, "examples", "pii-redaction.yaml")
        (chain,) = [o for o in load_file(path) if o["kind"] == "HookChain"]
        name, ns = chain["metadata"]["name"], chain["metadata"]["namespace"]
        objs = load_all(run(OPERATOR, "render", path, "--sandbox-namespace", SANDBOXES))
        self.assertValid(objs, "sluice-operator render --sandbox-namespace")
        pods = [o for o in objs if o["kind"] == "Pod"]
        self.assertTrue(pods)
        for pod in pods:
            meta = pod["metadata"]
            self.assertEqual((meta["namespace"], meta["generateName"]), (SANDBOXES, f"{ns}-{name}-"))
            self.assertEqual(meta["labels"]["sluice.dev/chain-namespace"], ns)
            self.assertNotIn("ownerReferences", meta)
        policy = self.find(objs, "NetworkPolicy", f"sluice-{ns}.{name}-deny-all")
        self.assertEqual(policy["metadata"]["namespace"], SANDBOXES)
        self.assertEqual(policy["spec"]["podSelector"]["matchLabels"],
                         {"sluice.dev/chain": name, "sluice.dev/chain-namespace": ns})


if __name__ == "__main__":
    unittest.main()
