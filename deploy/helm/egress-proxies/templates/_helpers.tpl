{{/*
Component context: every per-component template is called with
(dict "root" $ "component" NAME "provider" PROVIDER-OR-EMPTY).
*/}}

{{- define "egress.fullname" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "egress.selector" -}}
app.kubernetes.io/name: egress-proxies
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "egress.labels" -}}
{{ include "egress.selector" . }}
app.kubernetes.io/part-of: egress-proxies
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- if .provider }}
egress-proxies.io/provider: {{ .provider }}
{{- end }}
{{- end -}}

{{- define "egress.image" -}}
{{- printf "%s/%s:%s" .root.Values.image.repository .image (.root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "egress.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (printf "%s-egress-proxies" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "egress.databaseEnv" -}}
- name: EGRESS_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.existingSecret }}
      key: {{ .Values.database.existingSecretKey }}
{{- end -}}

{{/* Deployment name suffix of a provisioner entry. */}}
{{- define "egress.provisionerComponent" -}}
{{- printf "provisioner-%s" .name -}}
{{- end -}}

{{/* provider=host:port of every provisioner, for health's backend checks. */}}
{{- define "egress.provisionerAddrs" -}}
{{- $out := list }}
{{- range .Values.provisioners }}
{{- $out = append $out (printf "%s=%s-provisioner-%s:%v" .name $.Release.Name .name $.Values.provisionerPorts.grpc) }}
{{- end }}
{{- join "," $out }}
{{- end -}}

{{/* The pod-level settings every workload shares. A kubernetes
provisioner runs as its own ServiceAccount, the one its Role is bound to,
with the token mounted; nothing else talks to the API server. */}}
{{- define "egress.podCommon" -}}
{{- if .kubeAccount }}
serviceAccountName: {{ include "egress.fullname" . }}
automountServiceAccountToken: true
{{- else }}
serviceAccountName: {{ include "egress.serviceAccountName" .root }}
automountServiceAccountToken: false
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The settings every container shares. */}}
{{- define "egress.containerCommon" -}}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml .root.Values.securityContext | nindent 2 }}
{{- end -}}

{{/* The /tmp volume every pod mounts. */}}
{{- define "egress.tmpVolume" -}}
- name: tmp
  emptyDir:
    {{- with .root.Values.tmpVolume.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end -}}

{{/* egressctl's settings for the helm test pod. */}}
{{- define "egress.testEnv" -}}
- name: EGRESS_ORCHESTRATOR_ADDR
  value: "{{ .Release.Name }}-orchestrator:{{ .Values.orchestrator.grpcPort }}"
- name: EGRESS_LEASE_ADDR
  value: "{{ .Release.Name }}-lease:{{ .Values.lease.grpcPort }}"
- name: EGRESS_HEALTH_ADDR
  value: "{{ .Release.Name }}-health:{{ .Values.health.grpcPort }}"
{{- if not .Values.auth.disabled }}
- name: EGRESS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.serviceCredentials.existingSecret }}
      key: {{ .Values.serviceCredentials.viewerTokenKey }}
{{- end }}
{{- end -}}

{{/* The namespace a kubernetes provider's proxies run in (its
kubernetes.namespace in providers). */}}
{{- define "egress.proxiesNamespace" -}}
{{- $ns := "" -}}
{{- range .root.Values.providers -}}
{{- if eq .name $.name -}}
{{- $ns = dig "kubernetes" "namespace" "" . -}}
{{- end -}}
{{- end -}}
{{- $ns -}}
{{- end -}}
