"""The chart's monitoring objects, checked with Prometheus's own promtool (`make deps` installs Debian's
`prometheus` package for it):

- the PrometheusRule: `promtool check rules` on its groups, and `promtool test rules` with synthetic
  series proving the main alerts fire when they should and stay quiet when they should;
- the Grafana dashboard ConfigMap: the sidecar label, JSON that parses, every panel's and variable's
  PromQL parsed by promtool (as recording rules), and every Sluice metric it reads existing in the
  code (the names registered in gateway/ and operator/, with histogram suffixes and the process
  collector's names);
- both validators are shown to refuse a broken expression and a made-up metric;
- every metric the code registers is in docs/operations.md's tables."""

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from test_manifests import ROOT, helm_template

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PROCESS = ("cpu_seconds_total", "open_fds", "max_fds", "virtual_memory_bytes", "resident_memory_bytes",
           "start_time_seconds", "threads")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$namespace": ".*", "$target": ".*"}


def code_metric_names():
    """Every `sluice_<component>_...` name registered in the Rust sources, and the process metrics."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "gateway", "**", "src", "**", "*.rs"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "operator", "src", "**", "*.rs"), recursive=True):
        with open(path) as f:
            names.update(re.findall(r'"(sluice_(?:gateway|operator)_[a-z0-9_]+)"', f.read()))
    for component in ("sluice_gateway", "sluice_operator"):
        names.update(f"{component}_process_{p}" for p in PROCESS)
    return names


def unknown_metrics(expr, known):
    """The Sluice metric names `expr` reads that the code does not register."""
    missing = []
    for name in re.findall(r"\bsluice_[a-z0-9_]+", expr):
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
        if name not in known and base not in known:
            missing.append(name)
    return missing


def promtool(*args):
    if not os.path.exists(PROMTOOL):
        raise AssertionError("promtool not found: `make deps` installs Debian's prometheus package")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def check_rules(groups):
    """promtool's verdict on rule groups: (ok, output)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rules.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({"groups": groups}, f)
        proc = promtool("check", "rules", path)
        return proc.returncode == 0, proc.stdout + proc.stderr


