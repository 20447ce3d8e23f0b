"""One settings model shared by the CLI, the offline API and every service.

Values come from keyword arguments / CLI flags and from ``PAGEDLLM_*`` environment
variables (pydantic-settings). Engine settings carry vLLM's names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache on CPU unless told otherwise
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "pagedllm"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def kernel_cache_dir(cache_dir: Path | str | None = None) -> Path:
    """Where the native CPU kernels are built and kept: ``<cache_dir>/kernels``; without
    ``cache_dir``, ``Settings.cache_dir`` as the environment sets it (``PAGEDLLM_CACHE_DIR``,
    else ``DEFAULT_CACHE_DIR``), so a caller without settings builds where the services do."""
    if cache_dir is None:
        try:
            cache_dir = Settings().cache_dir
        except ValueError:  # another PAGEDLLM_* variable is invalid: the services would not start either
            cache_dir = DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser() / "kernels"


class Settings(BaseSettings):
    """Engine and service settings.

    Raises:
        pydantic.ValidationError: a value is out of range (``detokenizer_shard`` not below
            ``num_detokenizer_shards``, an unknown ``log_level``, a ``nats_creds`` file that is
            not there, ...), or a setting that a later version implements was asked for (the
            message names the parameter).
    """

    model_config = SettingsConfigDict(env_prefix="PAGEDLLM_", extra="forbid", protected_namespaces=())

    # --- engine (vLLM names) ---
    model: str | None = Field(None, description="Hugging Face model directory; None = default SmolLM2")
    served_model_name: str | None = Field(None, description="Name in the API and subjects")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["gptq", "awq", "compressed-tensors", "fp8", "gguf"] | None = Field(
        None, description="The checkpoint's quantization method (config.json's quantization_config, or gguf "
        "for a model served from a GGUF file); None = detected from the checkpoint, a name = refuse a "
        "checkpoint quantized otherwise or not at all")
    max_model_len: int | None = Field(None, ge=1, description="Context length in tokens")
    block_size: int = Field(16, description="KV cache block size in tokens")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="KV pool size in blocks")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV pool budget in bytes")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1, description="Token budget of one step")
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of common prefixes")
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool = Field(
        True, description="Plan step N + 1 while the executor runs step N (hides the scheduler round trip)"
    )
    seed: int = 0
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks of one executor group, one process each (rank 0 starts the others "
        "on this machine unless tensor_parallel_rank is set)")
    tensor_parallel_rank: int | None = Field(
        None, ge=0, description="Run only this rank of the group (ranks on several machines: start each "
        "by hand with the same master address and port; rank 0 is the one that serves NATS)")
    tensor_parallel_master_addr: str = Field(
        "127.0.0.1", description="Where rank 0 listens for the other ranks of its group")
    tensor_parallel_master_port: int | None = Field(
        None, ge=1, le=65535, description="Rank 0's rendezvous port; None = a free port (one machine only)")
    attention_backend: Literal["auto", "torch", "triton", "reference"] = Field(
        "auto", description="auto = triton on CUDA, torch on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_threads: int | None = Field(
        None, ge=1, description="Intra-op threads of a CPU executor; None = torch's default (one per core)"
    )
    native_cpu_kernels: bool = Field(
        True, description="CPU: attention, bf16 RMSNorm and bf16 matmuls in the C kernels (kernels/cpu/; built by prepare-model, else at first use)"
    )
    adaptive_cpu_threads: bool = Field(
        True, description="CPU executor: use fewer threads while other processes keep cores busy"
    )

    # --- services ---
    nats_url: str | None = Field(
        None, description="NATS server URL, with a user and password (nats://user:pw@host:4222) or a token "
        "(nats://token@host:4222) where the server requires them; None = start an embedded one")
    nats_creds: Path | None = Field(
        None, description="NATS credentials file (.creds: a user JWT and its NKey seed), for every service and "
        "the offline engine")
    host: str = "127.0.0.1"
    port: int = 8000
    group_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]+$", description="Executor group id; None = <hostname>-<pid>"
    )
    num_detokenizer_shards: int = Field(1, ge=1)
    detokenizer_shard: int = Field(0, ge=0)
    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="Converted models, the built CPU kernels, and "
                            "pagedllm serve's JetStream store (batch jobs)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)")
    step_timeout_s: float = Field(600.0, gt=0, description="Max seconds one executor step may take")
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    executor_wait_timeout_s: float = Field(
        60.0, gt=0, description="Seconds requests wait for an executor group once the last one is gone (one "
        "restarting loads its model) before they fail with a 503")
    gateway_drain_timeout_s: float = Field(
        5.0, ge=0, description="On stop, seconds the gateway lets in-flight HTTP requests finish before it "
        "answers them with a 503"
    )
    # --- batch API (gateway/batch/) ---
    batch_max_in_flight: int = Field(256, ge=1, description="Batch lines one batch service runs at once")
    batch_ack_wait_s: float = Field(
        30.0, gt=0, description="Seconds before JetStream delivers a batch line again when its batch service is silent")
    batch_max_attempts: int = Field(
        5, ge=1, description="Deliveries of a batch line the engine lost (5xx) before it is stored as failed")
    batch_monitor_interval_s: float = Field(1.0, gt=0, description="How often batches' counts and ends are checked")
    batch_max_file_bytes: int = Field(200 * 1024 * 1024, ge=1, description="Largest file /v1/files accepts (413 above)")
    api_key: str | None = Field(
        None, description="API keys the /v1 routes and the WebSocket require as 'Authorization: Bearer <key>' "
        "(several: comma-separated, or --api-key K1 K2); None = open, as vLLM")
    allowed_origins: str = Field(
        "*", description="Browser origins allowed by CORS, comma-separated ('*' = any, as vLLM; '' = none)"
    )
    # --- chat and tools (vLLM names) ---
    chat_template: str | None = Field(
        None, description="A Jinja chat template file (or the template itself) used instead of the model's; "
        "tools reach the prompt through it (examples/tool_chat_template_smollm2.jinja for SmolLM2)")
    enable_auto_tool_choice: bool = Field(
        False, description="Serve tool_choice 'auto': generation is free and --tool-call-parser reads the calls")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None, description="How tool calls are read from the model's text (gateway/tools/)")

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, v: int) -> int:
        if v not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        return v

    @model_validator(mode="after")
    def _check_tensor_parallel_rank(self) -> Settings:
        """A rank outside ``range(tensor_parallel_size)`` has no group; ranks started by hand
        (on several machines) must agree on a port."""
        rank = self.tensor_parallel_rank
        if rank is not None and rank >= self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_rank={rank} must be less than tensor_parallel_size="
                             f"{self.tensor_parallel_size} (ranks are numbered from 0)")
        if rank is not None and self.tensor_parallel_size > 1 and self.tensor_parallel_master_port is None:
            raise ValueError("tensor_parallel_rank needs tensor_parallel_master_port: every rank of the "
                             "group meets rank 0 at tensor_parallel_master_addr:tensor_parallel_master_port")
        return self

    @field_validator("nats_creds")
    @classmethod
    def _check_nats_creds(cls, v: Path | None) -> Path | None:
        """The file, ``~`` expanded; one that is not there is refused now rather than at every
        connection attempt."""
        if v is None:
            return None
        v = v.expanduser()
        if not v.is_file():
            raise ValueError(f"nats_creds: no such file {str(v)!r}")
        return v

    @model_validator(mode="after")
    def _check_nats_creds_has_url(self) -> Settings:
        """The embedded nats-server (no ``nats_url``) takes only its own token: credentials are
        for a server given by ``nats_url``."""
        if self.nats_creds is not None and not self.nats_url:
            raise ValueError("nats_creds needs nats_url: the credentials are for the NATS server it names "
                             "(the embedded one takes only its own token)")
        return self

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, v: str | None) -> str | None:
        """A file path (``~`` expanded, made absolute: a service may start in another directory) or a
        template's text (it has ``{``); a path that is not a file is refused now rather than at
        the first chat."""
        if v is None or "{" in v:
            return v
        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template: no such file {v!r} (give a Jinja template file or the template itself)")
        return str(path.resolve())

    @model_validator(mode="after")
    def _check_auto_tool_choice(self) -> Settings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:  # as vLLM
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the parser that reads the calls "
                             "(hermes, llama3_json or mistral)")
        return self

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, v: str) -> str:
        """The level upper-cased; any other name than the five of ``LOG_LEVELS`` is refused."""
        if v.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got {v!r}")
        return v.upper()

    @model_validator(mode="after")
    def _check_detokenizer_shard(self) -> Settings:
        """A shard outside ``range(num_detokenizer_shards)`` would never receive a request."""
        if self.detokenizer_shard >= self.num_detokenizer_shards:
            raise ValueError(
                f"detokenizer_shard={self.detokenizer_shard} must be less than "
                f"num_detokenizer_shards={self.num_detokenizer_shards} (shards are numbered from 0)"
            )
        return self

    def to_env(self) -> dict[str, str]:
        """The settings as ``PAGEDLLM_*`` environment variables, for child processes."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            key = "PAGEDLLM_" + name.upper()
            env[key] = json.dumps(value) if isinstance(value, bool | list | dict) else str(value)
        return env
