"""vLLM's ``serve`` flags that are not iterserve's own, as data.

``iterserve serve`` generates a flag for every knob it has, under vLLM's name
where vLLM has the knob (:mod:`~iterserve.cluster.serve.flags`). Every other
flag ``vllm serve`` takes is listed here, so that a vLLM command line parses
here too and each of its flags gets an answer:

- ``ANY``: it tunes something iterserve does its own way; accepted whatever its
  value, with a log line that says what iterserve does instead;
- a tuple of values: accepted (with the log line) when it has one of them, the
  ones that ask for what iterserve does anyway; refused with any other;
- ``REFUSED``: iterserve does not implement it; refused with a sentence.

A knob added to iterserve later takes its vLLM name from the generator and so
leaves this table behind (a generated flag wins over an entry here).

Each row: option strings, vLLM's help group, how many values the flag takes
(0: a switch, with its ``--no-`` form where vLLM has one; 1; ``"+"``: several;
``"?"``: an optional one), what is accepted, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANY = "any"
REFUSED: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]
    group: str
    nargs: Any  # 0, 1, "+" or "?"
    accepted: Any  # ANY, or the values accepted (REFUSED: none)
    why: str

    def accepts(self, value: Any) -> bool:
        if self.accepted == ANY:
            return True
        values = value if isinstance(value, list) else [value]
        return bool(self.accepted) and all(str(v) in self.accepted for v in values)


_MULTINODE = "iterserve spans nodes as a Ray cluster (docs/deploy.md), not by flags"
_TLS = "TLS ends at the gateway or ingress in front of iterserve (docs/deploy.md)"
_MM = "iterserve serves text-only models"
_NOOP_LOG = "iterserve's logging is its own (--log-level; metrics at /metrics)"
_GRAPHS = "iterserve captures decode graphs on CUDA by itself (docs/model-runtime.md)"

_ROWS: list[tuple[tuple[str, ...], str, Any, Any, str]] = [
    # -- options (vLLM's top level) --
    (("--headless",), "options", 0, REFUSED, _MULTINODE),
    (("--api-server-count", "-asc"), "options", 1, ANY,
     "one ingress replica answers HTTP; engine replicas are --data-parallel-size"),
    (("--grpc",), "options", 0, REFUSED, "iterserve serves HTTP only"),
    (("--disable-log-stats",), "options", 0, ANY, _NOOP_LOG),
    (("--aggregate-engine-logging",), "options", 0, ANY, _NOOP_LOG),
    (("--enable-log-requests", "--no-enable-log-requests"), "options", 0, ANY, _NOOP_LOG),
    (("--disable-log-requests", "--no-disable-log-requests"), "options", 0, ANY, _NOOP_LOG),
    (("--fail-on-environ-validation", "--no-fail-on-environ-validation"), "options", 0, ANY,
     "iterserve reads no VLLM_* environment variables"),
    # -- Frontend --
    (("--uds",), "Frontend", 1, REFUSED, "the ingress listens on TCP (--host, --port)"),
    (("--uvicorn-log-level",), "Frontend", 1, ANY, _NOOP_LOG),
    (("--disable-uvicorn-access-log",), "Frontend", 0, ANY, "the ingress keeps no access log"),
    (("--disable-access-log-for-endpoints",), "Frontend", 1, ANY,
     "the ingress keeps no access log"),
    (("--allowed-methods",), "Frontend", 1, ANY, "CORS allows GET, POST and OPTIONS"),
    (("--allowed-headers",), "Frontend", 1, ANY, "CORS allows every request header"),
    (("--chat-template-content-format",), "Frontend", 1, ("auto", "string"),
     "message content reaches the chat template as one string"),
    (("--trust-request-chat-template",), "Frontend", 0, REFUSED,
     "a request cannot carry its own chat template here"),
    (("--default-chat-template-kwargs",), "Frontend", 1, REFUSED,
     "send chat_template_kwargs with each request"),
    (("--response-role",), "Frontend", 1, ("assistant",), "answers come from the assistant"),
    (("--ssl-keyfile",), "Frontend", 1, REFUSED, _TLS),
    (("--ssl-certfile",), "Frontend", 1, REFUSED, _TLS),
    (("--ssl-ca-certs",), "Frontend", 1, REFUSED, _TLS),
    (("--enable-ssl-refresh",), "Frontend", 0, REFUSED, _TLS),
    (("--ssl-cert-reqs",), "Frontend", 1, REFUSED, _TLS),
    (("--ssl-ciphers",), "Frontend", 1, REFUSED, _TLS),
    (("--root-path",), "Frontend", 1, REFUSED, "the routes sit at the root"),
    (("--middleware",), "Frontend", 1, REFUSED, "the ingress takes no extra ASGI middleware"),
    (("--return-tokens-as-token-ids",), "Frontend", 0, REFUSED,
     "send return_tokens_as_token_ids with each request"),
    (("--disable-frontend-multiprocessing",), "Frontend", 0, ANY,
     "the ingress and the engines are separate Ray processes"),
    (("--enable-request-id-headers",), "Frontend", 0, ANY,
     "every answer carries X-Request-Id already"),
    (("--exclude-tools-when-tool-choice-none",), "Frontend", 0, REFUSED,
     "tools reach the chat template whatever tool_choice says"),
    (("--tool-parser-plugin",), "Frontend", 1, REFUSED, "tool-call parsers are built in"),
    (("--tool-server",), "Frontend", 1, REFUSED, "iterserve runs no tools itself"),
    (("--log-config-file",), "Frontend", 1, REFUSED, _NOOP_LOG),
    (("--max-log-len",), "Frontend", 1, ANY, "prompts are not logged"),
    (("--disable-fastapi-docs",), "Frontend", 0, ANY, "iterserve serves no docs pages"),
    (("--enable-offline-docs",), "Frontend", 0, ANY, "iterserve serves no docs pages"),
    (("--enable-prompt-tokens-details",), "Frontend", 0, ANY,
     "usage carries prompt_tokens_details.cached_tokens already"),
    (("--enable-server-load-tracking",), "Frontend", 0, ANY, "load is at /v1/stats and /metrics"),
    (("--enable-force-include-usage",), "Frontend", 0, REFUSED,
     "ask for usage with stream_options.include_usage"),
    (("--enable-tokenizer-info-endpoint",), "Frontend", 0, REFUSED, "no /tokenizer_info route"),
    (("--enable-log-outputs",), "Frontend", 0, ANY, _NOOP_LOG),
    (("--enable-log-deltas", "--no-enable-log-deltas"), "Frontend", 0, ANY, _NOOP_LOG),
    (("--log-error-stack",), "Frontend", 0, ANY, _NOOP_LOG),
    (("--h11-max-incomplete-event-size",), "Frontend", 1, ANY, "bodies are bounded by --max-body-bytes"),
    (("--h11-max-header-count",), "Frontend", 1, ANY, "uvicorn's own limits apply"),
    (("--tokens-only",), "Frontend", 0, REFUSED, "every route is served"),
    (("--enable-per-request-metrics",), "Frontend", 0, REFUSED, "per-request timings are metrics"),
    # -- ModelConfig --
    (("--runner",), "ModelConfig", 1, ("auto", "generate"), "iterserve runs generative models"),
    (("--convert",), "ModelConfig", 1, ("auto", "none"), "checkpoints are served as they are"),
    (("--task",), "ModelConfig", 1, ("auto", "generate"), "iterserve runs generative models"),
    (("--tokenizer",), "ModelConfig", 1, REFUSED,
     "the tokenizer is the model directory's own (tokenizer.json)"),
    (("--tokenizer-mode",), "ModelConfig", 1, ("auto", "hf", "fast"),
     "tokenizer.json is read with the tokenizers library"),
    (("--trust-remote-code", "--no-trust-remote-code"), "ModelConfig", 0, ANY,
     "iterserve runs no code from a checkpoint; its architecture must be one iterserve "
     "implements (docs/model-runtime.md)"),
    (("--hf-config-path",), "ModelConfig", 1, REFUSED, "config.json is the model directory's"),
    (("--allowed-local-media-path",), "ModelConfig", 1, REFUSED, _MM),
    (("--allowed-media-domains",), "ModelConfig", "+", REFUSED, _MM),
    (("--revision",), "ModelConfig", 1, REFUSED,
     "iterserve downloads nothing: the model is a local directory or a snapshot already in "
     "the Hugging Face cache"),
    (("--code-revision",), "ModelConfig", 1, REFUSED, "iterserve runs no code from a checkpoint"),
    (("--tokenizer-revision",), "ModelConfig", 1, REFUSED, "iterserve downloads nothing"),
    (("--hf-token",), "ModelConfig", "?", ANY, "iterserve downloads nothing"),
    (("--allow-deprecated-quantization",), "ModelConfig", 0, ANY,
     "the quantization methods served (--quantization) are none of vLLM's deprecated ones"),
    (("--enforce-eager", "--no-enforce-eager"), "ModelConfig", 0, ANY, _GRAPHS),
    (("--enable-return-routed-experts",), "ModelConfig", 0, REFUSED, "not reported"),
    (("--logprobs-mode",), "ModelConfig", 1, ("raw_logprobs",),
     "logprobs are the model's, before any sampling change"),
    (("--disable-sliding-window",), "ModelConfig", 0, REFUSED,
     "sliding windows are computed as the checkpoint declares them"),
    (("--disable-cascade-attn", "--no-disable-cascade-attn"), "ModelConfig", 0, ANY,
     "attention kernels are chosen by iterserve's dispatch (docs/kernels.md)"),
    (("--skip-tokenizer-init",), "ModelConfig", 0, REFUSED, "the ingress tokenizes"),
    (("--enable-prompt-embeds",), "ModelConfig", 0, REFUSED, "prompts are text or token ids"),
    (("--config-format",), "ModelConfig", 1, ("auto", "hf"), "config.json is read"),
    (("--hf-overrides",), "ModelConfig", 1, REFUSED, "config.json is read as it is"),
    (("--pooler-config",), "ModelConfig", 1, REFUSED, "iterserve runs generative models"),
    (("--override-pooler-config",), "ModelConfig", 1, REFUSED, "iterserve runs generative models"),
    (("--logits-processor-pattern",), "ModelConfig", 1, REFUSED, "no logits processor plugins"),
    (("--logits-processors",), "ModelConfig", "+", REFUSED, "no logits processor plugins"),
    (("--enable-sleep-mode", "--no-enable-sleep-mode"), "ModelConfig", 0, ANY,
     "POST /sleep and /wake_up are always served"),
    (("--model-impl",), "ModelConfig", 1, ("auto", "vllm"),
     "iterserve's own decoder runs every architecture it serves"),
    (("--override-attention-dtype",), "ModelConfig", 1, REFUSED, "attention runs in --dtype"),
    (("--io-processor-plugin",), "ModelConfig", 1, REFUSED, "no IO processor plugins"),
    (("--max-seq-len-to-capture",), "ModelConfig", 1, ANY, _GRAPHS),
    (("--disable-async-output-proc",), "ModelConfig", 0, ANY,
     "outputs are detokenized by the ingress, off the engine's loop"),
    (("--rope-scaling",), "ModelConfig", 1, REFUSED, "rope scaling is config.json's"),
    (("--rope-theta",), "ModelConfig", 1, REFUSED, "rope scaling is config.json's"),
    # -- LoadConfig --
    (("--load-format",), "LoadConfig", 1, ("auto", "safetensors"),
     "weights are read from safetensors files"),
    (("--safetensors-load-strategy",), "LoadConfig", 1, ANY,
     "safetensors files are read lazily, shard by shard"),
    (("--model-loader-extra-config",), "LoadConfig", 1, REFUSED, "one loader"),
    (("--ignore-patterns",), "LoadConfig", "+", ANY, "only the safetensors the index names are read"),
    (("--use-tqdm-on-load", "--no-use-tqdm-on-load"), "LoadConfig", 0, ANY, _NOOP_LOG),
    (("--pt-load-map-location",), "LoadConfig", 1, REFUSED, "weights are read from safetensors"),
    (("--qlora-adapter-name-or-path",), "LoadConfig", 1, REFUSED, "quantized weights are not served"),
    # -- AttentionConfig --
    (("--attention-backend",), "AttentionConfig", 1, ANY,
     "attention kernels are chosen by iterserve's dispatch (--kernel-backend)"),
    # -- StructuredOutputsConfig --
    (("--reasoning-parser",), "StructuredOutputsConfig", 1, REFUSED,
     "reasoning output is not split out yet"),
    (("--reasoning-parser-plugin",), "StructuredOutputsConfig", 1, REFUSED, "parsers are built in"),
    (("--guided-decoding-backend",), "StructuredOutputsConfig", 1, ("auto", "xgrammar"),
     "structured outputs are compiled with xgrammar"),
    (("--structured-outputs-config",), "VllmConfig", 1, ANY,
     "structured outputs are compiled with xgrammar"),
    # -- ParallelConfig --
    (("--distributed-executor-backend",), "ParallelConfig", 1, ANY, "the ranks are Ray actors"),
    (("--pipeline-parallel-size", "-pp"), "ParallelConfig", 1, ("1",),
     "iterserve splits a model by tensor parallelism only"),
    (("--master-addr",), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--master-port",), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--nnodes", "-n"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--node-rank", "-r"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--decode-context-parallel-size", "-dcp"), "ParallelConfig", 1, ("1",), "no context parallelism"),
    (("--dcp-kv-cache-interleave-size",), "ParallelConfig", 1, REFUSED, "no context parallelism"),
    (("--cp-kv-cache-interleave-size",), "ParallelConfig", 1, REFUSED, "no context parallelism"),
    (("--prefill-context-parallel-size", "-pcp"), "ParallelConfig", 1, ("1",),
     "no context parallelism"),
    (("--data-parallel-rank", "-dpn"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--data-parallel-start-rank", "-dpr"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--data-parallel-size-local", "-dpl"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--data-parallel-address", "-dpa"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--data-parallel-rpc-port", "-dpp"), "ParallelConfig", 1, REFUSED, _MULTINODE),
    (("--data-parallel-backend", "-dpb"), "ParallelConfig", 1, ANY,
     "engine replicas are Ray Serve replicas"),
    (("--data-parallel-hybrid-lb", "-dph"), "ParallelConfig", 0, REFUSED,
     "the ingress balances over the engine replicas (--routing)"),
    (("--data-parallel-external-lb", "-dpe"), "ParallelConfig", 0, REFUSED,
     "the ingress balances over the engine replicas (--routing)"),
    (("--enable-expert-parallel", "-ep"), "ParallelConfig", 0, REFUSED,
     "experts are split by tensor parallelism"),
    (("--all2all-backend",), "ParallelConfig", 1, REFUSED, "no expert parallelism"),
    (("--enable-dbo",), "ParallelConfig", 0, REFUSED, "no dual-batch overlap"),
    (("--ubatch-size",), "ParallelConfig", 1, REFUSED, "no dual-batch overlap"),
    (("--dbo-decode-token-threshold",), "ParallelConfig", 1, REFUSED, "no dual-batch overlap"),
    (("--dbo-prefill-token-threshold",), "ParallelConfig", 1, REFUSED, "no dual-batch overlap"),
    (("--disable-nccl-for-dp-synchronization",), "ParallelConfig", 0, ANY,
     "engine replicas do not synchronize their steps"),
    (("--enable-eplb",), "ParallelConfig", 0, REFUSED, "no expert load balancing"),
    (("--eplb-config",), "ParallelConfig", 1, REFUSED, "no expert load balancing"),
    (("--expert-placement-strategy",), "ParallelConfig", 1, REFUSED, "no expert parallelism"),
    (("--max-parallel-loading-workers",), "ParallelConfig", 1, ANY,
     "each rank reads its own shard of the weights"),
    (("--ray-workers-use-nsight",), "ParallelConfig", 0, ANY, "profile with Ray's own tools"),
    (("--disable-custom-all-reduce",), "ParallelConfig", 0, ANY,
     "one NCCL all-reduce per layer (gloo on CPU)"),
    (("--worker-cls",), "ParallelConfig", 1, REFUSED, "the rank actor is iterserve's"),
    (("--worker-extension-cls",), "ParallelConfig", 1, REFUSED, "the rank actor is iterserve's"),
    # -- CacheConfig --
    (("--kv-cache-memory-bytes",), "CacheConfig", 1, REFUSED,
     "size the cache with --gpu-memory-utilization or --num-gpu-blocks-override"),
    (("--swap-space",), "CacheConfig", 1, ANY,
     "a preempted sequence swaps through the host tier (--kv-offloading-size)"),
    (("--kv-cache-dtype",), "CacheConfig", 1, ("auto",), "the KV cache is kept in --dtype"),
    (("--prefix-caching-hash-algo",), "CacheConfig", 1, ANY,
     "blocks are keyed by their tokens' hash chain (docs/serving.md)"),
    (("--cpu-offload-gb",), "CacheConfig", 1, ("0",), "weights stay on the rank's device"),
    (("--calculate-kv-scales",), "CacheConfig", 0, REFUSED, "the KV cache is kept in --dtype"),
    (("--kv-sharing-fast-prefill",), "CacheConfig", 0, REFUSED, "not implemented"),
    (("--mamba-cache-dtype",), "CacheConfig", 1, REFUSED, "no state-space models"),
    (("--mamba-ssm-cache-dtype",), "CacheConfig", 1, REFUSED, "no state-space models"),
    (("--mamba-block-size",), "CacheConfig", 1, REFUSED, "no state-space models"),
    (("--mamba-cache-mode",), "CacheConfig", 1, REFUSED, "no state-space models"),
    (("--kv-offloading-backend",), "CacheConfig", 1, ("native",),
     "the host and disk tiers are iterserve's own (--kv-offloading-size, --kv-disk-cache-dir)"),
    # -- MultiModalConfig --
    (("--limit-mm-per-prompt",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--enable-mm-embeds",), "MultiModalConfig", 0, REFUSED, _MM),
    (("--media-io-kwargs",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-processor-kwargs",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-processor-cache-gb",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-processor-cache-type",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-shm-cache-max-object-size-mb",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-encoder-only",), "MultiModalConfig", 0, REFUSED, _MM),
    (("--mm-encoder-tp-mode",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--mm-encoder-attn-backend",), "MultiModalConfig", 1, REFUSED, _MM),
    (("--interleave-mm-strings",), "MultiModalConfig", 0, REFUSED, _MM),
    (("--skip-mm-profiling",), "MultiModalConfig", 0, REFUSED, _MM),
    (("--video-pruning-rate",), "MultiModalConfig", 1, REFUSED, _MM),
    # -- LoRAConfig --
    (("--lora-dtype",), "LoRAConfig", 1, ("auto",), "adapters run in --dtype"),
    (("--enable-tower-connector-lora",), "LoRAConfig", 0, REFUSED, _MM),
    (("--fully-sharded-loras",), "LoRAConfig", 0, ANY,
     "adapters are split across ranks as their base layers are"),
    (("--default-mm-loras",), "LoRAConfig", 1, REFUSED, _MM),
    (("--specialize-active-lora",), "LoRAConfig", 0, ANY, "adapter kernels are iterserve's"),
    (("--lora-extra-vocab-size",), "LoRAConfig", 1, ("0",), "adapters add no tokens"),
    (("--long-lora-scaling-factors",), "LoRAConfig", 1, REFUSED, "no long-context adapters"),
    # -- ObservabilityConfig --
    (("--show-hidden-metrics-for-version",), "ObservabilityConfig", 1, ANY,
     "iterserve's metrics are at /metrics (docs/observability.md)"),
    (("--otlp-traces-endpoint",), "ObservabilityConfig", 1, REFUSED, "no OpenTelemetry traces"),
    (("--collect-detailed-traces",), "ObservabilityConfig", 1, REFUSED, "no OpenTelemetry traces"),
    (("--kv-cache-metrics",), "ObservabilityConfig", 0, ANY,
     "KV usage is always at /metrics (docs/observability.md)"),
    (("--kv-cache-metrics-sample",), "ObservabilityConfig", 1, ANY,
     "KV usage is always at /metrics"),
    (("--cudagraph-metrics",), "ObservabilityConfig", 0, ANY, _NOOP_LOG),
    (("--enable-layerwise-nvtx-tracing",), "ObservabilityConfig", 0, ANY, _NOOP_LOG),
    (("--enable-mfu-metrics",), "ObservabilityConfig", 0, ANY, _NOOP_LOG),
    (("--enable-logging-iteration-details",), "ObservabilityConfig", 0, ANY, _NOOP_LOG),
    # -- SchedulerConfig --
    (("--max-long-partial-prefills",), "SchedulerConfig", 1, REFUSED,
     "bound long prompts with --long-prefill-token-threshold"),
    (("--scheduling-policy",), "SchedulerConfig", 1, ("fcfs", "priority"),
     "the queue runs by priority, then arrival (all-equal priorities: first come, first served)"),
    (("--disable-chunked-mm-input",), "SchedulerConfig", 0, ANY, _MM),
    (("--scheduler-cls",), "SchedulerConfig", 1, REFUSED,
     "batching policies are iterserve's (--policy)"),
    (("--disable-hybrid-kv-cache-manager",), "SchedulerConfig", 0, ANY,
     "one block manager serves every layer kind"),
    (("--stream-interval",), "SchedulerConfig", 1, ANY,
     "each step's tokens go out in one frame per client"),
    (("--num-lookahead-slots",), "SchedulerConfig", 1, ANY,
     "speculative tokens are planned in the step budget"),
    (("--scheduler-delay-factor",), "SchedulerConfig", 1, REFUSED,
     "use --policy dynamic with --batch-wait-s"),
    (("--preemption-mode",), "SchedulerConfig", 1, ("recompute", "swap"),
     "a preempted sequence swaps back when the host tier is on and a copy beats recompute"),
    (("--num-scheduler-steps",), "SchedulerConfig", 1, ("1",), "one step per schedule"),
    # -- CompilationConfig, VllmConfig --
    (("--cudagraph-capture-sizes",), "CompilationConfig", "+", ANY, _GRAPHS),
    (("--max-cudagraph-capture-size",), "CompilationConfig", 1, ANY, _GRAPHS),
    (("--kv-transfer-config",), "VllmConfig", 1, REFUSED, "no disaggregated prefill"),
    (("--ec-transfer-config",), "VllmConfig", 1, REFUSED, "no disaggregated encoders"),
    (("--compilation-config", "-cc", "-O"), "VllmConfig", 1, ANY,
     "kernels are compiled by iterserve's own dispatch (docs/kernels.md)"),
    (("--optimization-level",), "VllmConfig", 1, ANY, "kernels are iterserve's"),
    (("--attention-config", "-ac"), "VllmConfig", 1, ANY, "attention kernels are iterserve's"),
    (("--additional-config",), "VllmConfig", 1, REFUSED, "no platform plugins"),
    (("--profiler-config",), "VllmConfig", 1, REFUSED, "no profiler routes"),
    (("--weight-transfer-config",), "VllmConfig", 1, REFUSED, "no weight transfer"),
    # -- FaultToleranceConfig --
    (("--enable-fault-tolerance",), "FaultToleranceConfig", 0, ANY,
     "a failed rank is restarted and its sequences recomputed (--max-restarts)"),
    (("--shutdown-on-fault-tolerance-failure",), "FaultToleranceConfig", 0, ANY,
     "an engine replica out of restarts reports itself dead and Serve replaces it"),
    (("--engine-recovery-timeout",), "FaultToleranceConfig", 1, ANY,
     "see --step-timeout-s and --restart-window-s"),
    (("--gloo-comm-timeout",), "FaultToleranceConfig", 1, ANY, "see --step-timeout-s"),
]  # fmt: skip

VLLM_FLAGS: tuple[VllmFlag, ...] = tuple(VllmFlag(*row) for row in _ROWS)
