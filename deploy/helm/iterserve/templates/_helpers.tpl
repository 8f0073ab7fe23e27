{{/*
Chart name, overridable with nameOverride.
*/}}
{{- define "iterserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. KubeRay refuses RayService names longer than 47
characters (it appends suffixes for the cluster and its Services) and names
that are not DNS-1035 labels, so the name is cut to 47 and checked.
*/}}
{{- define "iterserve.fullname" -}}
{{- $name := "" }}
{{- if .Values.fullnameOverride }}
{{- $name = .Values.fullnameOverride }}
{{- else }}
{{- $chart := default .Chart.Name .Values.nameOverride }}
{{- if contains $chart .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name $chart }}
{{- end }}
{{- end }}
{{- $name = $name | trunc 47 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "resource name %q is not a DNS-1035 label (lower-case letters, digits and '-', starting with a letter): choose another release name or set fullnameOverride" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "iterserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object of the release.
*/}}
{{- define "iterserve.labels" -}}
helm.sh/chart: {{ include "iterserve.chart" . }}
{{ include "iterserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels that identify the pods of this release (Services, NetworkPolicy).
*/}}
{{- define "iterserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "iterserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Name of the Secret holding the API key, and whether the chart creates it.
*/}}
{{- define "iterserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "iterserve.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema cannot express. Stops rendering with a
message naming the values to change.
*/}}
{{- define "iterserve.validate" -}}
{{- $m := .Values.model }}
{{- $sources := list }}
{{- if $m.pvc.claimName }}{{ $sources = append $sources "model.pvc.claimName" }}{{ end }}
{{- if $m.copy.url }}{{ $sources = append $sources "model.copy.url" }}{{ end }}
{{- if $m.copy.volume }}{{ $sources = append $sources "model.copy.volume" }}{{ end }}
{{- if eq (len $sources) 0 }}
{{- fail "no model source: set exactly one of model.pvc.claimName (an existing PersistentVolumeClaim), model.copy.url (s3://, gs:// or https://) or model.copy.volume (a pod volume source)" }}
{{- end }}
{{- if gt (len $sources) 1 }}
{{- fail (printf "more than one model source (%s): set exactly one of model.pvc.claimName, model.copy.url or model.copy.volume" (join ", " $sources)) }}
{{- end }}
{{- $tp := int .Values.engine.tensorParallelSize }}
{{- $gpus := int .Values.worker.gpus }}
{{- if gt $tp $gpus }}
{{- fail (printf "engine.tensorParallelSize (%d) is larger than worker.gpus (%d): the ranks of one engine copy must fit on one worker pod; raise worker.gpus or lower engine.tensorParallelSize" $tp $gpus) }}
{{- end }}
{{- if ne (mod $gpus $tp) 0 }}
{{- fail (printf "engine.tensorParallelSize (%d) does not divide worker.gpus (%d): every worker pod must hold a whole number of engine copies; use a worker.gpus that is a multiple of engine.tensorParallelSize" $tp $gpus) }}
{{- end }}
{{- $w := .Values.worker }}
{{- if gt (int $w.minReplicas) (int $w.maxReplicas) }}
{{- fail (printf "worker.minReplicas (%d) is larger than worker.maxReplicas (%d)" (int $w.minReplicas) (int $w.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $w.replicas) (int $w.minReplicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "worker.replicas (%d) must lie between worker.minReplicas (%d) and worker.maxReplicas (%d)" (int $w.replicas) (int $w.minReplicas) (int $w.maxReplicas)) }}
{{- end }}
{{- $pods := ternary (int $w.maxReplicas) (int $w.replicas) .Values.autoscaling.enabled }}
{{- $ea := .Values.serve.engineAutoscaling }}
{{- if and $ea.enabled (gt (int $ea.minReplicas) (int $ea.maxReplicas)) }}
{{- fail (printf "serve.engineAutoscaling.minReplicas (%d) is larger than serve.engineAutoscaling.maxReplicas (%d)" (int $ea.minReplicas) (int $ea.maxReplicas)) }}
{{- end }}
{{- if and (eq .Values.upgrade.strategy "NewClusterWithIncrementalUpgrade") (not .Values.upgrade.gatewayClassName) }}
{{- fail "upgrade.strategy NewClusterWithIncrementalUpgrade needs upgrade.gatewayClassName (a GatewayClass of the cluster's Gateway API)" }}
{{- end }}
{{- $copies := ternary (int $ea.maxReplicas) (int .Values.serve.numEngineReplicas) $ea.enabled }}
{{- $capacity := mul $pods (div $gpus $tp) }}
{{- if gt $copies $capacity }}
{{- fail (printf "%s (%d) is not satisfiable: %d engine copies of engine.tensorParallelSize %d need %d GPUs, but %d worker pod(s) with %d GPU(s) each hold at most %d; raise worker.%s or worker.gpus, or lower it" (ternary "serve.engineAutoscaling.maxReplicas" "serve.numEngineReplicas" $ea.enabled) $copies $copies $tp (mul $copies $tp) $pods $gpus $capacity (ternary "maxReplicas" "replicas" .Values.autoscaling.enabled)) }}
{{- end }}
{{- $e := .Values.engine }}
{{- if and (gt (int $e.maxNumBatchedTokens) 0) (lt (int $e.maxNumBatchedTokens) (int $e.maxNumSeqs)) }}
{{- fail (printf "engine.maxNumBatchedTokens (%d) must be >= engine.maxNumSeqs (%d) so that every running sequence can decode each step" (int $e.maxNumBatchedTokens) (int $e.maxNumSeqs)) }}
{{- end }}
{{- if and (ne $e.policy "chunked") (gt (int $e.maxModelLen) 0) (gt (int $e.maxNumBatchedTokens) 0) (lt (int $e.maxNumBatchedTokens) (int $e.maxModelLen)) }}
{{- fail (printf "policy %s prefills whole prompts: engine.maxNumBatchedTokens (%d) must be >= engine.maxModelLen (%d)" $e.policy (int $e.maxNumBatchedTokens) (int $e.maxModelLen)) }}
{{- end }}
{{- if and (eq $e.schedulingPolicy "fair") (has $e.policy (list "static" "dynamic")) }}
{{- fail (printf "engine.schedulingPolicy fair shares each step among tenants; engine.policy %s admits a whole batch at once: use continuous or chunked" $e.policy) }}
{{- end }}
{{- if and (ne $e.schedulingPolicy "fair") (or .Values.tenants (gt (int $e.maxQueueLenPerTenant) 0)) }}
{{- fail "tenants and engine.maxQueueLenPerTenant apply to engine.schedulingPolicy fair only" }}
{{- end }}
{{- if .Values.apiKey.enabled }}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "apiKey: set either apiKey.existingSecret or apiKey.value, not both" }}
{{- end }}
{{- if not (or .Values.apiKey.existingSecret .Values.apiKey.value) }}
{{- fail "apiKey.enabled is true but no key is given: set apiKey.existingSecret (and apiKey.secretKey) or apiKey.value" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The model's path inside the Ray containers: the argument `model` of the
application.
*/}}
{{- define "iterserve.modelPath" -}}
{{- $m := .Values.model }}
{{- $root := trimSuffix "/" $m.mountPath }}
{{- if and $m.pvc.claimName (trimAll "/" $m.pvc.path) }}
{{- printf "%s/%s" $root (trimAll "/" $m.pvc.path) }}
{{- else }}
{{- default "/" $root }}
{{- end }}
{{- end }}

