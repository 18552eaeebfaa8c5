{{- /*
Shared pieces of the Prometheus Operator monitors (monitoring.coreos.com/v1) and the dashboard.
*/ -}}

{{/* Labels of every monitor: the chart's, plus monitoring.labels (e.g. release: kube-prometheus-stack). */}}
{{- define "sparsegate.monitoring.labels" -}}
{{ include "sparsegate.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .root.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Where SparseModel pods live: every namespace with operator.clusterWide, else those it serves. */}}
{{- define "sparsegate.monitoring.modelNamespaces" -}}
{{- if .Values.operator.clusterWide }}
any: true
{{- else }}
matchNames:
  {{- range splitList "," (include "sparsegate.operator.namespaces" .) }}
  - {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Model-server pods: the labels the operator renders on them (sparsegate_contracts.names). */}}
{{- define "sparsegate.monitoring.modelSelector" -}}
matchLabels:
  app.kubernetes.io/name: sparsegate-model
  app.kubernetes.io/managed-by: sparsegate
{{- end -}}

{{/* The SparseModel's name (pod label sparsegate.dev/model) as `model`, the node as `node`: the
     dashboard's model variable reads `model`. */}}
{{- define "sparsegate.monitoring.modelRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_sparsegate_dev_model]
  targetLabel: model
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- end -}}

{{/* Fails the render when a target is on in both monitor kinds (it would be scraped twice and the
     dashboard's joins would see every series twice). */}}
{{- define "sparsegate.monitoring.validate" -}}
{{- $m := .Values.monitoring }}
{{- if and (or $m.serviceMonitor.enabled $m.podMonitor.enabled) $m.interval $m.scrapeTimeout }}
{{- $interval := include "sparsegate.monitoring.durationMs" $m.interval | int64 }}
{{- $timeout := include "sparsegate.monitoring.durationMs" $m.scrapeTimeout | int64 }}
{{- if gt $timeout $interval }}
{{- fail (printf "monitoring.scrapeTimeout (%s) is longer than monitoring.interval (%s): Prometheus refuses a scrape timeout greater than the scrape interval (the Prometheus Operator skips such a monitor), so nothing would be scraped" $m.scrapeTimeout $m.interval) }}
{{- end }}
{{- end }}
{{- if and $m.serviceMonitor.enabled $m.podMonitor.enabled }}
{{- range $target := list "operator" "models" }}
{{- if and (index $m.serviceMonitor $target) (index $m.podMonitor $target) }}
{{- fail (printf "monitoring.serviceMonitor.%s and monitoring.podMonitor.%s are both true: %s would be scraped twice; set one of them to false" $target $target $target) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Milliseconds of a duration in the schema's form (e.g. 1m30s, 500ms). */}}
{{- define "sparsegate.monitoring.durationMs" -}}
{{- $units := dict "h" 3600000 "m" 60000 "s" 1000 "ms" 1 }}
{{- $ms := 0 }}
{{- range regexFindAll "[0-9]+(ms|h|m|s)" . -1 }}
{{- $ms = add $ms (mul (regexFind "^[0-9]+" . | int64) (index $units (regexReplaceAll "^[0-9]+" . ""))) }}
{{- end }}
{{- $ms -}}
{{- end -}}

{{/* One alerting rule of the PrometheusRule, or nothing when its monitoring.prometheusRule.alerts
     entry is off: name, a (the entry: enabled, for, severity), expr, summary, description (Prometheus
     templates, passed through as they are). */}}
{{- define "sparsegate.prometheusRule.alert" -}}
{{- if .a.enabled }}
- alert: {{ .name }}
  expr: {{ .expr | quote }}
  {{- with index .a "for" }}
  for: {{ . }}
  {{- end }}
  labels:
    severity: {{ .a.severity | quote }}
  annotations:
    summary: {{ .summary | quote }}
    description: {{ .description | quote }}
{{- end }}
{{- end -}}
