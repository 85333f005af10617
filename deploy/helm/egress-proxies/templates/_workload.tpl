{{/*
egress.workloads: the list of every long-running component as dicts the
Deployment, Service, PDB, HPA, NetworkPolicy and ServiceMonitor templates
range over. Each has: component, provider (provisioners only), type, image,
grpcPort, httpPort, replicas, autoscaling, resources, env, envBlock (extra
env entries as YAML), secret (provisioners only), providers (mounts the
providers config), extraPorts (more named ports: the gateway's proxy
ports), service (type and annotations of its Service), rules (mounts the
gateway's ban rules).
*/}}
{{- define "egress.workloads" -}}
{{- $v := .Values -}}
{{- $authEnv := "" -}}
{{- if $v.auth.disabled -}}
{{- $authEnv = "- name: EGRESS_AUTH_DISABLED\n  value: \"true\"\n" -}}
{{- else -}}
{{- $authEnv = "- name: EGRESS_AUTH_TOKEN_FILE\n  value: /etc/egress/auth/tokens\n" -}}
{{- end -}}
{{- /* Every service with a database: its URL, and --migrate off (the migration hook runs `<service> migrate` first). */ -}}
{{- $db := printf "%s\n- name: EGRESS_MIGRATE\n  value: \"false\"" (include "egress.databaseEnv" .) -}}
{{- $out := list -}}
{{- $orchEnv := printf "%s\n%s- name: EGRESS_PROVIDERS_CONFIG\n  value: /etc/egress/providers.yaml\n" $db $authEnv -}}
{{- /* The keyring: cloudInit.keysSecret, or the one the chart generates (cloud-init-keys.yaml). */ -}}
{{- $orchEnv = printf "%s- name: EGRESS_CLOUD_INIT_KEY_FILE\n  value: /etc/egress/cloud-init/keys.yaml\n" $orchEnv -}}
{{- /* The pool controller reads the providers' health from the health service. */ -}}
{{- $orchEnv = printf "%s- name: EGRESS_HEALTH_ADDR\n  value: \"%s-health:%v\"\n" $orchEnv .Release.Name $v.health.grpcPort -}}
{{- if not $v.auth.disabled -}}
{{- $orchEnv = printf "%s- name: EGRESS_HEALTH_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n" $orchEnv -}}
{{- end -}}
{{- $out = append $out (dict "component" "orchestrator" "image" "orchestrator" "grpcPort" $v.orchestrator.grpcPort "httpPort" $v.orchestrator.httpPort "replicas" $v.orchestrator.replicas "autoscaling" dict "resources" $v.orchestrator.resources "env" $v.orchestrator.env "envBlock" $orchEnv "providers" true "auth" (not $v.auth.disabled) "credentials" (not $v.auth.disabled) "cloudInitKeys" ($v.cloudInit.keysSecret | default (printf "%s-cloud-init-keys" .Release.Name))) -}}
{{- $leaseEnv := printf "%s\n%s- name: EGRESS_ORCHESTRATOR_ADDR\n  value: \"%s-orchestrator:%v\"\n" $db $authEnv .Release.Name $v.orchestrator.grpcPort -}}
{{- if not $v.auth.disabled -}}
{{- $leaseEnv = printf "%s- name: EGRESS_ORCHESTRATOR_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n" $leaseEnv -}}
{{- end -}}
{{- $out = append $out (dict "component" "lease" "image" "lease" "grpcPort" $v.lease.grpcPort "httpPort" $v.lease.httpPort "replicas" $v.lease.replicas "autoscaling" $v.lease.autoscaling "resources" $v.lease.resources "env" $v.lease.env "envBlock" $leaseEnv "providers" false "auth" (not $v.auth.disabled) "credentials" (not $v.auth.disabled)) -}}
{{- $healthEnv := printf "%s\n%s- name: EGRESS_PROVIDERS_CONFIG\n  value: /etc/egress/providers.yaml\n- name: EGRESS_PROBE_TARGET\n  value: %s\n- name: EGRESS_PROVISIONER\n  value: %s\n" $db $authEnv ($v.health.probeTarget | quote) (include "egress.provisionerAddrs" . | quote) -}}
{{- $healthEnv = printf "%s- name: EGRESS_ORCHESTRATOR_ADDR\n  value: \"%s-orchestrator:%v\"\n" $healthEnv .Release.Name $v.orchestrator.grpcPort -}}
{{- if not $v.auth.disabled -}}
{{- $healthEnv = printf "%s- name: EGRESS_ORCHESTRATOR_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n- name: EGRESS_PROVISIONER_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n" $healthEnv -}}
{{- end -}}
{{- $out = append $out (dict "component" "health" "image" "health" "grpcPort" $v.health.grpcPort "httpPort" $v.health.httpPort "replicas" $v.health.replicas "autoscaling" dict "resources" $v.health.resources "env" $v.health.env "envBlock" $healthEnv "providers" true "auth" (not $v.auth.disabled) "credentials" (not $v.auth.disabled)) -}}
{{- if $v.console.enabled -}}
{{- /* The console needs no token of its own: it calls with each user's. */ -}}
{{- $consoleEnv := printf "- name: EGRESS_ORCHESTRATOR_ADDR\n  value: \"%s-orchestrator:%v\"\n- name: EGRESS_LEASE_ADDR\n  value: \"%s-lease:%v\"\n- name: EGRESS_HEALTH_ADDR\n  value: \"%s-health:%v\"\n- name: EGRESS_SESSION_KEY_FILE\n  value: /etc/egress/console/session-keys\n- name: EGRESS_SECURE_COOKIES\n  value: %s\n" .Release.Name $v.orchestrator.grpcPort .Release.Name $v.lease.grpcPort .Release.Name $v.health.grpcPort ($v.console.secureCookies | quote) -}}
{{- $gwMetrics := $v.console.gatewayMetricsURL -}}
{{- if and (not $gwMetrics) $v.gateway.enabled -}}
{{- $gwMetrics = printf "http://%s-gateway:%v/metrics" .Release.Name $v.gateway.httpPort -}}
{{- end -}}
{{- with $gwMetrics -}}
{{- $consoleEnv = printf "%s- name: EGRESS_GATEWAY_METRICS_URL\n  value: %s\n" $consoleEnv (. | quote) -}}
{{- end -}}
{{- $out = append $out (dict "component" "console" "image" "console" "grpcPort" $v.console.grpcPort "httpPort" $v.console.httpPort "replicas" $v.console.replicas "autoscaling" dict "resources" $v.console.resources "env" $v.console.env "envBlock" $consoleEnv "providers" false "auth" false "credentials" false "sessionKeys" ($v.console.sessionKeySecret | default (printf "%s-console-session" .Release.Name))) -}}
{{- end -}}
{{- if $v.gateway.enabled -}}
{{- /* The gateway leases proxies with the service token; crawlers present their own tokens (role crawler) from the token file. */ -}}
{{- $gwEnv := printf "%s- name: EGRESS_LEASE_ADDR\n  value: \"%s-lease:%v\"\n- name: EGRESS_PROXY_LISTEN\n  value: \":%v\"\n- name: EGRESS_SOCKS_LISTEN\n  value: \":%v\"\n" $authEnv .Release.Name $v.lease.grpcPort $v.gateway.proxyPort $v.gateway.socksPort -}}
{{- if not $v.auth.disabled -}}
{{- $gwEnv = printf "%s- name: EGRESS_LEASE_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n" $gwEnv -}}
{{- end -}}
{{- if $v.gateway.rules -}}
{{- $gwEnv = printf "%s- name: EGRESS_RULES_FILE\n  value: /etc/egress/gateway/rules.yaml\n" $gwEnv -}}
{{- end -}}
{{- $gwPorts := list (dict "name" "proxy" "port" $v.gateway.proxyPort) (dict "name" "socks" "port" $v.gateway.socksPort) -}}
{{- $out = append $out (dict "component" "gateway" "image" "gateway" "grpcPort" $v.gateway.grpcPort "httpPort" $v.gateway.httpPort "replicas" $v.gateway.replicas "autoscaling" $v.gateway.autoscaling "resources" $v.gateway.resources "env" $v.gateway.env "envBlock" $gwEnv "providers" false "auth" (not $v.auth.disabled) "credentials" (not $v.auth.disabled) "extraPorts" $gwPorts "service" $v.gateway.service "rules" (not (empty $v.gateway.rules))) -}}
{{- end -}}
{{- range $v.provisioners -}}
{{- $env := printf "%s- name: EGRESS_PROVIDERS_CONFIG\n  value: /etc/egress/providers.yaml\n- name: EGRESS_PROVIDER\n  value: %s\n" $authEnv (.name | quote) -}}
{{- /* Create fetches each proxy's credentials from the orchestrator with the service token. */ -}}
{{- $env = printf "%s- name: EGRESS_ORCHESTRATOR_ADDR\n  value: \"%s-orchestrator:%v\"\n" $env $.Release.Name $v.orchestrator.grpcPort -}}
{{- if not $v.auth.disabled -}}
{{- $env = printf "%s- name: EGRESS_ORCHESTRATOR_TOKEN_FILE\n  value: /etc/egress/credentials/service-token\n" $env -}}
{{- end -}}
{{- if and (eq .type "gcp") .existingSecret -}}
{{- $env = printf "%s- name: GOOGLE_APPLICATION_CREDENTIALS\n  value: /etc/egress/secrets/%s/credentials.json\n" $env .name -}}
{{- end -}}
{{- $out = append $out (dict "component" (include "egress.provisionerComponent" .) "provider" .name "type" .type "image" (printf "provisioner-%s" .type) "grpcPort" $v.provisionerPorts.grpc "httpPort" $v.provisionerPorts.http "replicas" (.replicas | default 1) "autoscaling" (.autoscaling | default dict) "resources" (.resources | default dict) "env" (.env | default dict) "envBlock" $env "providers" true "auth" (not $v.auth.disabled) "credentials" (not $v.auth.disabled) "secret" (.existingSecret | default "")) -}}
{{- end -}}
{{- toJson (dict "items" $out) -}}
{{- end -}}
