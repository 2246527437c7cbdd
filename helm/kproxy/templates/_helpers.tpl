{{/*
Names, labels, kproxy.yaml and the kproxy container, shared by the gateway objects and the sidecar
block. A parent chart can include "kproxy.sidecar.initContainer" and "kproxy.sidecar.volumes".
*/}}

{{- define "kproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kproxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end }}

{{- define "kproxy.labels" -}}
{{ include "kproxy.commonLabels" . }}
{{ include "kproxy.selectorLabels" . }}
{{- end }}

{{/* Labels without the component, for objects the selectors must not pick (the helm test pod). */}}
{{- define "kproxy.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kproxy.configMapName" -}}
{{- default (printf "%s-config" (include "kproxy.fullname" .)) .Values.existingConfigMap }}
{{- end }}

{{- define "kproxy.rulesConfigMapName" -}}
{{- default (printf "%s-rules" (include "kproxy.fullname" .)) .Values.rules.existingConfigMap }}
{{- end }}

{{- define "kproxy.hasRules" -}}
{{- if or .Values.rules.files .Values.rules.existingConfigMap }}true{{ end }}
{{- end }}

{{- define "kproxy.brokerPortStart" -}}
{{- if kindIs "invalid" .Values.exposure.brokerPortStart }}{{ add1 .Values.ports.kafka }}{{ else }}{{ .Values.exposure.brokerPortStart }}{{ end }}
{{- end }}

{{/* The host clients are told; in sni mode the bootstrap name (brokers get names of their own). */}}
{{- define "kproxy.advertisedHost" -}}
{{- if .Values.exposure.advertisedHost }}{{ .Values.exposure.advertisedHost }}
{{- else if include "kproxy.sni" . }}{{ printf "%s.%s" .Values.exposure.sni.bootstrapName .Values.exposure.sni.domain }}
{{- else }}{{ printf "%s.%s.svc" (include "kproxy.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{- define "kproxy.sni" -}}
{{- if eq .Values.exposure.mode "sni" }}true{{ end }}
{{- end }}

{{/* Seconds between SIGTERM and SIGKILL: the value, or kproxy's drain timeout plus a margin. */}}
{{- define "kproxy.gracePeriod" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- $drain := 10.0 }}
{{- with .Values.config.limits }}{{ if hasKey . "drain_timeout_s" }}{{ $drain = .drain_timeout_s }}{{ end }}{{ end }}
{{- add (ceil $drain | int) 10 }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Checks across values that the schema cannot express clearly. */}}
{{- define "kproxy.validate" -}}
{{- if and (include "kproxy.sni" .) (not .Values.tls.enabled) }}
{{- fail "exposure.mode sni needs tls.enabled: true (clients name the broker through TLS SNI)" }}
{{- end }}
{{- if and (include "kproxy.sni" .) (not .Values.exposure.sni.domain) }}
{{- fail "exposure.mode sni needs exposure.sni.domain (brokers are broker-<node_id>.<domain>)" }}
{{- end }}
{{- if and .Values.tls.principal (not .Values.tls.requireClientCert) }}
{{- fail "tls.principal maps client certificates: it needs tls.requireClientCert: true" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a Secret with tls.crt and tls.key" }}
{{- end }}
{{- $sasl := dig "upstream" "sasl" dict .Values.config | default dict }}
{{- if or (and $sasl.password (not (contains "${" $sasl.password))) (and (dig "oauth" "client_secret" "" $sasl) (not (contains "${" (dig "oauth" "client_secret" "" $sasl)))) }}
{{- fail "config.upstream.sasl: a password or client secret never goes in values; put it in a Secret, set auth.existingSecret and use password_file / client_secret_file under /etc/kproxy/secret" }}
{{- end }}
{{- if and (eq .Values.mode "sidecar") (include "kproxy.sni" .) }}
{{- fail "a sidecar is reached on localhost: exposure.mode sni is for the gateway" }}
{{- end }}
{{- end }}

{{/* kproxy.yaml: config from the values, with the sections the chart owns set from the other values. */}}
{{- define "kproxy.configYaml" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $sidecar := eq .Values.mode "sidecar" }}
{{- $_ := set $cfg "mode" .Values.mode }}
{{- $_ := set $cfg "listen" (printf "%s:%d" (ternary "127.0.0.1" "0.0.0.0" $sidecar) (int .Values.ports.kafka)) }}
{{- $_ := set $cfg "admin" (dict "listen" (printf "0.0.0.0:%d" (int .Values.ports.admin))) }}
{{- $exposure := dict "broker_port_start" (include "kproxy.brokerPortStart" . | int) "broker_port_count" (int .Values.exposure.brokerPortCount) }}
{{- if not $sidecar }}
{{- $_ := set $exposure "mode" .Values.exposure.mode }}
{{- $_ := set $exposure "node_id_base" (int .Values.exposure.nodeIdBase) }}
{{- if include "kproxy.sni" . }}
{{- $_ := set $exposure "sni" (dict "domain" .Values.exposure.sni.domain "bootstrap_name" .Values.exposure.sni.bootstrapName) }}
{{- end }}
{{- $_ := set $exposure "advertised_host" (include "kproxy.advertisedHost" .) }}
{{- end }}
{{- $_ := set $cfg "exposure" $exposure }}
{{- if .Values.tls.enabled }}
{{- $tls := dict "enabled" true "cert_file" "/etc/kproxy/tls/tls.crt" "key_file" "/etc/kproxy/tls/tls.key" }}
{{- if .Values.tls.requireClientCert }}
{{- $_ := set $tls "ca_file" "/etc/kproxy/tls/ca.crt" }}
{{- $_ := set $tls "require_client_cert" true }}
{{- with .Values.tls.principal }}
{{- $_ := set $tls "principal" . }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "tls" $tls }}
{{- end }}
{{- if .Values.tracing.enabled }}
{{- $_ := set $cfg "tracing" (dict "enabled" true "sample_ratio" .Values.tracing.sampleRatio "exporter" "otlp") }}
{{- end }}
{{- if include "kproxy.hasRules" . }}
{{- $_ := set $cfg "rules" (list "rules") }}
{{- end }}
{{- if and (not $sidecar) (gt (int .Values.replicaCount) 1) }}
{{- $_ := set $cfg "quota_replicas" (int .Values.replicaCount) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The kproxy container; "sidecar" adds what an init container with restartPolicy Always needs. */}}
{{- define "kproxy.container" -}}
{{- $root := .root }}
{{- $v := $root.Values -}}
- name: kproxy
  image: {{ include "kproxy.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if .sidecar }}
  restartPolicy: Always
  {{- end }}
  args: ["run", "--config", "/etc/kproxy/kproxy.yaml"]
  env:
    - name: POD_NAMESPACE
      valueFrom:
        fieldRef:
          fieldPath: metadata.namespace
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if $v.tracing.enabled }}
    - name: OTEL_SERVICE_NAME
      value: {{ default (include "kproxy.fullname" $root) $v.tracing.serviceName | quote }}
    - name: OTEL_RESOURCE_ATTRIBUTES
      value: "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)"
    {{- with $v.tracing.endpoint }}
    - name: OTEL_EXPORTER_OTLP_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    - name: OTEL_EXPORTER_OTLP_PROTOCOL
      value: {{ $v.tracing.protocol | quote }}
    {{- end }}
    {{- with $v.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    {{- if not .sidecar }}
    - name: kafka
      containerPort: {{ $v.ports.kafka }}
    {{- if not (include "kproxy.sni" $root) }}
    {{- $start := include "kproxy.brokerPortStart" $root | int }}
    {{- range $i := until (int $v.exposure.brokerPortCount) }}
    - name: broker-{{ add $v.exposure.nodeIdBase $i }}
      containerPort: {{ add $start $i }}
    {{- end }}
    {{- end }}
    {{- end }}
    - name: kproxy-admin
      containerPort: {{ $v.ports.admin }}
  {{- if .sidecar }}
  # The application containers start once this passes: kproxy's listeners are bound by then.
  startupProbe:
    httpGet:
      path: /livez
      port: kproxy-admin
    periodSeconds: 1
    failureThreshold: 30
  {{- end }}
  livenessProbe:
    httpGet:
      path: /livez
      port: kproxy-admin
    periodSeconds: 10
    timeoutSeconds: 2
    failureThreshold: 3
  readinessProbe:
    httpGet:
      path: /readyz
      port: kproxy-admin
    periodSeconds: 5
    timeoutSeconds: 2
    failureThreshold: 2
  {{- with $v.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: kproxy-config
      mountPath: /etc/kproxy/kproxy.yaml
      subPath: kproxy.yaml
      readOnly: true
    {{- if include "kproxy.hasRules" $root }}
    - name: kproxy-rules
      mountPath: /etc/kproxy/rules
      readOnly: true
    {{- end }}
    {{- if $v.tls.enabled }}
    - name: kproxy-tls
      mountPath: /etc/kproxy/tls
      readOnly: true
    {{- end }}
    {{- if $v.auth.existingSecret }}
    - name: kproxy-secret
      mountPath: /etc/kproxy/secret
      readOnly: true
    {{- end }}
    - name: kproxy-tmp
      mountPath: /tmp
    {{- with (dig "traffic_log" "dir" "" $v.config) }}
    - name: kproxy-traffic-log
      mountPath: {{ . }}
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- define "kproxy.volumes" -}}
- name: kproxy-config
  configMap:
    name: {{ include "kproxy.configMapName" . }}
{{- if include "kproxy.hasRules" . }}
- name: kproxy-rules
  configMap:
    name: {{ include "kproxy.rulesConfigMapName" . }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: kproxy-tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- if .Values.auth.existingSecret }}
- name: kproxy-secret
  secret:
    secretName: {{ .Values.auth.existingSecret }}
    defaultMode: 0400
{{- end }}
- name: kproxy-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if dig "traffic_log" "dir" "" .Values.config }}
- name: kproxy-traffic-log
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "kproxy.sidecar.initContainer" -}}
{{- include "kproxy.container" (dict "root" . "sidecar" true) }}
{{- end }}

{{- define "kproxy.sidecar.volumes" -}}
{{- include "kproxy.volumes" . }}
{{- end }}
