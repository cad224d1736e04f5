{{/* Names, labels and images shared by every template. */}}

{{- define "sluice.name" -}}sluice{{- end -}}

{{/*
The release's name for what it shares with the cluster: every cluster-scoped object (the components'
ClusterRoles, the webhook configuration), the sandbox namespace, the Lease and the monitoring objects
carry it, so several releases live in one cluster. fullnameOverride; else the release name when it
says sluice (release `sluice`: `sluice`, the names of a single install); else <release>-sluice.
*/}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else if contains "sluice" .Release.Name -}}
{{- .Release.Name -}}
{{- else -}}
{{- printf "%s-sluice" .Release.Name -}}
{{- end -}}
{{- end -}}

{{/*
Objects inside the release namespace: sluice-operator, sluice-gateway (fixed: the contract and the
docs use them, and a namespace holds one release).
*/}}
{{- define "sluice.operator.name" -}}sluice-operator{{- end -}}
{{- define "sluice.gateway.name" -}}sluice-gateway{{- end -}}

{{/*
Where sandbox pods live: sandboxNamespace.name when given (empty: beside their chains), else
<fullname>-sandboxes.
*/}}
{{- define "sluice.sandboxNamespace" -}}
{{- $name := .Values.sandboxNamespace.name -}}
{{- if not (kindIs "string" $name) -}}
{{- $name = printf "%s-sandboxes" (include "sluice.fullname" .) -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "the sandbox namespace %q is longer than 63 characters: set sandboxNamespace.name, or a shorter fullnameOverride" $name) -}}
{{- end -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* The operator's leader-election Lease, in the release namespace. */}}
{{- define "sluice.leaseName" -}}
{{- .Values.operator.leaseName | default (printf "%s-operator" (include "sluice.fullname" .)) -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: sluice
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels never change after install (Deployment selectors are immutable). */}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sluice.componentLabels" -}}
{{ include "sluice.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sluice.image" -}}
{{- $img := index .root.Values.image .component -}}
{{- printf "%s/%s:%s" .root.Values.image.registry $img.repository (.root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "sluice.platformNamespace" -}}
{{- .Values.platformNamespace | default .Release.Namespace -}}
{{- end -}}

{{/* The hardened container securityContext both components run with. */}}
{{- define "sluice.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65534
runAsGroup: 65534
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "sluice.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* The Secret holding the gateway's serving certificate (tls.crt, tls.key, and ca.crt from cert-manager). */}}
{{- define "sluice.gateway.tlsSecret" -}}
{{- .Values.gateway.tls.secretName | default (printf "%s-tls" (include "sluice.gateway.name" .)) -}}
{{- end -}}

{{/*
Certificates the operator makes (gateway.tls.mode=operator, webhook.certificate.source=operator): the
CA's Secret and the ConfigMap clients read its bundle from (<fullname>-ca), and the webhook's Secret.
*/}}
{{- define "sluice.operatorMadeGatewayCert" -}}
{{- if eq .Values.gateway.tls.mode "operator" }}true{{ end -}}
{{- end -}}
{{- define "sluice.operatorMadeWebhookCert" -}}
{{- if and .Values.webhook.enabled (eq .Values.webhook.certificate.source "operator") }}true{{ end -}}
{{- end -}}
{{- define "sluice.operatorCA" -}}{{ include "sluice.fullname" . }}-ca{{- end -}}
{{- define "sluice.webhook.name" -}}{{ include "sluice.operator.name" . }}-webhook{{- end -}}
{{- define "sluice.webhook.tlsSecret" -}}
{{- if eq .Values.webhook.certificate.source "secret" -}}
{{- .Values.webhook.certificate.secretName -}}
{{- else -}}
{{- include "sluice.webhook.name" . }}-tls
{{- end -}}
{{- end -}}
{{- define "sluice.webhook.configurationName" -}}{{ include "sluice.fullname" . }}-validate-{{ .Release.Namespace }}{{- end -}}
{{/* The DNS names of the gateway's serving certificate: its Service's, and gateway.tls.dnsNames. */}}
{{- define "sluice.gateway.dnsNames" -}}
{{- $name := include "sluice.gateway.name" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) -}}
{{- concat $names .Values.gateway.tls.dnsNames .Values.gateway.tls.certManager.dnsNames | uniq | join "," -}}
{{- end -}}

{{/*
chainSelector as the webhook's objectSelector: each term k=v, k==v, k!=v, k or !k as a
matchExpression. Set-based terms (in, notin) need webhook.objectSelector given explicitly.
*/}}
{{- define "sluice.chainObjectSelector" -}}
{{- $exprs := list -}}
{{- range $term := splitList "," .Values.chainSelector -}}
{{- $t := trim $term -}}
{{- if or (contains "(" $t) (contains " in " $t) (contains " notin " $t) -}}
{{- fail (printf "chainSelector %q: a set-based term needs webhook.objectSelector given explicitly" $.Values.chainSelector) -}}
{{- else if contains "!=" $t -}}
{{- $kv := splitList "!=" $t -}}
{{- $exprs = append $exprs (dict "key" (trim (first $kv)) "operator" "NotIn" "values" (list (trim (last $kv)))) -}}
{{- else if contains "=" $t -}}
{{- $kv := splitList "=" (replace "==" "=" $t) -}}
{{- $exprs = append $exprs (dict "key" (trim (first $kv)) "operator" "In" "values" (list (trim (last $kv)))) -}}
{{- else if hasPrefix "!" $t -}}
{{- $exprs = append $exprs (dict "key" (trimPrefix "!" $t | trim) "operator" "DoesNotExist") -}}
{{- else if $t -}}
{{- $exprs = append $exprs (dict "key" $t "operator" "Exists") -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "matchExpressions" $exprs) -}}
{{- end -}}

{{/* The gateway's TLS and caller-policy arguments; a listener without either needs gateway.insecure. */}}
{{- define "sluice.gateway.securityArgs" -}}
{{- $g := .Values.gateway -}}
{{- if and (eq $g.tls.mode "secret") (not $g.tls.secretName) -}}
{{- fail "gateway.tls.mode=secret needs gateway.tls.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and (not $g.insecure) (or (eq $g.tls.mode "none") (not $g.callers.enabled)) -}}
{{- fail "the gateway listens on the pod network: gateway.tls.mode=none or gateway.callers.enabled=false needs gateway.insecure=true" -}}
{{- end -}}
{{- if ne $g.tls.mode "none" }}
- --tls-cert=/etc/sluice/tls/tls.crt
- --tls-key=/etc/sluice/tls/tls.key
{{- if $g.tls.clientCA.enabled }}
- --client-ca=/etc/sluice/client-ca/{{ $g.tls.clientCA.key }}
{{- end }}
{{- end }}
{{- if $g.callers.enabled }}
- --callers=/etc/sluice/callers/callers.yaml
{{- end }}
{{- if $g.insecure }}
- --insecure
{{- end }}
{{- end -}}

{{/* Roles for people (templates/roles.yaml): unique per release, as ClusterRoles are cluster-wide. */}}
{{- define "sluice.role.hookchainEdit" -}}{{ .Release.Name }}-hookchain-edit{{- end -}}
{{- define "sluice.role.view" -}}{{ .Release.Name }}-view{{- end -}}
{{- define "sluice.role.platform" -}}{{ .Release.Name }}-platform{{- end -}}
{{- define "sluice.role.capabilityAdmin" -}}{{ .Release.Name }}-capability-admin{{- end -}}

{{/* --allowed-endpoints, for the operator and the gateway alike (nothing when the list is empty),
and the cluster domain its Service entries end in (nothing when it is the binaries' default). */}}
{{- define "sluice.allowedEndpointsArg" -}}
{{- $args := list -}}
{{- with .Values.capabilities.allowedEndpoints -}}
{{- $args = append $args (printf "- %s" (printf "--allowed-endpoints=%s" (join "," .) | quote)) -}}
{{- end -}}
{{- if ne .Values.capabilities.clusterDomain "cluster.local" -}}
{{- $args = append $args (printf "- --cluster-domain=%s" .Values.capabilities.clusterDomain) -}}
{{- end -}}
{{- join "\n" $args -}}
{{- end -}}

{{/* Where the gateway mounts the credential sets of capabilities.credentials, one directory each. */}}
{{- define "sluice.gateway.credentialsDir" -}}/etc/sluice/capability-credentials{{- end -}}

{{/*
The API server's addresses, as a JSON list of CIDRs: networkPolicy.apiServer.cidrs or, when that is
empty, the addresses of the `kubernetes` EndpointSlice (else Endpoints) in `default`, looked up in the
cluster being installed into. Empty under `helm template` and `--dry-run=client` (no cluster).
*/}}
{{- define "sluice.apiServerCIDRs" -}}
{{- $cidrs := .Values.networkPolicy.apiServer.cidrs -}}
{{- if not $cidrs -}}
{{- $ips := list -}}
{{- $slice := lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "kubernetes" -}}
{{- range (dig "endpoints" list $slice) -}}
{{- $ips = concat $ips (dig "addresses" list .) -}}
{{- end -}}
{{- if not $ips -}}
{{- $endpoints := lookup "v1" "Endpoints" "default" "kubernetes" -}}
{{- range (dig "subsets" list $endpoints) -}}
{{- range (dig "addresses" list .) -}}
{{- $ips = append $ips (get . "ip") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range uniq $ips -}}
{{- $cidrs = append $cidrs (printf "%s/%s" . (ternary "128" "32" (contains ":" .))) -}}
{{- end -}}
{{- end -}}
{{- toJson $cidrs -}}
{{- end -}}

{{/*
The resolvers of networkPolicy.dns as NetworkPolicy peers (a YAML list): the DNS pods (kubeDNS), the
metadata server (cloudDNS), NodeLocal DNSCache's address and pods, and networkPolicy.dns.cidrs.
*/}}
{{- define "sluice.dnsPeers" -}}
{{- $dns := .Values.networkPolicy.dns -}}
{{- $peers := list -}}
{{- range $dns.resolvers -}}
{{- if eq . "kubeDNS" -}}
{{- $peers = append $peers (dict "namespaceSelector" $dns.namespaceSelector "podSelector" $dns.podSelector) -}}
{{- else if eq . "cloudDNS" -}}
{{- $peers = append $peers (dict "ipBlock" (dict "cidr" "169.254.169.254/32")) -}}
{{- else if eq . "nodeLocalDNSCache" -}}
{{- with $dns.nodeLocalDNSCache -}}
{{- include "sluice.checkCIDR" (dict "what" "networkPolicy.dns.nodeLocalDNSCache.address" "cidr" .address) -}}
{{- $peers = append $peers (dict "ipBlock" (dict "cidr" .address)) -}}
{{- $peers = append $peers (dict "namespaceSelector" .namespaceSelector "podSelector" .podSelector) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $dns.cidrs -}}
{{- include "sluice.checkCIDR" (dict "what" "networkPolicy.dns.cidrs" "cidr" .) -}}
{{- $peers = append $peers (dict "ipBlock" (dict "cidr" .)) -}}
{{- end -}}
{{- range $peers -}}
{{- if and (hasKey . "namespaceSelector") (not .namespaceSelector) -}}
{{- fail "networkPolicy.dns: a resolver's namespaceSelector is empty; name the namespace of the DNS pods (matchLabels kubernetes.io/metadata.name)" -}}
{{- end -}}
{{- end -}}
{{- if not $peers -}}
{{- fail "networkPolicy.dns: no resolver is allowed (resolvers and cidrs are empty): the components could not resolve a name; list the resolvers your pods ask (docs/gke-sandbox.md, \"3. DNS\")" -}}
{{- end -}}
{{- toYaml $peers -}}
{{- end -}}

{{/* Fails on a CIDR that is every address: no NetworkPolicy of the chart may open the whole network. */}}
{{- define "sluice.checkCIDR" -}}
{{- if hasSuffix "/0" .cidr -}}
{{- fail (printf "%s: %s is every address; list the addresses that are needed" .what .cidr) -}}
{{- end -}}
{{- end -}}

{{/*
One entry of capabilities.allowedEndpoints as a NetworkPolicy sees it, as JSON: {kind, port, namespace,
cidr}. kind: service (<namespace>/<service>), address (an IPv4 or [IPv6] literal) or host (a name or
*.<domain>, which no NetworkPolicy can match). The port follows the last ':' outside an IPv6
literal's brackets, as the components read it.
*/}}
{{- define "sluice.endpointEntry" -}}
{{- $entry := lower (trim .) -}}
{{- $place := $entry -}}
{{- $out := dict "kind" "host" -}}
{{- if regexMatch "^.*[^:]:[0-9]+$" $entry -}}
{{- $place = regexReplaceAll ":[0-9]+$" $entry "" -}}
{{- $port := regexReplaceAll "^.*:" $entry "" | atoi -}}
{{- if or (lt $port 1) (gt $port 65535) -}}
{{- fail (printf "capabilities.allowedEndpoints: %q: the port must be a number from 1 to 65535" .) -}}
{{- end -}}
{{- $_ := set $out "port" $port -}}
{{- end -}}
{{- if contains "/" $place -}}
{{- $_ := set $out "kind" "service" -}}
{{- $_ := set $out "namespace" (regexReplaceAll "/.*$" $place "") -}}
{{- else if regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$" $place -}}
{{- $_ := set $out "kind" "address" -}}
{{- $_ := set $out "cidr" (printf "%s/32" $place) -}}
{{- else if regexMatch "^\\[[0-9a-f:.]+\\]$" $place -}}
{{- $_ := set $out "kind" "address" -}}
{{- $_ := set $out "cidr" (printf "%s/128" (trimAll "[]" $place)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
The gateway's egress beyond DNS and the API server, as a YAML list of NetworkPolicy egress rules:
the capability endpoints of capabilities.allowedEndpoints that a NetworkPolicy can match (a Service's
namespace, an address), capabilities.egressCIDRs, the OTLP collector and
networkPolicy.gateway.capabilityEgress. Nothing that selects every namespace or every address.
*/}}
{{/* The egress rule that lets the gateway reach `url` (JSON), or {} when a NetworkPolicy cannot name it:
a Service of the cluster written as SERVICE.NAMESPACE[.svc[.cluster.local]][:PORT] (its namespace, on
that port), or an IPv4 address (that address, on that port). Host names outside the cluster have no
rule: their addresses come from capabilities.egressCIDRs. */}}
{{- define "sluice.urlEgressRule" -}}
{{- $u := urlParse . -}}
{{- $hostport := splitList ":" $u.host -}}
{{- $host := first $hostport -}}
{{- $port := ternary (last $hostport) (ternary "443" "80" (eq $u.scheme "https")) (eq (len $hostport) 2) -}}
{{- $ports := list (dict "protocol" "TCP" "port" (int $port)) -}}
{{- $parts := splitList "." $host -}}
{{- if regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" $host -}}
{{- dict "to" (list (dict "ipBlock" (dict "cidr" (printf "%s/32" $host)))) "ports" $ports | toJson -}}
{{- else if and (ge (len $parts) 2) (or (eq (len $parts) 2) (eq (index $parts 2) "svc")) -}}
{{- dict "to" (list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" (index $parts 1))))) "ports" $ports | toJson -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{- define "sluice.gateway.egress" -}}
{{- $rules := list -}}
{{- range .Values.capabilities.allowedEndpoints -}}
{{- $e := include "sluice.endpointEntry" . | fromJson -}}
{{- $rule := dict -}}
{{- if eq $e.kind "service" -}}
{{- if eq $e.namespace "*" -}}
{{- fail (printf "capabilities.allowedEndpoints: %q allows a Service in every namespace, which the gateway's NetworkPolicy could only follow by letting it reach every pod of the cluster: name the namespaces (team-a/ledger, team-b/ledger), or set networkPolicy.enabled=false and control the gateway's egress yourself" .) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $e.namespace) -}}
{{- fail (printf "capabilities.allowedEndpoints: %q: write a Service as <namespace>/<service>" .) -}}
{{- end -}}
{{- $_ := set $rule "to" (list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" $e.namespace)))) -}}
{{- else if eq $e.kind "address" -}}
{{- $_ := set $rule "to" (list (dict "ipBlock" (dict "cidr" $e.cidr))) -}}
{{- end -}}
{{- /* A host name: its addresses come from capabilities.egressCIDRs. */ -}}
{{- if and (hasKey $rule "to") (hasKey $e "port") -}}
{{- $_ := set $rule "ports" (list (dict "protocol" "TCP" "port" (int $e.port))) -}}
{{- end -}}
{{- if and (hasKey $rule "to") (not (has $rule $rules)) -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- /* MCP servers in the cluster, written as http://SERVICE.NAMESPACE[.svc[.cluster.local]][:PORT]/...:
their namespace on their port. Others are reached through capabilities.egressCIDRs. */ -}}
{{- if .Values.gateway.mcp.enabled -}}
{{- range .Values.gateway.mcp.servers -}}
{{- $rule := include "sluice.urlEgressRule" .url | fromJson -}}
{{- if and $rule (not (has $rule $rules)) -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* The OpenAI proxy's upstream likewise; one outside the cluster must be reachable through
capabilities.egressCIDRs, or every proxied call would time out. */ -}}
{{- if .Values.gateway.openai.enabled -}}
{{- $rule := include "sluice.urlEgressRule" .Values.gateway.openai.upstream | fromJson -}}
{{- if $rule -}}
{{- if not (has $rule $rules) -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- else if not .Values.capabilities.egressCIDRs -}}
{{- fail (printf "gateway.openai.upstream %q is a host outside the cluster, and with networkPolicy.enabled the gateway may reach only the addresses its NetworkPolicy lists (a NetworkPolicy cannot match a host name): list the upstream's addresses in capabilities.egressCIDRs, or set networkPolicy.enabled=false and control the gateway's egress yourself" .Values.gateway.openai.upstream) -}}
{{- end -}}
{{- end -}}
{{- with .Values.capabilities.egressCIDRs -}}
{{- $to := list -}}
{{- range . -}}
{{- include "sluice.checkCIDR" (dict "what" "capabilities.egressCIDRs" "cidr" .) -}}
{{- $to = append $to (dict "ipBlock" (dict "cidr" .)) -}}
{{- end -}}
{{- $rules = append $rules (dict "to" $to) -}}
{{- end -}}
{{- with .Values.networkPolicy.gateway.otlpCollector -}}
{{- $to := list -}}
{{- if .namespace -}}
{{- $peer := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .namespace)) -}}
{{- with .podSelector -}}
{{- $_ := set $peer "podSelector" . -}}
{{- end -}}
{{- $to = append $to $peer -}}
{{- end -}}
{{- range .cidrs -}}
{{- include "sluice.checkCIDR" (dict "what" "networkPolicy.gateway.otlpCollector.cidrs" "cidr" .) -}}
{{- $to = append $to (dict "ipBlock" (dict "cidr" .)) -}}
{{- end -}}
{{- if $to -}}
{{- $ports := list -}}
{{- range .ports -}}
{{- $ports = append $ports (dict "protocol" "TCP" "port" .) -}}
{{- end -}}
{{- $rules = append $rules (dict "to" $to "ports" $ports) -}}
{{- end -}}
{{- end -}}
{{- range .Values.networkPolicy.gateway.capabilityEgress -}}
{{- $to := get . "to" -}}
{{- if not $to -}}
{{- fail "networkPolicy.gateway.capabilityEgress: every rule needs a `to` (a rule without one allows every destination)" -}}
{{- end -}}
{{- range $to -}}
{{- if and (hasKey . "namespaceSelector") (not (get . "namespaceSelector")) -}}
{{- fail "networkPolicy.gateway.capabilityEgress: `namespaceSelector: {}` selects every namespace; name the namespaces (matchLabels kubernetes.io/metadata.name)" -}}
{{- end -}}
{{- with (get . "ipBlock") -}}
{{- include "sluice.checkCIDR" (dict "what" "networkPolicy.gateway.capabilityEgress" "cidr" (get . "cidr")) -}}
{{- end -}}
{{- end -}}
{{- $rules = append $rules . -}}
{{- end -}}
{{- with $rules -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/*
Fails when the gateway exports traces to a collector its NetworkPolicy does not let it reach: an OTLP
endpoint in gateway.extraEnv that is not on localhost (a sidecar needs no rule), with no
networkPolicy.gateway.otlpCollector. Endpoints given through valueFrom cannot be read here.
*/}}
{{- define "sluice.gateway.checkOtlp" -}}
{{- $collector := .Values.networkPolicy.gateway.otlpCollector -}}
{{- if not (or $collector.namespace $collector.cidrs) -}}
{{- range .Values.gateway.extraEnv -}}
{{- $name := get . "name" -}}
{{- $value := get . "value" -}}
{{- if and $value (has $name (list "OTEL_EXPORTER_OTLP_ENDPOINT" "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) -}}
{{- $host := get (urlParse $value) "hostname" -}}
{{- if and $host (not (has $host (list "localhost" "127.0.0.1" "::1"))) -}}
{{- fail (printf "gateway.extraEnv sends traces to %s=%s, which the gateway's NetworkPolicy does not let it reach: set networkPolicy.gateway.otlpCollector.namespace (and .podSelector) or .cidrs" $name $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the MCP proxy's session key. */}}
{{- define "sluice.gateway.mcpSessionSecret" -}}
{{- .Values.gateway.mcp.sessionKeySecret | default (printf "%s-mcp-session" (include "sluice.gateway.name" .)) -}}
{{- end }}

{{/* The ConfigMap of trusted signers (key allowed_signers). */}}
{{- define "sluice.signing.configMap" -}}
{{- .Values.signing.existingConfigMap | default (printf "%s-trusted-signers" (include "sluice.fullname" .)) -}}
{{- end -}}

{{/* The flags that make a component verify signed hook code, when signing is enabled. */}}
{{- define "sluice.signingArgs" -}}
{{- if .Values.signing.enabled }}
- --trusted-signers=/etc/sluice/signing/allowed_signers
- --signed-namespaces={{ join "," .Values.signing.namespaces }}
{{- end }}
{{- end -}}

{{/* Whether the operator watches nodes (operator.watchNodes; by default, unless the release is
confined to watchNamespace, where it gets no cluster-scoped rights). Empty when not. */}}
{{- define "sluice.operator.watchNodes" -}}
{{- if kindIs "bool" .Values.operator.watchNodes -}}
{{- if .Values.operator.watchNodes }}true{{ end -}}
{{- else if not .Values.watchNamespace -}}
true
{{- end -}}
{{- end -}}
