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
{{- if and $m.serviceMonitor.enabled $m.podMonitor.enabled }}
{{- range $target := list "operator" "models" }}
{{- if and (index $m.serviceMonitor $target) (index $m.podMonitor $target) }}
{{- fail (printf "monitoring.serviceMonitor.%s and monitoring.podMonitor.%s are both true: %s would be scraped twice; set one of them to false" $target $target $target) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