{{/*
The Serve config (serveConfigV2) as YAML.
*/}}
{{- define "iterserve.serveConfig" -}}
{{- $e := .Values.engine }}
{{- /* engine config: generated from EngineConfig by iterserve.cluster.config_docs */}}
{{- $config := dict
  "dtype" $e.dtype
  "seed" (int $e.seed)
  "tensor_parallel_size" (int $e.tensorParallelSize)
  "batch_invariant" $e.batchInvariant
  "runner" $e.runner
  "pooling_type" $e.poolingType
  "pooling_normalize" $e.poolingNormalize
  "policy" $e.policy
  "max_num_seqs" (int $e.maxNumSeqs)
  "block_size" (int $e.blockSize)
  "enable_prefix_caching" $e.enablePrefixCaching
  "max_queue_len" (int $e.maxQueueLen)
  "scheduling_policy" $e.schedulingPolicy
  "max_num_partial_prefills" (int $e.maxNumPartialPrefills)
  "long_prefill_token_threshold" (int $e.longPrefillTokenThreshold)
  "batch_timeout_s" (float64 $e.batchTimeoutS)
  "batch_wait_s" (float64 $e.batchWaitS)
  "max_n" (int $e.maxN)
  "max_logprobs" (int $e.maxLogprobs)
  "max_loras" (int $e.maxLoras)
  "kv_memory_fraction" (float64 $e.kvMemoryFraction)
  "kv_offloading_size" (float64 $e.kvOffloadingSize)
  "kv_disk_cache_size" (float64 $e.kvDiskCacheSize)
  "step_timeout_s" (float64 $e.stepTimeoutS)
  "max_restarts" (int $e.maxRestarts)
  "restart_window_s" (float64 $e.restartWindowS)
  "drain_timeout_s" (float64 $e.drainTimeoutS)
  "placement_strategy" $e.placementStrategy
  "async_scheduling" $e.asyncScheduling
  "enable_lora" $e.enableLora
  "max_lora_rank" (int $e.maxLoraRank)
}}
{{- if $e.quantization }}
{{- $_ := set $config "quantization" $e.quantization }}
{{- end }}
{{- if gt (int $e.maxNumBatchedTokens) 0 }}
{{- $_ := set $config "max_num_batched_tokens" (int $e.maxNumBatchedTokens) }}
{{- end }}
{{- if gt (int $e.maxModelLen) 0 }}
{{- $_ := set $config "max_model_len" (int $e.maxModelLen) }}
{{- end }}
{{- if gt (int $e.numKvBlocks) 0 }}
{{- $_ := set $config "num_kv_blocks" (int $e.numKvBlocks) }}
{{- end }}
{{- if gt (int $e.maxQueueLenPerTenant) 0 }}
{{- $_ := set $config "max_queue_len_per_tenant" (int $e.maxQueueLenPerTenant) }}
{{- end }}
{{- if gt (int $e.maxCpuLoras) 0 }}
{{- $_ := set $config "max_cpu_loras" (int $e.maxCpuLoras) }}
{{- end }}
{{- /* end of the generated engine config */}}
{{- $_ := set $config "device" "cuda" }}
{{- if .Values.lora.modules }}
{{- $modules := dict }}
{{- range $name, $dir := .Values.lora.modules }}
{{- $_ := set $modules $name (printf "%s/%s" (trimSuffix "/" $.Values.lora.mountPath) (trimAll "/" $dir)) }}
{{- end }}
{{- $_ := set $config "lora_modules" $modules }}
{{- $_ := set $config "enable_lora" true }}
{{- end }}
{{- if .Values.speculativeConfig }}
{{- $_ := set $config "speculative_config" .Values.speculativeConfig }}
{{- end }}
{{- if .Values.kvDiskCache.volume }}
{{- $_ := set $config "kv_disk_cache_dir" .Values.kvDiskCache.mountPath }}
{{- end }}
{{- if .Values.kvEventsConfig }}
{{- $_ := set $config "kv_events_config" .Values.kvEventsConfig }}
{{- end }}
{{- if .Values.tenants }}
{{- $_ := set $config "tenants" .Values.tenants }}
{{- end }}
{{- $args := dict
  "model" (include "iterserve.modelPath" .)
  "config" $config
  "num_engine_replicas" (int .Values.serve.numEngineReplicas)
  "max_body_bytes" (int .Values.serve.maxBodyBytes)
}}
{{- if .Values.apiKey.enabled }}
{{- $_ := set $args "api_key_env" .Values.apiKey.envName }}
{{- end }}
{{- $ea := .Values.serve.engineAutoscaling }}
{{- if $ea.enabled }}
{{- $scaling := dict
  "min_replicas" (int $ea.minReplicas)
  "max_replicas" (int $ea.maxReplicas)
  "target_kv_usage" (float64 $ea.targetKvUsage)
  "target_ttft_s" (float64 $ea.targetTtftS)
  "upscale_delay_s" (float64 $ea.upscaleDelayS)
  "downscale_delay_s" (float64 $ea.downscaleDelayS)
}}
{{- if gt (int $ea.targetOngoingRequests) 0 }}
{{- $_ := set $scaling "target_ongoing_requests" (int $ea.targetOngoingRequests) }}
{{- end }}
{{- $_ := set $args "autoscaling" $scaling }}
{{- end }}
{{- $app := dict
  "name" .Values.serve.appName
  "route_prefix" .Values.serve.routePrefix
  "import_path" "iterserve.cluster.serve.app:build_app"
  "args" $args
}}
{{- $serve := dict
  "proxy_location" "EveryNode"
  "http_options" (dict "host" "0.0.0.0" "port" 8000)
  "applications" (list $app)
}}
{{- toYaml $serve }}
{{- end }}

