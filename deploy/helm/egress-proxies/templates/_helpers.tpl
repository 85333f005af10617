{{- define "egress.fullname" -}}
{{- printf "%s-%s" .Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "egress.labels" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: egress-proxies
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "egress.selector" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "egress.image" -}}
{{ .Values.image.registry }}/{{ .component }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The database URL as an env entry. */}}
{{- define "egress.databaseEnv" -}}
- name: EGRESS_DATABASE_URL
  {{- if .Values.database.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.existingSecret }}
      key: {{ .Values.database.existingSecretKey }}
  {{- else }}
  value: {{ required "database.url or database.existingSecret is required" .Values.database.url | quote }}
  {{- end }}
{{- end -}}

{{- define "egress.authEnv" -}}
{{- if .Values.auth.disabled }}
- name: EGRESS_AUTH_DISABLED
  value: "true"
{{- else }}
- name: EGRESS_AUTH_TOKEN_FILE
  value: /etc/egress/auth/tokens
{{- end }}
{{- end -}}

{{/* provider=host:port for every enabled provisioner, for health's checks. */}}
{{- define "egress.provisionerAddrs" -}}
{{- $out := list }}
{{- range $name, $c := .Values.components }}
{{- if and $c.enabled (hasPrefix "provisioner-" $name) $c.provider }}
{{- $out = append $out (printf "%s=%s-%s:%v" $c.provider $.Release.Name $name $c.grpcPort) }}
{{- end }}
{{- end }}
{{- join "," $out }}
{{- end -}}
