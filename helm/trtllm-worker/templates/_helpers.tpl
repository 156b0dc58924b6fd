{{/* Names, labels, the image, the Secret and the checks every template relies on. */}}

{{- define "trtllm-worker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trtllm-worker.fullname" -}}
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

{{- define "trtllm-worker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trtllm-worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trtllm-worker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trtllm-worker.labels" -}}
helm.sh/chart: {{ include "trtllm-worker.chart" . }}
{{ include "trtllm-worker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: worker
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "trtllm-worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trtllm-worker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* registry/repository:tag, or @digest when a digest is given */}}
{{- define "trtllm-worker.image" -}}
{{- include "trtllm-worker.imageReference" (dict "image" .Values.image "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/* The same from a dict: image (registry, repository, tag, digest) and appVersion */}}
{{- define "trtllm-worker.imageReference" -}}
{{- $image := .image }}
{{- $repository := $image.repository }}
{{- if $image.registry }}
{{- $repository = printf "%s/%s" $image.registry $image.repository }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .appVersion $image.tag | toString) }}
{{- end }}
{{- end }}

{{/*
A setting as the worker reads it: Helm parses the numbers of values files as floats, which
print as 1e+06; whole numbers are printed as integers, and an empty value stays empty
(the worker takes it as unset).
*/}}
{{- define "trtllm-worker.settingValue" -}}
{{- $value := . }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- int64 $value }}
{{- else }}
{{- $value }}
{{- end }}
{{- end }}

{{/* An emptyDir's body: {} or {sizeLimit: ...} */}}
{{- define "trtllm-worker.sizeLimit" -}}
{{- if . }}
{{- dict "sizeLimit" . | toJson }}
{{- else }}
{{- "{}" }}
{{- end }}
{{- end }}

{{/* The Secret that holds the URLs: the existing one, or the chart's (checked here). */}}
{{- define "trtllm-worker.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- $_ := required "secrets: set secrets.existingSecret (recommended: a Secret holding the keys secrets.amqpUrlKey and secrets.redisUrlKey), or secrets.amqpUrl and secrets.redisUrl for a Secret made by the chart; the chart ships no credentials" (and .Values.secrets.amqpUrl .Values.secrets.redisUrl) }}
{{- include "trtllm-worker.fullname" . }}
{{- end }}
{{- end }}

{{- define "trtllm-worker.httpPort" -}}
{{- $port := include "trtllm-worker.settingValue" .Values.config.WORKER_HTTP_PORT | int }}
{{- if or (lt $port 1) (gt $port 65535) }}
{{- fail (printf "config.WORKER_HTTP_PORT must be a fixed port in 1..65535 (the probes use it), not %v" .Values.config.WORKER_HTTP_PORT) }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
The egress rules of a NetworkPolicy: DNS, the broker, Redis, the OTLP collector (when
"otlp" is true) and then "extraEgress". Takes dict "policy" (.Values.networkPolicy), "otlp"
and "extraEgress".
*/}}
{{- define "trtllm-worker.egressRules" -}}
{{- with .policy }}
- ports:
    {{- range .dns.ports }}
    - port: {{ . }}
      protocol: UDP
    - port: {{ . }}
      protocol: TCP
    {{- end }}
  {{- with .dns.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- $destinations := list .broker .redis }}
{{- if $.otlp }}
{{- $destinations = append $destinations .otlp }}
{{- end }}
{{- range $destinations }}
- ports:
    {{- range .ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
  {{- with .to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
{{- with .extraEgress }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The worker's config checksum: every setting but the gateway's (WORKER_GATEWAY_*), which
the workers never read, so that tuning the gateway restarts no GPU worker.
*/}}
{{- define "trtllm-worker.workerConfigChecksum" -}}
{{- $config := .Values.config }}
{{- range $key, $_ := .Values.config }}
{{- if hasPrefix "WORKER_GATEWAY_" $key }}
{{- $config = omit $config $key }}
{{- end }}
{{- end }}
{{- $config | toJson | sha256sum }}
{{- end }}

{{/* The gateway: its objects' name, labels and image. */}}
{{- define "trtllm-worker.gateway.fullname" -}}
{{- printf "%s-gateway" (include "trtllm-worker.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
A name of its own (<chart>-gateway), so that none of the worker's selectors (Deployment,
Service, PodDisruptionBudget, NetworkPolicy, ServiceMonitor: name and instance only)
selects the gateway's pods.
*/}}
{{- define "trtllm-worker.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-gateway" (include "trtllm-worker.name" . | trunc 55 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trtllm-worker.gateway.labels" -}}
helm.sh/chart: {{ include "trtllm-worker.chart" . }}
{{ include "trtllm-worker.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: gateway
app.kubernetes.io/part-of: {{ include "trtllm-worker.name" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The worker's image, or gateway.image when it names one (e.g. the slim cpu image) */}}
{{- define "trtllm-worker.gateway.image" -}}
{{- $own := .Values.gateway.image }}
{{- if or $own.repository $own.tag $own.digest }}
{{- $image := dict "registry" (default .Values.image.registry $own.registry) "repository" (default .Values.image.repository $own.repository) "tag" $own.tag "digest" $own.digest }}
{{- include "trtllm-worker.imageReference" (dict "image" $image "appVersion" .Chart.AppVersion) }}
{{- else }}
{{- include "trtllm-worker.image" . }}
{{- end }}
{{- end }}

{{- define "trtllm-worker.gatewayPort" -}}
{{- $port := include "trtllm-worker.settingValue" .Values.config.WORKER_GATEWAY_PORT | int }}
{{- if or (lt $port 1) (gt $port 65535) }}
{{- fail (printf "config.WORKER_GATEWAY_PORT must be a fixed port in 1..65535 (the probes and the Service use it), not %v" .Values.config.WORKER_GATEWAY_PORT) }}
{{- end }}
{{- $port }}
{{- end }}

{{/* WORKER_GATEWAY_KEYS_FILE: the key of gateway.apiKeys.existingSecret in its mounted folder */}}
{{- define "trtllm-worker.gateway.keysFile" -}}
{{- with .Values.gateway.apiKeys }}
{{- printf "%s/%s" (trimSuffix "/" .mountPath) .key }}
{{- end }}
{{- end }}

{{/* The gateway's settings that cannot work, caught at render time. */}}
{{- define "trtllm-worker.gateway.validate" -}}
{{- $gateway := .Values.gateway }}
{{- $_ := include "trtllm-worker.gatewayPort" . }}
{{- if and $gateway.apiKeys.existingSecret .Values.config.WORKER_GATEWAY_KEYS_FILE }}
{{- fail "gateway: give gateway.apiKeys.existingSecret (the chart mounts it and sets WORKER_GATEWAY_KEYS_FILE) or config.WORKER_GATEWAY_KEYS_FILE (a file you mount with gateway.extraVolumes), not both" }}
{{- end }}
{{- if and (ne (toString $gateway.pdb.minAvailable) "") (ne (toString $gateway.pdb.maxUnavailable) "") }}
{{- fail "gateway.pdb: give gateway.pdb.minAvailable or gateway.pdb.maxUnavailable, not both" }}
{{- end }}
{{- with $gateway.autoscaling }}
{{- if .enabled }}
{{- if gt (int64 .minReplicas) (int64 .maxReplicas) }}
{{- fail (printf "gateway.autoscaling.minReplicas (%v) exceeds gateway.autoscaling.maxReplicas (%v)" .minReplicas .maxReplicas) }}
{{- end }}
{{- if not (index ($gateway.resources.requests | default dict) "cpu") }}
{{- fail "gateway.autoscaling scales on CPU utilization, a share of the CPU request: set gateway.resources.requests.cpu" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $gateway.mountModel (not (or .Values.model.existingClaim .Values.model.hostPath)) }}
{{- fail "gateway.mountModel needs the model volume: model.existingClaim or model.hostPath" }}
{{- end }}
{{- end }}

{{/* The grace period: the drain timeout, rounded up, plus the time to hand jobs back. */}}
{{- define "trtllm-worker.terminationGracePeriodSeconds" -}}
{{- $drain := .Values.config.WORKER_DRAIN_TIMEOUT_S | float64 | ceil | int64 }}
{{- add $drain (int64 .Values.terminationGraceExtraSeconds) }}
{{- end }}

{{/* failureThreshold of the startupProbe: given, or enough to load the engine. */}}
{{- define "trtllm-worker.startupFailureThreshold" -}}
{{- $probe := .Values.startupProbe }}
{{- if $probe.failureThreshold }}
{{- int64 $probe.failureThreshold }}
{{- else }}
{{- $budget := add (.Values.config.WORKER_ENGINE_START_TIMEOUT_S | float64 | ceil | int64) 60 }}
{{- div (add $budget (sub (int64 $probe.periodSeconds) 1)) (int64 $probe.periodSeconds) }}
{{- end }}
{{- end }}

{{/* Settings that cannot work, caught at render time rather than at the pod's start. */}}
{{- define "trtllm-worker.validate" -}}
{{- $config := .Values.config }}
{{- range $key := list "WORKER_AMQP_URL" "WORKER_REDIS_URL" }}
{{- if hasKey $config $key }}
{{- fail (printf "config.%s: the URLs hold credentials and come from the Secret (secrets.existingSecret or secrets.amqpUrl/redisUrl), never from the ConfigMap" $key) }}
{{- end }}
{{- end }}
{{- if and (eq $config.WORKER_ENGINE "trtllm") (not $config.WORKER_MODEL) }}
{{- fail "config.WORKER_MODEL is required with WORKER_ENGINE=trtllm (a Hugging Face checkpoint folder, e.g. on the model volume at model.mountPath)" }}
{{- end }}
{{- if eq $config.WORKER_ENGINE "trtllm-executor" }}
{{- if not $config.WORKER_ENGINE_DIR }}
{{- fail "config.WORKER_ENGINE_DIR is required with WORKER_ENGINE=trtllm-executor (a prebuilt engine folder)" }}
{{- end }}
{{- if not $config.WORKER_TOKENIZER }}
{{- fail "config.WORKER_TOKENIZER is required with WORKER_ENGINE=trtllm-executor (the model's tokenizer.json or its folder)" }}
{{- end }}
{{- end }}
{{- $gpus := index (.Values.resources.limits | default dict) "nvidia.com/gpu" }}
{{- if and (eq $config.WORKER_ENGINE "trtllm") $gpus }}
{{- if gt (int64 $config.WORKER_TENSOR_PARALLEL_SIZE) (int64 $gpus) }}
{{- fail (printf "config.WORKER_TENSOR_PARALLEL_SIZE (%v) needs as many GPUs: raise resources.limits.nvidia.com/gpu (%v)" $config.WORKER_TENSOR_PARALLEL_SIZE $gpus) }}
{{- end }}
{{- end }}
{{- if and .Values.model.existingClaim .Values.model.hostPath }}
{{- fail "model: give model.existingClaim or model.hostPath, not both" }}
{{- end }}
{{- if and (ne (toString .Values.pdb.minAvailable) "") (ne (toString .Values.pdb.maxUnavailable) "") }}
{{- fail "pdb: give pdb.minAvailable or pdb.maxUnavailable, not both" }}
{{- end }}
{{- end }}
