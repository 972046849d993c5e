{{/*
The chart's name, as in app.kubernetes.io/name.
*/}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's objects: <release>-<chart>, or the release name when it
already holds the chart's name (release "kvpool" -> "kvpool").
*/}}
{{- define "kvpool.fullname" -}}
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

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object: the standard app.kubernetes.io set and helm.sh/chart.
*/}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ include "kvpool.chart" . }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- end }}

{{/*
Labels of the operator's own objects (its Deployment, pods, Service, RBAC, ...).
*/}}
{{- define "kvpool.operatorLabels" -}}
{{ include "kvpool.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The operator pods' selector (immutable once installed: never add to it).
*/}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The leader election Lease's name (in the release namespace), shared by every replica.
*/}}
{{- define "kvpool.leaseName" -}}
{{- default (include "kvpool.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
The operator's image tag; the children's default images follow it.
*/}}
{{- define "kvpool.tag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/*
A child image "repository:tag": (list $image $defaultTag).
*/}}
{{- define "kvpool.childImage" -}}
{{- $image := index . 0 }}
{{- printf "%s:%s" $image.repository (default (index . 1) $image.tag) }}
{{- end }}

{{/*
The rules on the namespaced kinds the operator reads and writes: the same whether granted
cluster-wide (ClusterRole) or in each watched namespace (Role). Each rule says why.
*/}}
{{- define "kvpool.namespacedRules" -}}
# The pools: kopf lists and watches them, and patches its bookkeeping annotations
# (kvpool.io/*) onto them; a sync reads one pool afresh (get).
- apiGroups: ["kvpool.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "patch"]
# The pool's status, written in one place (sync) with a merge patch.
- apiGroups: ["kvpool.io"]
  resources: ["inferencepools/status"]
  verbs: ["patch"]
# Children name their pool as owner with blockOwnerDeletion: where the API server enforces
# OwnerReferencesPermissionEnforcement (OpenShift does), that needs update on the owner's
# finalizers. No request of the operator uses it: the admission check does.
- apiGroups: ["kvpool.io"]
  resources: ["inferencepools/finalizers"]
  verbs: ["update"]
# The children of a pool: kopf watches each kind (a child edited or deleted by hand is
# restored), only those with the operator's managed-by label (a selector the API server
# applies); apply reads, creates and patches (server-side apply); prune lists and deletes;
# the autoscaler patches a Deployment's replicas (no deployments/scale).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Each pool's NetworkPolicies (who may reach its workers and its router): children like
# the others, watched and restored.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The pool secret (the key a pool's router and kvpool workers share): created, once (a 409
# on create means it exists), and deleted by name, with the uid the operator recorded when it
# made it as a precondition, when a pool names a Secret of its own instead. No get, list or
# watch: the operator may read no Secret, the pools' users' included. No patch or update:
# the key never changes. The garbage collector removes it with its pool (its owner).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "delete"]
# Pods: the autoscaler lists a pool's pods to scrape them (list), and each router's Role
# grants pods list and watch, which Kubernetes lets only a holder of both grant.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# kopf posts Events about the pools (warnings and handler errors).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
What kopf itself reads cluster-wide: CustomResourceDefinitions (it notices the InferencePool
CRD being installed or upgraded after the operator started).
*/}}
{{- define "kvpool.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
The label selector of the operator's pods, as k=v,k=v (its settings' pod_selector).
*/}}
{{- define "kvpool.podSelector" -}}
{{- printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s,app.kubernetes.io/component=operator" (include "kvpool.name" .) .Release.Name }}
{{- end }}
