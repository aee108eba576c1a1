{{/* Names, labels and the pod parts every kvindex component shares. */}}

{{- define "kvindex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvindex.fullname" -}}
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

{{/* The name of one component's resources: "<fullname>-<component>". */}}
{{- define "kvindex.componentName" -}}
{{- printf "%s-%s" (include "kvindex.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvindex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvindex
{{ include "kvindex.selectorLabels" . }}
{{- end }}

{{- define "kvindex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvindex.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvindex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvindex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvindex.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvindex.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace }}
{{- end }}

{{/* True (non-empty) when replicas come from the Kubernetes API. */}}
{{- define "kvindex.discovers" -}}
{{- if or .Values.discovery.pool .Values.discovery.selector }}true{{ end }}
{{- end }}

{{/* Discovery's options (none without discovery). */}}
{{- define "kvindex.discoveryArgs" -}}
{{- $d := .Values.discovery }}
{{- if $d.pool }}
- --k8s-pool
- {{ $d.pool | quote }}
{{- else if $d.selector }}
- --k8s-selector
- {{ $d.selector | quote }}
{{- range $d.ports }}
- --k8s-port
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if include "kvindex.discovers" . }}
- --k8s-namespace
- {{ include "kvindex.discoveryNamespace" . | quote }}
{{- with $d.model }}
- --k8s-model
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The indexers' replicas: discovery, else the static list. The indexers write them to the
fleet in Redis, which the API, the picker and the proxy read. */}}
{{- define "kvindex.replicaArgs" -}}
{{- if include "kvindex.discovers" . }}
{{- include "kvindex.discoveryArgs" . }}
{{- else if .Values.replicas }}
{{- range .Values.replicas }}
- --replica
- {{ . | quote }}
{{- end }}
{{- else }}
{{- fail "kvindex: set discovery.pool, discovery.selector or replicas (where the replicas come from)" }}
{{- end }}
{{- end }}

{{- define "kvindex.configArgs" -}}
{{- if .Values.config }}
- --config
- /etc/kvindex/kvindex.toml
{{- end }}
{{- end }}

{{- define "kvindex.redisPasswordSecret" -}}
{{- default (printf "%s-redis" (include "kvindex.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* KVINDEX_REDIS_URL (and what it is made of): never a password in plain values. */}}
{{- define "kvindex.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if $r.enabled }}
{{- $host := printf "%s-redis:%d/%d" (include "kvindex.fullname" .) (int $r.port) (int $r.db) }}
{{- if $r.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvindex.redisPasswordSecret" . }}
      key: {{ $r.auth.existingSecretKey }}
- name: KVINDEX_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s" $host | quote }}
{{- else }}
- name: KVINDEX_REDIS_URL
  value: {{ printf "redis://%s" $host | quote }}
{{- end }}
{{- else if $r.existingUrlSecret }}
- name: KVINDEX_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.existingUrlSecret }}
      key: {{ $r.existingUrlSecretKey }}
{{- else if $r.externalUrl }}
- name: KVINDEX_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-redis-url" (include "kvindex.fullname" .) }}
      key: url
{{- else }}
{{- fail "kvindex: with redis.enabled=false, set redis.externalUrl or redis.existingUrlSecret" }}
{{- end }}
{{- end }}

{{/* Volumes of every kvindex pod: a writable /tmp and the settings file. */}}
{{- define "kvindex.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if .Values.config }}
- name: config
  configMap:
    name: {{ include "kvindex.fullname" . }}
{{- end }}
{{- end }}

{{- define "kvindex.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.config }}
- name: config
  mountPath: /etc/kvindex
  readOnly: true
{{- end }}
{{- end }}

{{/* The hub cache of the read path's pods (api, picker, proxy): its volume, its read-only
mount and the setting naming it; each empty without hubCache.existingClaim or .hostPath. */}}
{{- define "kvindex.hubCacheVolume" -}}
{{- $h := .Values.hubCache }}
{{- if and $h.existingClaim $h.hostPath }}
{{- fail "kvindex: set one of hubCache.existingClaim and hubCache.hostPath" }}
{{- else if $h.existingClaim }}
- name: hf-hub
  persistentVolumeClaim:
    claimName: {{ $h.existingClaim }}
    readOnly: true
{{- else if $h.hostPath }}
- name: hf-hub
  hostPath:
    path: {{ $h.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{- define "kvindex.hubCacheMount" -}}
{{- if or .Values.hubCache.existingClaim .Values.hubCache.hostPath }}
- name: hf-hub
  mountPath: /hf-hub
  readOnly: true
  {{- with .Values.hubCache.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "kvindex.hubCacheEnv" -}}
{{- if or .Values.hubCache.existingClaim .Values.hubCache.hostPath }}
- name: KVINDEX_API_HF_HUB_CACHE
  value: /hf-hub
{{- end }}
{{- end }}

{{/* The pod-level fields one component's values give (.values: that component's). */}}
{{- define "kvindex.podScheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Restarts pods when the settings file changes. */}}
{{- define "kvindex.podAnnotations" -}}
{{- if .root.Values.config }}
checksum/config: {{ .root.Values.config | sha256sum }}
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}
