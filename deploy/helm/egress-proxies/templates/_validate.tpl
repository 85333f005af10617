{{/*
egress.validate: the rules a JSON schema cannot state, each failing with the
value's path. Included once, from the providers ConfigMap.
*/}}
{{- define "egress.validate" -}}
{{- $types := dict -}}
{{- range $i, $p := .Values.providers -}}
{{- if hasKey $types $p.name -}}
{{- fail (printf "providers[%d].name: %q is used twice" $i $p.name) -}}
{{- end -}}
{{- $_ := set $types $p.name $p.type -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $i, $e := .Values.provisioners -}}
{{- if hasKey $seen $e.name -}}
{{- fail (printf "provisioners[%d].name: %q already has provisioners (one entry per provider)" $i $e.name) -}}
{{- end -}}
{{- $_ := set $seen $e.name true -}}
{{- if not (hasKey $types $e.name) -}}
{{- fail (printf "provisioners[%d].name: %q is not a provider in providers (it has %s)" $i $e.name (keys $types | sortAlpha | join ", " | default "none")) -}}
{{- end -}}
{{- if ne (get $types $e.name) $e.type -}}
{{- fail (printf "provisioners[%d].type: %q, but provider %q is of type %q" $i $e.type $e.name (get $types $e.name)) -}}
{{- end -}}
{{- if eq $e.type "kubernetes" -}}
{{- if not (include "egress.proxiesNamespace" (dict "root" $ "name" $e.name)) -}}
{{- fail (printf "providers: the kubernetes provider %q needs kubernetes.namespace: the namespace its proxies run in, where the chart grants its Role" $e.name) -}}
{{- end -}}
{{- end -}}
{{- with $e.autoscaling -}}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) -}}
{{- fail (printf "provisioners[%d].autoscaling: minReplicas %v is above maxReplicas %v" $i .minReplicas .maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.gateway.enabled -}}
{{- with .Values.gateway -}}
{{- $ports := dict -}}
{{- range $k := list "grpcPort" "httpPort" "proxyPort" "socksPort" -}}
{{- $p := toString (get $.Values.gateway $k) -}}
{{- if hasKey $ports $p -}}
{{- fail (printf "gateway.%s: port %s is already gateway.%s (each of the gateway's listeners needs its own)" $k $p (get $ports $p)) -}}
{{- end -}}
{{- $_ := set $ports $p $k -}}
{{- end -}}
{{- if and .autoscaling.enabled (gt (int .autoscaling.minReplicas) (int .autoscaling.maxReplicas)) -}}
{{- fail (printf "gateway.autoscaling: minReplicas %v is above maxReplicas %v" .autoscaling.minReplicas .autoscaling.maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with .Values.lease.autoscaling -}}
{{- if and .enabled (gt (int .minReplicas) (int .maxReplicas)) -}}
{{- fail (printf "lease.autoscaling: minReplicas %v is above maxReplicas %v" .minReplicas .maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
