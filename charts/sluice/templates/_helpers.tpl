{{/* Names, labels and images shared by every template. */}}

{{- define "sluice.name" -}}sluice{{- end -}}

{{/* Object names: sluice-operator, sluice-gateway (fixed: the contract and the docs use them). */}}
{{- define "sluice.operator.name" -}}sluice-operator{{- end -}}
{{- define "sluice.gateway.name" -}}sluice-gateway{{- end -}}

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
