"""Dataclass schemas for every config group; registered in Hydra's ConfigStore (see register()).

Each dataclass checks itself in ``__post_init__`` so a bad value fails before any work, with
an error that names the key and the fix. YAML under conf/ is validated against these.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"   # the Hydra config tree every runner composes
SYSTEMS = ("sglang_default", "sglang_cascade", "hydragen", "granikv")
# settings of the granikv system's parts, run by our engine (conf/system/<name>.yaml each)
ABLATIONS = ("granikv_dense_only", "granikv_cascade_only", "granikv_paged_only", "granikv_no_hot", "granikv_dynamic")
ENGINES = ("granikv", "sglang")   # who serves a cell: our compact engine, or a real SGLang server
BACKENDS = ("paged", "cascade", "hydragen", "granikv")
# the plugin's SGLang attention backends (granikv.sglang_plugin) -> the system.backend each runs
PLUGIN_ATTENTION = {"granikv": "granikv", "granikv_cascade": "cascade", "hydragen": "hydragen"}
RADIX_BACKENDS = ("", "granikv")   # --radix-cache-backend: "" = SGLang's own RadixCache
DISPATCH = ("table", "table_one_class", "dense_only", "cascade_only", "paged_only")
CASCADE_IMPLS = ("multilevel", "composed")   # backend=cascade, GPU path (see SystemConfig.cascade_impl)
DECODE_PLANS = ("flashinfer", "fast")         # how decode wrappers are re-planned (see SystemConfig.decode_plan)
DENSE_KERNELS = ("flashinfer", "cudnn", "fa2")  # the dense prefix call's kernel (see SystemConfig.dense_kernel)
WORKLOADS = ("synthetic", "sharegpt", "multiprefix")
ARRIVALS = ("burst", "poisson", "gamma")


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config error at `{key}`: {msg}")


def _fraction(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0


def check_split(s: Any, key: Callable[[str], str]) -> None:
    """The checks of the settings SystemConfig shares with the SGLang plugin (granikv.sglang_plugin.settings):
    the HOT/COLD split and the GPU paths' choices. ``key(field)`` names a field in an error
    (``system.hot_fraction`` for a config, ``GRANIKV_HOT_FRACTION`` for the plugin's environment)."""
    _need(s.cascade_impl in CASCADE_IMPLS, key("cascade_impl"), f"'{s.cascade_impl}' not in {CASCADE_IMPLS}")
    _need(s.decode_plan in DECODE_PLANS, key("decode_plan"), f"'{s.decode_plan}' not in {DECODE_PLANS}")
    _need(_fraction(s.hot_fraction), key("hot_fraction"), f"must be in [0, 1), got {s.hot_fraction!r}")
    _need(s.hot_split in ("static", "dynamic"), key("hot_split"),
          f"'{s.hot_split}' not in ('static', 'dynamic'); static = HOT fixed at hot_fraction")
    for k in ("hot_min_fraction", "hot_max_fraction", "cold_watermark"):
        v = getattr(s, k)
        _need(_fraction(v), key(k), f"must be a number in [0, 1), got {v!r}")
    if s.hot_split == "dynamic":
        _need(s.hot_min_fraction <= s.hot_fraction, key("hot_min_fraction"),
              f"{s.hot_min_fraction} is above hot_fraction={s.hot_fraction} (the split starts at "
              "hot_fraction); lower hot_min_fraction or raise hot_fraction")
        _need(s.hot_fraction <= s.hot_max_fraction, key("hot_max_fraction"),
              f"{s.hot_max_fraction} is below hot_fraction={s.hot_fraction} (the split starts at "
              "hot_fraction); raise hot_max_fraction or lower hot_fraction")


@dataclass
class ModelConfig:
    """Decoder shape (Llama / Qwen2 family). Weights are random; only the shape matters."""

    name: str = "tiny"
    arch: str = "llama"  # llama | qwen2
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None  # Llama-3: factor, low/high_freq_factor, original_max_position_embeddings
    qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self):
        _need(self.arch in ("llama", "qwen2"), "model.arch", f"'{self.arch}' is not llama or qwen2")
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings"):
            _need(int(getattr(self, k)) > 0, f"model.{k}", "must be a positive integer")
        _need(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
              f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class ServerConfig:
    """How a real serving engine is started and driven (``system.engine=sglang``; see granikv.serving).

    The server gets the cell's model (a ``config.json`` written from ``conf/model``; dummy weights),
    TP, ``--max-running-requests`` = B and the hardware preset's ``mem_fraction``,
    ``cuda_graph_max_bs``, ``chunked_prefill_size`` (and ``kv_budget_tokens`` as
    ``--max-total-tokens`` when the preset fixes one)."""

    launcher: str = "sglang.launch_server"   # python -m <launcher>; tests point it at a fake server
    attention_backend: str = "flashinfer"    # SGLang's --attention-backend (fa3 is its Hopper default; needs the full kernel wheel)
    host: str = "127.0.0.1"
    port: int = 0                            # 0 = a free port picked at start
    start_timeout_s: float = 900.0           # launch -> /health_generate answers 200 (SGLang captures prefill graphs for ~4 min)
    request_timeout_s: float = 3600.0        # one replay (warm-up or measured), first send -> last token
    # streamed chunks carry only the new token ids (--incremental-streaming-output): without it every chunk
    # repeats the whole output so far, O(n^2) JSON for the server's HTTP process and the client
    incremental_streaming: bool = True
    decode_log_interval: int = 40            # SGLang's default: one "Decode batch" log line (steps.jsonl) every 40 steps
    extra_args: list[str] = field(default_factory=list)   # appended verbatim to the server's command line
    # --radix-cache-backend: "" = SGLang's RadixCache; granikv = the plugin's HOT/COLD cache (its HOT
    # share is system.hot_fraction, passed as GRANIKV_HOT_FRACTION)
    radix_cache_backend: str = ""
    # the client names each request's shared prefix (custom_params.granikv_prefix_len = its shared_len);
    # the plugin's backends need it, SGLang's own ignore it
    send_prefix_len: bool = False

    @property
    def uses_plugin(self) -> bool:
        """Whether the server needs granikv.sglang_plugin loaded (a plugin attention or cache backend)."""
        return self.attention_backend in PLUGIN_ATTENTION or self.radix_cache_backend == "granikv"

    def __post_init__(self):
        _need(bool(self.launcher) and all(p.isidentifier() for p in self.launcher.split(".")),
              "system.server.launcher", f"'{self.launcher}' is not a python module path (e.g. sglang.launch_server)")
        _need(0 <= int(self.port) < 65536, "system.server.port", "must be in [0, 65535] (0 = pick a free port)")
        for k in ("start_timeout_s", "request_timeout_s"):
            _need(getattr(self, k) > 0, f"system.server.{k}", "must be > 0 seconds")
        _need(self.decode_log_interval >= 1, "system.server.decode_log_interval", "must be >= 1")
        _need(self.radix_cache_backend in RADIX_BACKENDS, "system.server.radix_cache_backend",
              f"'{self.radix_cache_backend}' not in {RADIX_BACKENDS} (\"\" = SGLang's own)")
        _need(not self.uses_plugin or self.send_prefix_len, "system.server.send_prefix_len",
              "must be true with a granikv plugin backend: the plugin learns each request's shared prefix from it")
        owned = {"--radix-cache-backend", "--model-path", "--tp-size", "--tp", "--port", "--host", "--max-running-requests",
                 "--attention-backend", "--mem-fraction-static", "--cuda-graph-max-bs", "--chunked-prefill-size",
                 "--load-format", "--skip-tokenizer-init", "--max-total-tokens", "--random-seed"}
        clash = sorted(a.split("=")[0] for a in self.extra_args if a.split("=")[0] in owned)
        _need(not clash, "system.server.extra_args", f"{clash} are set from the cell's config; change the "
              "config key instead (model, tp, workload.batch, hardware.*, system.server.*)")


@dataclass
class SystemConfig:
    """A system under test: storage layout x prefix-attention backend x dispatch policy."""

    name: str = "granikv"
    backend: str = "granikv"          # paged | cascade | hydragen | granikv
    hot_fraction: float = 0.2         # 0 = paged storage (every slot COLD)
    dispatch: str = "table"           # granikv only: table | table_one_class | dense_only | cascade_only | paged_only
    tensor_core_decode: str = "auto"  # auto = SGLang's rule (on when Hq/Hkv >= 4) | on | off
    # backend=cascade only, GPU path: multilevel = FlashInfer's MultiLevelCascadeAttentionWrapper;
    # composed = batch prefill over the common prefix + tensor-core decode of the rest + merge
    cascade_impl: str = "multilevel"
    # GPU path, how each step re-plans FlashInfer's decode wrappers: flashinfer = the wrapper's plan();
    # fast = FlashInfer's fast_decode_plan after the first plan(), as SGLang's FlashInfer backend
    # re-plans its decode graphs (granikv.attention.flashinfer_ops.plan_decode)
    decode_plan: str = "flashinfer"
    # GPU path, the kernel of GraniKV's dense prefix call: flashinfer = FlashInfer's single prefill;
    # cudnn / fa2 = torch's fused attention, GQA-packed (granikv.attention.sdpa_ops); our engine only
    dense_kernel: str = "flashinfer"
    engine: str = "granikv"           # granikv = our compact engine | sglang = a real SGLang server (system.server)
    server: Optional[ServerConfig] = None   # engine=sglang only
    # HOT/COLD boundary: static = fixed at hot_fraction (the paper) | dynamic = moves online over free
    # rows (granikv.kv.split_policy: grow on a HOT miss, shrink under COLD pressure), our engine only
    hot_split: str = "static"
    hot_min_fraction: float = 0.0     # dynamic: the smallest HOT region, a fraction of the KV budget
    hot_max_fraction: float = 0.5     # dynamic: the largest HOT region
    cold_watermark: float = 0.05      # dynamic: COLD free below this fraction makes HOT give back free rows

    def __post_init__(self):
        _need(self.engine in ENGINES, "system.engine", f"'{self.engine}' not in {ENGINES}")
        _need((self.server is not None) == (self.engine != "granikv"), "system.server",
              "is set exactly when system.engine names a server engine (engine=sglang needs a `server:` "
              "block, engine=granikv none)")
        if self.engine != "granikv" and self.server is not None:
            want = PLUGIN_ATTENTION.get(self.server.attention_backend, "paged")
            _need(self.backend == want, "system.backend",
                  f"engine={self.engine} runs system.server.attention_backend="
                  f"'{self.server.attention_backend}', which is backend={want}; set backend={want}")
            _need(self.server.radix_cache_backend == "granikv" or self.hot_fraction == 0.0, "system.hot_fraction",
                  "a HOT region in a server needs system.server.radix_cache_backend=granikv; set hot_fraction=0")
        _need(self.backend in BACKENDS, "system.backend", f"'{self.backend}' not in {BACKENDS}")
        check_split(self, lambda k: f"system.{k}")
        _need(self.cascade_impl == "multilevel" or self.backend == "cascade", "system.cascade_impl",
              f"'{self.cascade_impl}' applies to backend=cascade only (this system's backend is '{self.backend}')")
        _need(self.decode_plan == "flashinfer" or self.server is None or self.server.attention_backend in PLUGIN_ATTENTION,
              "system.decode_plan",
              "'fast' applies to our engine or to a granikv plugin server (system.server.attention_backend "
              f"granikv / granikv_cascade / hydragen); stock SGLang ('{self.server.attention_backend if self.server else ''}') "
              "plans its own decode: set decode_plan=flashinfer")
        _need(self.dense_kernel in DENSE_KERNELS, "system.dense_kernel", f"'{self.dense_kernel}' not in {DENSE_KERNELS}")
        _need(self.dense_kernel == "flashinfer" or (self.backend == "granikv" and self.engine == "granikv"),
              "system.dense_kernel", f"'{self.dense_kernel}' applies to backend=granikv in our engine (this system: "
              f"engine={self.engine}, backend={self.backend}); set dense_kernel=flashinfer")
        _need(self.dispatch in DISPATCH, "system.dispatch", f"'{self.dispatch}' not in {DISPATCH}")
        if self.hot_split == "dynamic":
            plugin_cache = self.server is not None and self.server.radix_cache_backend == "granikv"
            _need(self.backend == "granikv" and (self.engine == "granikv" or plugin_cache), "system.hot_split",
                  f"dynamic needs backend=granikv in our engine or in a server with the granikv radix cache "
                  f"(this system: engine={self.engine}, backend={self.backend}); set hot_split=static")
        _need(self.tensor_core_decode in ("auto", "on", "off"), "system.tensor_core_decode", "auto | on | off")


@dataclass
class WorkloadConfig:
    """Requests to serve: lengths, shared prefixes and arrival process (all seeded)."""

    kind: str = "synthetic"
    prefix_len: int = 256             # Lp: shared prefix tokens
    batch: int = 8                    # B: concurrent requests (synthetic: the number of requests)
    num_prefixes: int = 1             # k: distinct shared prefixes
    prefix_lens: Optional[list[int]] = None  # heterogeneous multi-prefix lengths (len == num_prefixes)
    suffix_len: int = 32              # unique tokens after the prefix (synthetic / multiprefix)
    output_len: int = 16              # generated tokens per request (synthetic / multiprefix)
    num_requests: Optional[int] = None  # default: batch (synthetic), 4 x batch (sharegpt)
    arrival: str = "burst"
    rate: float = float("inf")        # requests/s for poisson / gamma
    burstiness: float = 1.0           # gamma shape (1 = Poisson)
    sharegpt_lengths: Optional[str] = None  # path to the cached length file (default: shipped one)

    def __post_init__(self):
        _need(self.kind in WORKLOADS, "workload.kind", f"'{self.kind}' not in {WORKLOADS}")
        _need(self.arrival in ARRIVALS, "workload.arrival", f"'{self.arrival}' not in {ARRIVALS}")
        for k in ("prefix_len", "suffix_len"):
            _need(int(getattr(self, k)) >= 0, f"workload.{k}", "must be >= 0")
        for k in ("batch", "num_prefixes", "output_len"):
            _need(int(getattr(self, k)) >= 1, f"workload.{k}", "must be >= 1")
        _need(self.rate > 0, "workload.rate", "must be > 0 (use arrival=burst for all-at-once)")
        _need(self.burstiness > 0, "workload.burstiness", "must be > 0")
        if self.prefix_lens is not None:
            _need(len(self.prefix_lens) == self.num_prefixes, "workload.prefix_lens",
                  f"needs one length per prefix (num_prefixes={self.num_prefixes})")
            _need(all(int(x) >= 1 for x in self.prefix_lens), "workload.prefix_lens", "lengths must be >= 1")


@dataclass
class HardwareConfig:
    """Where a cell runs and with which engine limits (SGLang's defaults where it has them)."""

    name: str = "cpu"
    device: str = "cpu"               # cpu | cuda
    dtype: str = "float32"            # float32 on CPU, bfloat16 on GPU
    gpu_name: str = ""                # decision-table key, e.g. "NVIDIA H200"
    kv_budget_tokens: Optional[int] = None  # fixed KV budget; else mem_fraction of free memory
    kv_budget_per_model: Optional[dict[str, int]] = None  # preset budgets by model name (a100_40gb)
    mem_fraction: float = 0.85        # SGLang's mem_fraction_static analogue
    cuda_graph_max_bs: int = 256      # SGLang default on this GPU class
    # captured decode graphs kept at once (least recently replayed evicted first; 0 = no limit). A graph
    # is per (batch size, step structure); multi-prefix steps change structure as classes shrink
    cuda_graph_max_graphs: int = 128
    # a decode step whose graph key holds split-off prefix classes (GraniKV, HydraGen, SGLang-Cascade's
    # batch-global class) is captured at the N-th step of that structure and runs eagerly before, so
    # structures seen once (multi-prefix steps under eviction) cost one eager step, not a capture;
    # batch-size-only keys (SGLang default's; SGLang captures them at startup) at their first step.
    # 1 = capture at the first step of every structure (every cell before this option existed)
    cuda_graph_capture_at: int = 2
    chunked_prefill_size: int = 8192  # SGLang default
    max_running_requests: int = 1024
    gpu_memory_gib: float = 0.0       # per-GPU memory (0 = unknown); used to estimate the KV budget up front
    peak_tflops: float = 0.0          # measured bf16 dense peak (kernel_bench roofline)
    peak_tbps: float = 0.0            # measured HBM bandwidth
    decision_table: Optional[list[dict[str, Any]]] = None  # fitted by runners.calibrate
    # the SGLang plugin's graph rules, fitted on its captured decode step by runners.graph_step_bench
    # (granikv.attention.dispatch.plugin_table); the engine never reads them
    plugin_graph_table: Optional[list[dict[str, Any]]] = None
    overlap_schedule: bool = True     # SGLang's default: launch decode step t+1 before reading step t's tokens
    fused_ops: str = "auto"           # RMSNorm/RoPE/SiLU-mul as FlashInfer's fused kernels (SGLang's): auto = on CUDA | on | off
    # TP all-reduce: nccl (torch.distributed) | symm_one_shot (torch symmetric-memory one-shot kernel over
    # NVLink for messages up to allreduce_symm_max_mib, NCCL above; SGLang's custom all-reduce plays this role)
    allreduce: str = "nccl"
    allreduce_symm_max_mib: float = 8.0   # SGLang's custom all-reduce default limit (8 MiB)

    def check_gpu(self, actual: str) -> None:
        """Refuse to run this preset on a GPU of another model (``actual``: the device's name): it would
        run the preset's decision table and limits there and record the cell under the preset's name,
        where it pools with the preset's cells. A preset with an empty ``gpu_name`` runs anywhere."""
        _need(not (self.device == "cuda" and self.gpu_name) or actual.lower() == self.gpu_name.lower(),
              "hardware.gpu_name", f"the preset '{self.name}' is for '{self.gpu_name}', but this GPU is "
              f"'{actual}'; run it on a {self.gpu_name}, or pass hardware.gpu_name='{actual}' with a decision "
              "table fitted on this GPU (python -m runners.calibrate)")

    def __post_init__(self):
        _need(self.device in ("cpu", "cuda"), "hardware.device", "cpu | cuda")
        _need(self.fused_ops in ("auto", "on", "off"), "hardware.fused_ops", "auto | on | off")
        _need(self.dtype in ("float32", "bfloat16", "float16"), "hardware.dtype", "float32 | bfloat16 | float16")
        _need(0.0 < self.mem_fraction <= 1.0, "hardware.mem_fraction", "must be in (0, 1]")
        _need(self.kv_budget_tokens is None or self.kv_budget_tokens > 0, "hardware.kv_budget_tokens", "must be > 0")
        _need(self.cuda_graph_max_bs >= 0, "hardware.cuda_graph_max_bs", "must be >= 0 (0 = no CUDA graphs)")
        _need(self.cuda_graph_max_graphs >= 0, "hardware.cuda_graph_max_graphs", "must be >= 0 (0 = no limit)")
        _need(self.cuda_graph_capture_at >= 1, "hardware.cuda_graph_capture_at",
              "must be >= 1 (1 = capture a step structure at its first step)")
        _need(self.chunked_prefill_size > 0, "hardware.chunked_prefill_size", "must be > 0")
        _need(self.allreduce in ("nccl", "symm_one_shot"), "hardware.allreduce", "nccl | symm_one_shot")
        _need(self.allreduce != "symm_one_shot" or self.device == "cuda", "hardware.allreduce",
              "symm_one_shot needs hardware.device=cuda (use nccl; on CPU the TP group is gloo)")
        _need(self.allreduce_symm_max_mib > 0, "hardware.allreduce_symm_max_mib", "must be > 0")


@dataclass
class RunConfig:
    """One measured cell: the root config composed by Hydra from conf/config.yaml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    sweep_name: str = "adhoc"
    results_dir: str = "results/raw"
    seed: int = 0
    tp: int = 1
    rep: int = 0                      # repetition index (part of the cell id)
    warmup_requests: int = 0          # n: a warm-up pass of the first n requests, outputs n+1..2 (engine.warmup_requests), excluded from metrics
    force: bool = False               # rerun a cell whose metrics.json exists
    profile_steps: int = 0            # >0: torch.profiler trace of that many decode steps
    nvml: bool = True                 # sample NVML at ~10 Hz when a GPU is present
    nsys: bool = False                # re-run the cell under `nsys profile` when nsys is on PATH

    def __post_init__(self):
        _need(self.tp >= 1, "tp", "must be >= 1")
        _need(self.model.num_heads % self.tp == 0 and self.model.num_kv_heads % self.tp == 0, "tp",
              f"tp={self.tp} must divide num_heads={self.model.num_heads} and "
              f"num_kv_heads={self.model.num_kv_heads} of model '{self.model.name}'")


def register() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent).

    ``conf/config.yaml`` starts from ``run_schema`` and every group option from
    ``/<group>_schema@_here_``, so a YAML key that the dataclass lacks (or a value of the wrong type)
    is rejected when Hydra composes the config. The schemas are root configs, not options of their
    groups: Hydra's errors and ``--help`` offer only the YAML options (``model=tiny``, never
    ``model=model_schema``).
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    # ${len:${workload.prefix_lens}}: num_prefixes follows a swept list of prefix lengths
    OmegaConf.register_new_resolver("len", lambda xs: len(xs), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, node in (("model", ModelConfig), ("system", SystemConfig), ("workload", WorkloadConfig),
                        ("hardware", HardwareConfig)):
        cs.store(name=f"{group}_schema", node=node)


def to_run_config(cfg: Any) -> RunConfig:
    """A composed Hydra/OmegaConf config -> RunConfig (runs every ``__post_init__`` check)."""
    from omegaconf import OmegaConf

    keep = {k: cfg[k] for k in cfg if k not in ("sweep", "launcher", "hydra")}
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), keep)
    return OmegaConf.to_object(merged)


def options(group: str) -> list[str]:
    """The options of a config group: the names of ``conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_option(group: str, name: str, key: str) -> None:
    """Fail, naming ``key`` (a config key or a runner's flag) and the choices, when ``conf/<group>/<name>.yaml``
    does not exist."""
    _need(name in options(group), key, f"unknown {group} '{name}' (no conf/{group}/{name}.yaml); "
          f"choose one of {options(group)}")


@lru_cache(maxsize=256)
def _composed(config_name: str, overrides: tuple[str, ...]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register()
    outer = GlobalHydra.instance().hydra   # a Hydra app of this process (runners.run), set aside meanwhile
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides))
    except HydraException as e:
        raise ValueError(f"config error in {list(overrides)}: {e}") from e
    finally:
        if outer is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(outer)


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> Any:
    """``conf/<config_name>.yaml`` composed by Hydra with ``overrides`` (``model=llama3_8b``,
    ``hardware.kv_budget_tokens=2048``): the DictConfig a ``@hydra.main`` runner gets, for runners
    that take their own flags. A composition error (an unknown option or key) is a ValueError."""
    return copy.deepcopy(_composed(config_name, tuple(overrides)))


def run_config(overrides: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of a cell: ``conf/config.yaml`` composed with ``overrides`` (runs every check)."""
    return to_run_config(compose(overrides))


def system_config(name: str) -> SystemConfig:
    """The preset ``conf/system/<name>.yaml`` (a fresh copy)."""
    check_option("system", name, "system.name")
    return run_config([f"system={name}"]).system