{{/*
Volumes and mounts that carry the model into a Ray pod.
*/}}
{{- define "iterserve.modelVolumes" -}}
{{- $m := .Values.model }}
{{- if $m.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else }}
- name: model
  {{- if $m.copy.sizeLimit }}
  emptyDir:
    sizeLimit: {{ $m.copy.sizeLimit | quote }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- if $m.copy.volume }}
- name: model-source
  {{- toYaml $m.copy.volume | nindent 2 }}
{{- end }}
{{- end }}
{{- if .Values.lora.volume }}
- name: lora-adapters
  {{- toYaml .Values.lora.volume | nindent 2 }}
{{- end }}
{{- if .Values.kvDiskCache.volume }}
- name: kv-disk-cache
  {{- toYaml .Values.kvDiskCache.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "iterserve.modelVolumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if .Values.lora.volume }}
- name: lora-adapters
  mountPath: {{ .Values.lora.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.kvDiskCache.volume }}
- name: kv-disk-cache
  mountPath: {{ .Values.kvDiskCache.mountPath }}
{{- end }}
{{- end }}

{{/*
The init container that copies the checkpoint into the model emptyDir (only
for model.copy sources). It runs `rclone copy` from the URL or the source
volume; arguments are a list, never a shell line.
*/}}
{{- define "iterserve.modelInitContainers" -}}
{{- $m := .Values.model }}
{{- if not $m.pvc.claimName }}
{{- $c := $m.copy }}
- name: copy-model
  image: {{ printf "%s:%s" $c.image.repository $c.image.tag | quote }}
  imagePullPolicy: {{ $c.image.pullPolicy }}
  command: ["rclone"]
  {{- if $c.url }}
  {{- $url := $c.url }}
  {{- if hasPrefix "s3://" $url }}
  args: ["copy", "--fast-list", "--transfers", "8", {{ printf ":s3:%s" (trimPrefix "s3://" $url) | quote }}, "/model"]
  {{- else if hasPrefix "gs://" $url }}
  args: ["copy", "--fast-list", "--transfers", "8", {{ printf ":gcs:%s" (trimPrefix "gs://" $url) | quote }}, "/model"]
  {{- else }}
  args: ["copy", "--transfers", "8", "--http-url", {{ $url | quote }}, ":http:", "/model"]
  {{- end }}
  {{- else }}
  args: ["copy", "--transfers", "8", {{ printf "/model-source/%s" (trimAll "/" $c.path) | trimSuffix "/" | quote }}, "/model"]
  {{- end }}
  env:
    - name: RCLONE_S3_PROVIDER
      value: {{ $c.s3Provider | quote }}
    - name: RCLONE_S3_ENV_AUTH
      value: "true"
    - name: RCLONE_GCS_ENV_AUTH
      value: "true"
    {{- with $c.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $c.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: /model
    {{- if $c.volume }}
    - name: model-source
      mountPath: /model-source
      readOnly: true
    {{- end }}
{{- end }}
{{- end }}

{{/*
Environment of the Ray containers: the API key from its Secret, then extra env.
*/}}
{{- define "iterserve.rayEnv" -}}
{{- /* Ray starts its workers at nice 15; the serving processes (proxy, ingress,
scheduler, ranks) run at nice 0 like any server, so nothing else in the pod at
nice 0 takes the CPU from them. */}}
- name: RAY_worker_niceness
  value: "0"
{{- if .Values.apiKey.enabled }}
- name: {{ .Values.apiKey.envName }}
  valueFrom:
    secretKeyRef:
      name: {{ include "iterserve.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod metadata shared by head and workers; call with (dict "ctx" $ "component" "head").
Only stable labels: KubeRay replaces the whole Ray cluster when a pod template
changes, so the chart and app versions stay off the pods.
*/}}
{{- define "iterserve.podMetadata" -}}
{{- $ctx := .ctx }}
labels:
  {{- include "iterserve.selectorLabels" $ctx | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with $ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $ctx.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