def dashboard_expressions(dashboard):
    """(where, PromQL) of every panel target and every query variable, Grafana variables filled in."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            selector = re.fullmatch(r"label_values\((.*),\s*[a-z_]+\)", query)
            assert selector, f"variable {var['name']}: {query}"
            found.append((f"variable {var['name']}", selector.group(1)))
    filled = []
    for where, expr in found:
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        filled.append((where, expr))
    return filled


def monitoring_objects():
    objs = helm_template("grafanaDashboard.enabled=true", "prometheusRule.enabled=true")
    rules = [o for o in objs if o["kind"] == "PrometheusRule"]
    dashboards = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "sluice-grafana-dashboard"]
    return rules, dashboards


class MonitoringTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rules, cls.dashboards = monitoring_objects()
        cls.known = code_metric_names()

    def test_the_objects_follow_their_toggles(self):
        kinds = [o["kind"] for o in helm_template()]
        self.assertNotIn("PrometheusRule", kinds)
        self.assertFalse([o for o in helm_template() if o["metadata"]["name"] == "sluice-grafana-dashboard"])
        self.assertEqual(len(self.rules), 1)
        self.assertEqual(len(self.dashboards), 1)

    def test_rules_pass_promtool(self):
        ok, out = check_rules(self.rules[0]["spec"]["groups"])
        self.assertTrue(ok, out)
        alerts = {r["alert"] for g in self.rules[0]["spec"]["groups"] for r in g["rules"]}
        for wanted in ("SluiceGatewayErrorRate", "SluiceHookErrorRate", "SluiceUnavailable", "SluiceClaimWaitHigh",
                       "SluiceOperatorReconcileErrors", "SluiceWebhookErrors", "SluiceWebhookReviewFailures",
                       "SluiceGatewayCertificateExpiresSoon", "SluiceHookBlockRateSpike", "SluiceHookLatencyHigh",
                       "SluicePoolEmpty", "SluiceSandboxCpuThrottled", "SluiceSandboxPodCpuThrottled"):
            self.assertIn(wanted, alerts)

    def test_rules_read_only_metrics_the_code_has(self):
        for group in self.rules[0]["spec"]["groups"]:
            for rule in group["rules"]:
                self.assertEqual(unknown_metrics(rule["expr"], self.known), [], rule["alert"])

    def test_alerts_fire_on_synthetic_series(self):
        """promtool test rules: the alerts fire for a failing chain and stay quiet for a healthy one."""
        chain = 'namespace="team", target="bot", trigger_point="input"'
        healthy = 'namespace="team", target="ok-bot", trigger_point="input"'
        series = [
            # bot: 10 req/min of which 3 UNAVAILABLE; ok-bot: all fine, plus NOT_FOUND noise under _unknown.
            {"series": f'sluice_gateway_requests_total{{{chain}, code="ok"}}', "values": "0+7x30"},
            {"series": f'sluice_gateway_requests_total{{{chain}, code="unavailable"}}', "values": "0+3x30"},
            {"series": f'sluice_gateway_requests_total{{{healthy}, code="ok"}}', "values": "0+10x30"},
            {"series": 'sluice_gateway_requests_total{namespace="_unknown", target="_unknown", '
                       'trigger_point="_unknown", code="not_found"}', "values": "0+50x30"},
            # bot's claims all wait 2-5 s; ok-bot's are instant.
            *[{"series": f'sluice_gateway_claim_wait_seconds_bucket{{{chain}, le="{le}"}}', "values": v}
              for le, v in (("0.5", "0x30"), ("1", "0x30"), ("2.5", "0+5x30"), ("5", "0+10x30"), ("+Inf", "0+10x30"))],
            *[{"series": f'sluice_gateway_claim_wait_seconds_bucket{{{healthy}, le="{le}"}}', "values": "0+10x30"}
              for le in ("0.5", "1", "2.5", "5", "+Inf")],
            # One gateway's certificate ends 3 days after the test's start (time() is 0 there), the other's
            # in 60 days.
            {"series": 'sluice_gateway_tls_certificate_expiry_timestamp_seconds{pod="gw-a"}', "values": f"{3 * 86400}x200"},
            {"series": 'sluice_gateway_tls_certificate_expiry_timestamp_seconds{pod="gw-b"}', "values": f"{60 * 86400}x200"},
            # bot's sandboxes are throttled twice per 10 runs; ok-bot's never. Pod p1 is throttled in
            # half its CFS periods, p2 in none.
            {"series": f'sluice_gateway_runs_total{{{chain}, mode="run", action="pass"}}', "values": "0+10x30"},
            {"series": f'sluice_gateway_sandbox_cpu_throttled_periods_total{{{chain}}}', "values": "0+2x30"},
            {"series": f'sluice_gateway_runs_total{{{healthy}, mode="run", action="pass"}}', "values": "0+10x30"},
            {"series": f'sluice_gateway_sandbox_cpu_throttled_periods_total{{{healthy}}}', "values": "0x30"},
            *[{"series": f'{metric}{{namespace="sluice-sandboxes", pod="{pod}", container="supervisor"}}', "values": v}
              for metric, pod, v in (("container_cpu_cfs_periods_total", "p1", "0+600x30"),
                                     ("container_cpu_cfs_throttled_periods_total", "p1", "0+300x30"),
                                     ("container_cpu_cfs_periods_total", "p2", "0+600x30"),
                                     ("container_cpu_cfs_throttled_periods_total", "p2", "0x30"))],
        ]
        labels = {"namespace": "team", "target": "bot", "trigger_point": "input", "severity": "warning"}
        rules = {r["alert"]: r for g in self.rules[0]["spec"]["groups"] for r in g["rules"] if "alert" in r}

        def fired(alert, summary):
            # The annotations as Prometheus renders them: the templates must work, not only parse.
            annotations = {"summary": summary, "description": rules[alert]["annotations"]["description"]}
            return [{"exp_labels": labels, "exp_annotations": annotations}]

        tests = {
            "rule_files": ["rules.yaml"],
            "evaluation_interval": "1m",
            "tests": [{
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "25m", "alertname": "SluiceUnavailable",
                     "exp_alerts": fired("SluiceUnavailable", "Sluice chain team/bot (input) answers UNAVAILABLE")},
                    {"eval_time": "25m", "alertname": "SluiceGatewayErrorRate",
                     "exp_alerts": fired("SluiceGatewayErrorRate", "Sluice chain team/bot (input) fails 30% of its requests")},
                    {"eval_time": "25m", "alertname": "SluiceClaimWaitHigh",
                     "exp_alerts": fired("SluiceClaimWaitHigh",
                                         "Runs of Sluice chain team/bot (input) wait 4.75s (p95) for a sandbox")},
                    {"eval_time": "90m", "alertname": "SluiceGatewayCertificateExpiresSoon",
                     "exp_alerts": [{"exp_labels": {"pod": "gw-a", "severity": "warning"}, "exp_annotations": {
                         "summary": "The Sluice gateway's TLS certificate expires in 2d 22h 30m 0s",
                         "description": rules["SluiceGatewayCertificateExpiresSoon"]["annotations"]["description"]}}]},
                    {"eval_time": "25m", "alertname": "SluiceSandboxCpuThrottled",
                     "exp_alerts": fired("SluiceSandboxCpuThrottled",
                                         "Sandboxes of Sluice chain team/bot (input) are CPU-throttled 0.20 times per trigger point")},
                    {"eval_time": "25m", "alertname": "SluiceSandboxPodCpuThrottled",
                     "exp_alerts": [{"exp_labels": {"namespace": "sluice-sandboxes", "pod": "p1", "severity": "warning"},
                                     "exp_annotations": {
                         "summary": "Sandbox pod sluice-sandboxes/p1 is CPU-throttled in 50% of its CFS periods",
                         "description": rules["SluiceSandboxPodCpuThrottled"]["annotations"]["description"]}}]},
                    # Before `for:` has passed nothing fires.
                    {"eval_time": "3m", "alertname": "SluiceGatewayErrorRate", "exp_alerts": []},
                ],
            }],
        }
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "rules.yaml"), "w") as f:
                # promtool reads the annotations' templates as the Prometheus server would.
                yaml.safe_dump({"groups": self.rules[0]["spec"]["groups"]}, f)
            with open(os.path.join(tmp, "test.yaml"), "w") as f:
                yaml.safe_dump(tests, f)
            proc = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp, capture_output=True,
                                  text=True, timeout=120)
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_hook_alerts_fire_on_synthetic_series(self):
        """promtool test rules for the per-hook and pool alerts: a hook whose block rate jumps above its
        own baseline fires, one that always blocks as much does not; a slow hook fires, a fast one not;
        a chain with no warm pod fires, one with pods not."""
        bot = 'chain="team/bot", namespace="team", target="bot", trigger_point="input"'
        # 5-minute samples over 31 h: "redact" blocks 1 in 101 for 29 h, then 10 in 110; "steady"
        # blocks 10 in 110 all along.
        series = [
            {"series": f'sluice_gateway_hook_actions_total{{{bot}, hook="redact", action="pass"}}', "values": "0+100x372"},
            {"series": f'sluice_gateway_hook_actions_total{{{bot}, hook="redact", action="block"}}',
             "values": "0+1x348 358+10x23"},
            {"series": f'sluice_gateway_hook_actions_total{{{bot}, hook="steady", action="pass"}}', "values": "0+100x372"},
            {"series": f'sluice_gateway_hook_actions_total{{{bot}, hook="steady", action="block"}}', "values": "0+10x372"},
            # "slow" takes 0.5-1 s; "steady" under 5 ms.
            *[{"series": f'sluice_gateway_hook_duration_seconds_bucket{{{bot}, hook="slow", le="{le}"}}', "values": v}
              for le, v in (("0.25", "0x372"), ("0.5", "0+5x372"), ("1", "0+10x372"), ("+Inf", "0+10x372"))],
            *[{"series": f'sluice_gateway_hook_duration_seconds_bucket{{{bot}, hook="steady", le="{le}"}}', "values": "0+10x372"}
              for le in ("0.005", "0.25", "1", "+Inf")],
            {"series": 'sluice_operator_pool_warm_pods{namespace="team", chain="bot"}', "values": "2x10 0x362"},
            {"series": 'sluice_operator_pool_warm_pods{namespace="team", chain="ok"}', "values": "2x372"},
        ]
        rules = {r["alert"]: r for g in self.rules[0]["spec"]["groups"] for r in g["rules"] if "alert" in r}

        def fired(alert, labels, summary):
            annotations = {"summary": summary, "description": rules[alert]["annotations"]["description"]}
            return [{"exp_labels": {**labels, "severity": "warning"}, "exp_annotations": annotations}]

        tests = {
            "rule_files": ["rules.yaml"],
            "evaluation_interval": "5m",
            "tests": [{
                "interval": "5m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "30h30m", "alertname": "SluiceHookBlockRateSpike",
                     "exp_alerts": fired("SluiceHookBlockRateSpike", {"chain": "team/bot", "hook": "redact"},
                                         "Hook redact of Sluice chain team/bot ends 9.091% of its runs (block or skip)")},
                    # Before the jump: quiet, for both hooks.
                    {"eval_time": "28h", "alertname": "SluiceHookBlockRateSpike", "exp_alerts": []},
                    {"eval_time": "30h30m", "alertname": "SluiceHookLatencyHigh",
                     "exp_alerts": fired("SluiceHookLatencyHigh", {"chain": "team/bot", "hook": "slow"},
                                         "Hook slow of Sluice chain team/bot takes 990ms (p99)")},
                    {"eval_time": "2h", "alertname": "SluicePoolEmpty",
                     "exp_alerts": fired("SluicePoolEmpty", {"namespace": "team", "chain": "bot"},
                                         "Sluice chain team/bot has no warm sandbox pod")},
                ],
            }],
        }
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "rules.yaml"), "w") as f:
                yaml.safe_dump({"groups": self.rules[0]["spec"]["groups"]}, f)
            with open(os.path.join(tmp, "test.yaml"), "w") as f:
                yaml.safe_dump(tests, f)
            proc = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp, capture_output=True,
                                  text=True, timeout=120)
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_dashboard_configmap_has_the_sidecar_label_and_parses(self):
        cm = self.dashboards[0]
        self.assertEqual(cm["metadata"]["labels"].get("grafana_dashboard"), "1")
        dashboard = json.loads(cm["data"]["sluice.json"])
        self.assertEqual(dashboard["uid"], "sluice-overview")
        self.assertGreaterEqual(len([p for p in dashboard["panels"] if p["type"] != "row"]), 10)

    def test_every_dashboard_query_parses_and_reads_existing_metrics(self):
        dashboard = json.loads(self.dashboards[0]["data"]["sluice.json"])
        exprs = dashboard_expressions(dashboard)
        groups = [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                   for i, (_, e) in enumerate(exprs)]}]
        ok, out = check_rules(groups)
        self.assertTrue(ok, out)
        for where, expr in exprs:
            self.assertEqual(unknown_metrics(expr, self.known), [], where)
        used = {n for _, e in exprs for n in re.findall(r"\bsluice_[a-z0-9_]+", e)}
        for wanted in ("sluice_gateway_run_duration_seconds_bucket", "sluice_gateway_claim_wait_seconds_bucket",
                       "sluice_gateway_sandboxes", "sluice_gateway_hook_errors_total", "sluice_gateway_cells_prepared_total",
                       "sluice_gateway_hook_actions_total", "sluice_gateway_hook_duration_seconds_bucket"):
            self.assertIn(wanted, used, "the dashboard shows it")

    def test_every_metric_is_documented_in_operations_md(self):
        with open(os.path.join(ROOT, "docs", "operations.md")) as f:
            doc = f.read()
        registered = {n for n in self.known if "_process_" not in n}
        self.assertGreater(len(registered), 25)
        missing = sorted(n for n in registered if f"`{n}`" not in doc)
        self.assertEqual(missing, [], "metrics the code registers that docs/operations.md does not list")

    def test_the_checks_refuse_a_broken_query_and_a_made_up_metric(self):
        ok, _ = check_rules([{"name": "bad", "rules": [{"record": "x:y", "expr": "sum(rate(sluice_gateway_runs_total[5m])"}]}])
        self.assertFalse(ok, "promtool accepted an unbalanced expression")
        self.assertEqual(unknown_metrics("rate(sluice_gateway_made_up_total[5m])", self.known),
                         ["sluice_gateway_made_up_total"])
        self.assertEqual(unknown_metrics("sluice_gateway_run_duration_seconds_bucket", self.known), [])


if __name__ == "__main__":
    unittest.main()
