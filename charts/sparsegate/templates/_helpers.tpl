{{/* Chart name, possibly overridden. */}}
{{- define "sparsegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix: <release>-sparsegate unless the release name already contains it.
     Helm allows dots in release names (sg.v2), a Service name does not: they become dashes. */}}
{{- define "sparsegate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "sparsegate.name" . -}}
{{- $release := .Release.Name | replace "." "-" -}}
{{- if contains $name $release -}}
{{- $release | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" $release $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "sparsegate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: sparsegate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component (operator | agent). */}}
{{- define "sparsegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sparsegate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* With create=false the name is required: falling back to the namespace's `default`
     ServiceAccount would bind the chart's Roles to every pod there that names no other. */}}
{{- define "sparsegate.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "sparsegate.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.create=false needs operator.serviceAccount.name: the existing ServiceAccount (in the release namespace) the operator runs as and the chart binds its Roles to. Left empty it would be the namespace's `default` ServiceAccount, so every pod there that names no other would get the operator's Secret and Deployment rights" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sparsegate.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (printf "%s-agent" (include "sparsegate.fullname" .)) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- required "agent.serviceAccount.create=false needs agent.serviceAccount.name: the existing ServiceAccount (in the release namespace) the agent runs as and the chart binds its Roles to. Left empty it would be the namespace's `default` ServiceAccount, so every pod there that names no other would get the agent's rights" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sparsegate.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The Secret holding the operator↔OPA bearer token; empty when no token is used
     (external OPA without opa.auth.existingSecret). */}}
{{- define "sparsegate.opa.tokenSecretName" -}}
{{- if .Values.opa.auth.existingSecret -}}
{{- .Values.opa.auth.existingSecret -}}
{{- else if .Values.opa.enabled -}}
{{- printf "%s-opa-token" (include "sparsegate.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "sparsegate.opa.tokenSecretKey" -}}
{{- if .Values.opa.auth.existingSecret -}}
{{- .Values.opa.auth.existingSecretKey -}}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/* The token env var both containers read (OPA's system.authz policy reads the same name). */}}
{{- define "sparsegate.opa.tokenEnv" -}}
- name: SPARSEGATE_OPA_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sparsegate.opa.tokenSecretName" . }}
      key: {{ include "sparsegate.opa.tokenSecretKey" . }}
{{- end -}}

{{/* POD_IP from the downward API: every listener binds it (pods may share one network namespace). */}}
{{- define "sparsegate.podIPEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end -}}

{{/* POD_IPS: every address of the pod (dual-stack), comma-separated; the operator lists them all
as always-allowed sources in the flow policy. */}}
{{- define "sparsegate.podIPsEnv" -}}
- name: POD_IPS
  valueFrom: {fieldRef: {fieldPath: status.podIPs}}
{{- end -}}

{{- /*
The namespaces the operator serves when operator.clusterWide is false: operator.watchNamespaces,
or the release namespace when that is empty. One definition, read by operator/rbac.yaml (a Role and
a RoleBinding per namespace), operator/deployment.yaml (a --namespace flag per namespace) and the
agent (which RoutingPolicies it follows).
*/ -}}
{{- define "sparsegate.operator.namespaces" -}}
{{- .Values.operator.watchNamespaces | default (list .Release.Namespace) | join "," -}}
{{- end -}}
