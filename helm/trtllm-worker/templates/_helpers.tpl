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
{{- $image := .Values.image }}
{{- $repository := $image.repository }}
{{- if $image.registry }}
{{- $repository = printf "%s/%s" $image.registry $image.repository }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion $image.tag | toString) }}
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
