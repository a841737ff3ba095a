{{- define "rlfleet.labels" -}}
app.kubernetes.io/name: rlfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: rlfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rlfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The trainer image (trainer pods, tiny-model init containers), passed to the operator. */}}
{{- define "rlfleet.trainerImage" -}}
{{ .Values.trainerImage.repository }}:{{ .Values.trainerImage.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The operator's permissions: only what the reconcilers and Kopf use. No Secrets, no ConfigMaps. */}}
{{- define "rlfleet.operatorRules" -}}
- apiGroups: ["rlfleet.io"]
  resources: ["trainingruns", "rolloutfleets", "evalfleets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rlfleet.io"]
  resources: ["trainingruns/status", "rolloutfleets/status", "evalfleets/status"]
  verbs: ["get", "patch"]
- apiGroups: ["rlfleet.io"]
  resources: ["trainingruns/finalizers", "rolloutfleets/finalizers", "evalfleets/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Each fleet's API key: created once (immutable), never read back by the operator.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- end -}}

{{/* The namespaces the operator serves: watchNamespaces, else the release namespace; [] when clusterWide. */}}
{{- define "rlfleet.watchNamespaces" -}}
{{- if .Values.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "clusterWide=true serves every namespace: leave watchNamespaces empty (or set clusterWide=false to serve only the listed ones)" -}}
{{- end -}}
{{- toJson list -}}
{{- else -}}
{{- toJson (.Values.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}
{{- end -}}

{{/* Where the chart creates the trainer's and the router's accounts: every served namespace plus
trainer.extraNamespaces (clusterWide: the operator creates them where a run or a fleet of no run needs one). */}}
{{- define "rlfleet.workloadNamespaces" -}}
{{- $all := concat (include "rlfleet.watchNamespaces" . | fromJsonArray) (.Values.trainer.extraNamespaces | default list) | uniq -}}
{{- toJson $all -}}
{{- end -}}
