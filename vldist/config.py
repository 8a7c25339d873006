"""Typed job configuration: YAML job files, dotted command-line overrides, errors that name the key.

A job is `recipe` + sections. Every section but `model` is shared by all recipes; `model` is the
recipe's own pydantic class, so `--help` and validation know each recipe's keys.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from vldist.errors import ConfigError

# The built-in job files. In a checkout vldist/jobs is a link to the top-level jobs/ (the files
# users see and copy); a wheel holds the files themselves, so an installed vldist has them too.
PACKAGE_DIR = Path(__file__).resolve().parent
JOBS_DIR = PACKAGE_DIR / "jobs"


class Section(BaseModel):
    # extra="forbid" turns a typo in a key into an error instead of a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceConfig(Section):
    """One weighted training source of data.sources."""

    shards: str = Field(description="an indexed shard set (directory or URL) whose train split this source reads")
    weight: float = Field(1.0, gt=0, description="its share of the training samples, relative to the others'")
    name: str | None = Field(None, description="its name in metrics (default: the set's last path component)")

    @field_validator("shards")
    @classmethod
    def _no_credentials(cls, value, info):
        from vldist.store.credentials import refuse_credentials

        refuse_credentials(f"data.sources[].{info.field_name}", value)
        return value

    @property
    def label(self) -> str:
        return self.name or self.shards.rstrip("/").rsplit("/", 1)[-1]


class DataConfig(Section):
    shards: str = Field(
        "shards/synth",
        description="shard directory (manifest.json + <split>-*.tar), or its URL "
        "(s3://bucket/prefix, gs://..., https://host/prefix: any fsspec filesystem); the default, shards/synth, "
        "names the embedded set: a whole ./shards/synth, else $VLDIST_DATA_HOME/synth (default "
        "~/.cache/vldist/synth), built there on first use",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of the URL's fsspec filesystem (e.g. {endpoint_url: ...}); "
        "credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never from here",
    )
    retries: int = Field(
        8,
        ge=0,
        description="reading a shard set at a URL: tries again after a dropped, reset or "
        "cut connection (resuming at the byte reached) before the shard is skipped and counted",
    )
    cache_dir: str | None = Field(
        None,
        description="reading a shard set at a URL: keep each shard here once "
        "downloaded, once per node (node-local disk; off: every epoch reads the store)",
    )
    cache_max_gb: float = Field(100.0, gt=0, description="data.cache_dir's bound: least recently used shards go")
    build_if_missing: bool = Field(
        True,
        description="build an embedded set (shards/synth, shards/synth_pairs) the job reads when it is absent, "
        "once per machine in the data home ($VLDIST_DATA_HOME, default ~/.cache/vldist); false: the name is a "
        "path in the working directory like any other",
    )
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="weighted training sources, e.g. [{shards: shards/a, weight: 2}, {shards: s3://b/c, weight: 1}]: "
        "the main training stream mixes their train splits in these proportions, in every global batch (exactly "
        "over an exact epoch); data.shards stays the validation and test set (docs/distributed.md)",
    )
    train_split: str = "train"
    val_split: str = "val"
    test_split: str = "test"
    batch_size: int = Field(128, ge=1, description="global batch size (summed over ranks)")
    eval_batch_size: int = Field(250, ge=1)
    workers: int = Field(2, ge=0, description="loader worker processes per rank")
    shuffle_buffer: int = Field(2000, ge=0, description="samples held for shuffling (0: off)")
    resampled: bool = Field(
        True,
        description="draw shards with replacement (scales; epoch = a sample count); False: each sample once per epoch",
    )
    max_skipped_fraction: float = Field(
        0.2,
        ge=0,
        le=1,
        description="training stops, naming the shards, once more than this share of an epoch's samples were "
        "unreadable and skipped (1: never); fewer are skipped, counted and warned about (docs/bad-input.md)",
    )
    max_regions: int = Field(5, ge=1, description="regions per image after padding/truncation (K)")
    max_caption_len: int = Field(32, ge=3, description="tokens per caption incl. <start>/<end>")
    vocab_min_count: int = Field(
        1, ge=1, description="words seen fewer times in the train captions become <unk> (captioning papers: 5)"
    )

    @field_validator("sources")
    @classmethod
    def _distinct_names(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        labels = [s.label for s in sources]
        repeated = sorted({n for n in labels if labels.count(n) > 1})
        if repeated:
            raise ValueError(f"data.sources names {repeated} more than once: give each source a distinct name")
        return sources

    @field_validator("storage_options", "shards")
    @classmethod
    def _no_credentials(cls, value, info):
        from vldist.store.credentials import refuse_credentials

        refuse_credentials(info.field_name, value)
        return words_as_booleans(value) if info.field_name == "storage_options" else value


class TrainConfig(Section):
    epochs: int = Field(30, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (overrides epochs)")
    samples_per_epoch: int | None = Field(None, ge=1, description="default: the train split's size")
    grad_accumulation: int = Field(
        1,
        ge=1,
        description="micro-batches per optimizer step; each sees only its own hard negatives unless "
        "train.accumulate_negatives",
    )
    accumulate_negatives: bool = Field(
        False,
        description="with grad_accumulation: the cross-batch loss over the whole global batch (every micro-batch "
        "of every rank) by caching embeddings (GradCache: a second forward per micro-batch); docs/distributed.md",
    )
    optimizer: Literal["adam", "adamw"] = "adam"
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["step", "cosine"] = Field("step", description="step: the paper's decay; cosine: to 0")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 over this many steps")
    lr_decay_epochs: int = Field(
        15, ge=1, description="step schedule: multiply lr by lr_decay_factor every this many epochs"
    )
    lr_decay_factor: float = Field(0.1, gt=0, le=1)
    grad_clip: float | None = Field(2.0, gt=0, description="clip the global grad norm (None: off)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    log_every: int = Field(20, ge=1, description="print a progress line every N steps")
    validate_every: int = Field(1, ge=0, description="evaluate on val every N epochs and keep the best (0: never)")
    save_every_steps: int | None = Field(None, ge=1, description="also checkpoint every N steps (always at epoch ends)")
    keep_last: int = Field(2, ge=1, description="step checkpoints kept (the best is kept as well)")
    checkpoint_format: Literal["plain", "sharded"] = Field(
        "plain",
        description="plain: whole weights (model.safetensors) and optimizer in every checkpoint, written by "
        "rank 0; sharded: torch.distributed.checkpoint, each rank writes its part, whole weights only in the best and "
        "final checkpoints (Accelerate engine)",
    )
    async_checkpoints: bool = Field(
        False,
        description="write checkpoints in the background while training goes on; the state is copied first "
        "(Accelerate engine)",
    )
    resume: str | None = Field(
        None, description="'latest': newest good checkpoint of output.dir (error if none); 'auto': it if any; or a path"
    )
    stop_signals: list[str] = Field(
        ["SIGTERM", "SIGUSR1"],
        description="signals on which every rank finishes its step, checkpoints and exits 75 (docs/preemption.md)",
    )
    hang_timeout_s: float = Field(
        600.0, ge=0, description="no rank advanced this long: every rank names the stopped ones and exits 3 (0: off)"
    )
    straggler_ratio: float | None = Field(
        1.5, gt=1, description="name the slowest rank when its own step time is this many times the others' median"
    )
    replica_check_every: int = Field(
        100,
        ge=0,
        description="compare the ranks' replicas of the model after the first update and every N steps; "
        "ranks that differ stop the run, naming the tensor (exit 4; docs/distributed.md); 0: never",
    )
    negatives_group_size: int | None = Field(
        None,
        ge=1,
        description="cross-batch objectives take negatives from blocks of this many consecutive ranks "
        "(8: the GPUs of a node); None: the whole global batch (docs/distributed.md, what global negatives cost)",
    )

    compile: Literal["none", "model", "step"] = Field(
        "none",
        description="torch.compile: none (eager); model: the recipe's model, compiled in place (same checkpoints); "
        "step: forward and loss together, backward from the same graph (recipes and engines that allow it). "
        "Captions are padded to data.max_caption_len, batch sizes are dynamic: no recompilation after warm-up "
        "(docs/performance.md)",
    )
    compile_backend: str = Field(
        "inductor", description="torch.compile's backend: inductor (generated kernels), aot_eager (no codegen), ..."
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile's mode (inductor only): reduce-overhead replays compiled graphs as CUDA graphs "
        "where inductor can capture them (one launch each; no effect on CPU), max-autotune also times GEMM and "
        "kernel choices",
    )
    compile_dynamic: bool = Field(
        True,
        description="compile with dynamic shapes, so that a ragged last batch does not recompile; false: static "
        "shapes (quicker to compile, one recompilation per new batch size)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute the recipe's heavy blocks (reasoning layers, decoders, transformer layers, the "
        "generator) in the backward instead of keeping their activations: less memory, one more forward of "
        "those blocks per step; same losses and gradients, same checkpoints (docs/performance.md)",
    )

    profile_steps: str | None = Field(
        None,
        description="'A:B': record steps A to B (1-based, both included) with torch.profiler into "
        "<output.dir>/profile/ (a trace for Perfetto or TensorBoard; on CUDA a memory snapshot too) and print "
        "their top operators by self time (docs/observability.md)",
    )

    sample_log: bool = Field(
        False,
        description="write the identities of the samples each rank trains on, step by step, to "
        "<output.dir>/samples/rank-R.jsonl: an audit of exact epochs across resumes (docs/distributed.md)",
    )

    @field_validator("profile_steps")
    @classmethod
    def _step_window(cls, window: str | None) -> str | None:
        if window is not None:
            profile_window(window)  # raises ValueError saying what a window looks like
        return window

    @field_validator("stop_signals")
    @classmethod
    def _signal_names(cls, names: list[str]) -> list[str]:
        from vldist.training.stopping import signal_numbers

        signal_numbers(names)  # raises ValueError naming an unknown signal
        return names


class EngineConfig(Section):
    backend: Literal["accelerate", "deepspeed", "fsdp"] = Field(
        "accelerate",
        description="accelerate: DDP through Accelerate; deepspeed: DeepSpeed's engine with ZeRO; fsdp: PyTorch's "
        "FSDP2 (fully_shard), parameters, gradients and optimizer state sharded over the ranks",
    )
    fsdp_shard_size: int | None = Field(
        None,
        ge=1,
        description="backend=fsdp: hybrid sharding, slices within groups of this many consecutive ranks (a node) "
        "and replicas across the groups; must divide the number of ranks; None: shard over every rank",
    )
    deepspeed_config: str = Field(
        "jobs/deepspeed/zero2.json",
        description="backend=deepspeed: ZeRO settings file (jobs/deepspeed/zero{1,2,3}.json)",
    )
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = Field(
        "no",
        description="autocast on CUDA; on CPU, bf16 is autocast under engine.backend=accelerate (fast where the CPU "
        "computes bf16 natively, AMX or AVX512-BF16: docs/performance.md) and everything else trains in fp32; "
        "auto: bf16 on a CUDA card from Ampere on and on a CPU with AMX or AVX512-BF16, else no",
    )
    tf32: bool = Field(
        True,
        description="CUDA only: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (about 1e-3 relative "
        "error per product); false: full fp32, e.g. to compare with an earlier run (docs/performance.md)",
    )
    sync_batchnorm: bool = Field(False, description="BatchNorm statistics over every rank's rows (exact multi-rank)")
    timeout_s: float = Field(
        1800.0, gt=0, description="torch.distributed's timeout: a collective waiting longer fails (the last resort)"
    )

    @field_validator("fsdp_shard_size")
    @classmethod
    def _hybrid_sharding_is_fsdp(cls, value, info):
        if value is not None and info.data.get("backend") != "fsdp":
            raise ValueError(
                f"engine.fsdp_shard_size={value} is a setting of engine.backend=fsdp (this job runs "
                f"{info.data.get('backend')}); set engine.backend=fsdp or leave fsdp_shard_size unset"
            )
        return value


class EvalConfig(Section):
    split: str = Field("test", description="split evaluated at the end of training")
    baseline: bool = Field(True, description="also evaluate the untrained model, for comparison")
    fold_size: int = Field(1000, ge=1, description="images per fold of the 5-fold protocol")
    max_captions_per_image: int | None = Field(
        5, ge=1, description="use at most this many captions of each image (COCO/Flickr30K: the first 5); None: all"
    )
    beam_size: int = Field(3, ge=1, description="captioning: beam width of generation (1: greedy)")
    max_generated_len: int | None = Field(
        None, ge=2, description="captioning: most tokens generated, <end> included (default: data.max_caption_len - 1)"
    )
    self_retrieval_pool: int = Field(
        1000, ge=1, description="captioning: images scored against each generated caption (paper: 5000)"
    )
    examples: int = Field(5, ge=0, description="captioning: generated captions printed beside their references")
    meteor_timeout: float = Field(600.0, gt=0, description="seconds METEOR may take before it is ended (reported n/a)")
    meteor: bool = Field(
        True,
        description="captioning: score METEOR (its Java process takes ~6 s of CPU and a 2 GB heap to start; false: n/a)",
    )


class OutputConfig(Section):
    dir: str = Field("runs/{recipe}", description="where checkpoints and metrics go")
    checkpoint_dir: str | None = Field(
        None,
        description="a store URL (s3://bucket/prefix, any fsspec filesystem) that every committed checkpoint "
        "is uploaded to (COMPLETE last) and that resuming reads; they are still written to <dir>/checkpoints first",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of checkpoint_dir's fsspec filesystem (e.g. {endpoint_url: ...}); "
        "credentials come from the environment, never from here",
    )

    @field_validator("checkpoint_dir", "storage_options")
    @classmethod
    def _a_store_without_credentials(cls, value, info):
        from vldist.store.credentials import refuse_credentials
        from vldist.store.location import is_url

        refuse_credentials(info.field_name, value)
        if info.field_name == "storage_options":
            return words_as_booleans(value)
        if info.field_name == "checkpoint_dir" and value is not None and not is_url(value):
            raise ValueError(
                f"'{value}' is not a URL; output.checkpoint_dir names a store (s3://bucket/prefix). "
                "For a local directory set output.dir: checkpoints go to <output.dir>/checkpoints"
            )
        return value


class MetricsConfig(Section):
    enabled: bool = Field(True, description="serve Prometheus metrics from every rank")
    host: str = Field(
        "127.0.0.1",
        description="address the metrics endpoints bind to (node: this node's address towards the "
        "rendezvous host, for a Prometheus on another node; 0.0.0.0: every interface)",
    )
    port: int = Field(9400, ge=1, le=65535, description="rank r serves on port + local rank r")
    job: str = Field("{recipe}", description="the `job` label of every series")
    linger_seconds: float = Field(0.0, ge=0, description="keep serving this long after training, for a last scrape")
    targets_dir: str | None = Field(
        None,
        description="rank 0 writes every rank's endpoint to <dir>/targets.json for Prometheus file_sd "
        "(Ray: <run dir>/prometheus)",
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        [], description="experiment trackers rank 0 writes beside Prometheus (docs/observability.md, Trackers)"
    )
    trackers_dir: str | None = Field(None, description="where the trackers write (default: <output dir>/trackers)")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="online uploads as it goes (WANDB_API_KEY from the environment); offline: wandb sync later",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow server or store (default: a file store in <trackers dir>/mlruns); "
        "credentials from the environment (MLFLOW_TRACKING_TOKEN, ..._USERNAME/_PASSWORD)",
    )

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _no_uri_credentials(cls, value):
        from vldist.store.credentials import url_credentials

        found = url_credentials(value) if value else None
        if found:
            raise ValueError(
                f"the URL carries {found}, and config.yaml, metrics.json and checkpoints record the "
                "configuration: set MLFLOW_TRACKING_TOKEN (or MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD) in the environment instead, where MLflow's client reads them"
            )
        return value


class RayConfig(Section):
    address: str | None = Field(None, description="Ray cluster address (default: RAY_ADDRESS, else a local head)")
    num_workers: int | str = Field(
        2,
        description="training workers (ranks), one process each; or 'MIN:MAX' for elastic training: Ray Train starts "
        "with as many as it gets, at least MIN, and after a lost worker carries on with those left",
    )
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float | Literal["auto"] = Field(
        "auto", description="auto: 1 when the cluster has GPUs, else 0 (CPU workers with gloo)"
    )
    storage_path: str = Field(
        "~/ray_results",
        description="where the run directory goes: shared by every node (NFS, a bucket mount), or each "
        "node's own disk when output.checkpoint_dir is a store URL (plain checkpoints under Accelerate)",
    )
    name: str = Field("{recipe}", description="run directory under storage_path; checkpoints and metrics.json go there")
    max_failures: int = Field(2, ge=-1, description="worker-group restarts after a failure (-1: no limit)")

    @field_validator("num_workers")
    @classmethod
    def _worker_count_or_range(cls, value):
        low, high = worker_range(value)
        return low if low == high else f"{low}:{high}"

    @property
    def worker_range(self) -> tuple[int, int]:
        """(fewest, most) workers; the same number twice for a fixed group."""
        return worker_range(self.num_workers)


def profile_window(window: str) -> tuple[int, int]:
    """'A:B' -> (A, B): the first and last step profiled, 1 <= A <= B."""
    first, sep, last = window.partition(":")
    if sep and first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ValueError("not a window of steps: write A:B with 1 <= A <= B, e.g. 5:8")


def worker_range(value) -> tuple[int, int]:
    """ray.num_workers as (fewest, most): 4 -> (4, 4), '2:8' -> (2, 8); anything else a ValueError."""
    try:
        parts = (
            [int(value)] * 2
            if isinstance(value, int) or ":" not in str(value)
            else [int(v) for v in str(value).split(":")]
        )
    except ValueError:
        parts = []
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise ValueError(f"'{value}' is neither a number of workers (>= 1) nor a range MIN:MAX with 1 <= MIN <= MAX")
    return parts[0], parts[1]


class JobConfig(Section):
    recipe: str
    seed: int = 0
    launcher: Literal["auto", "local", "ray"] = Field(
        "auto", description="ray: fan out over a Ray cluster (Ray Train); auto: ray inside `ray job submit`, else local"
    )
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    eval: EvalConfig = EvalConfig()
    output: OutputConfig = OutputConfig()
    metrics: MetricsConfig = MetricsConfig()
    ray: RayConfig = RayConfig()
    model: Section = Section()

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir.format(recipe=self.recipe))

    def __reduce__(self):
        # job_config_class makes its classes at run time, where pickle cannot find them by name: a
        # job config travels (to loader workers started by a fork server) as its recipe's model
        # class and its values
        return _rebuilt_job_config, (type(self.model), self.model_dump())


def _rebuilt_job_config(model_config: type[Section], values: dict) -> JobConfig:
    return job_config_class(model_config).model_validate(values)


@functools.cache
def job_config_class(model_config: type[Section]) -> type[JobConfig]:
    """The JobConfig whose `model` section is a recipe's own config class (one class per recipe)."""
    return create_model(f"{model_config.__name__}Job", __base__=JobConfig, model=(model_config, model_config()))


# --------------------------------------------------------------------------- loading


# Installed packages add job files through this entry-point group: `name = "package"` makes the
# package's jobs/ folder a place where `python -m vldist.train <job>` finds <job>.yaml by name.
JOBS_GROUP = "vldist.jobs"


def plugin_job_dirs() -> list[Path]:
    """The jobs/ folders of the packages that declare one (entry-point group vldist.jobs); the
    packages are located, not imported."""
    import importlib.util
    from importlib.metadata import entry_points

    found = []
    for entry in entry_points(group=JOBS_GROUP):
        spec = importlib.util.find_spec(entry.value)
        found += [Path(location) / "jobs" for location in (spec.submodule_search_locations or [])] if spec else []
    return found


def job_folders() -> list[Path]:
    """Where job files are found by name, in order: a user's own jobs/ in the working directory,
    the built-in ones, the plugins'."""
    return [Path("jobs"), JOBS_DIR, *plugin_job_dirs()]


def find_job_file(name_or_path: str) -> Path:
    """`vsrn` -> jobs/vsrn.yaml; a path is taken as it is."""
    candidates = [Path(name_or_path), *(folder / f"{name_or_path}.yaml" for folder in job_folders())]
    for path in candidates:
        if path.is_file():
            return path
    names = list_job_files()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    raise ConfigError(
        f"no job file for '{name_or_path}'"
        + (f". Did you mean '{close[0]}'?" if close else "")
        + f" Looked at {', '.join(str(c) for c in candidates)}. Job files: {', '.join(names) or 'none'}."
    )


def list_job_files() -> list[str]:
    """The job files found by name: vldist's own, the plugins', and those in ./jobs."""
    return sorted({p.stem for folder in job_folders() for p in folder.glob("*.yaml")})


class YamlLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader without its base-60 numbers and with YAML 1.2's booleans. YAML 1.1
    reads `1:2` as 62 and `1:30.5` as 90.5, while `ray.num_workers=1:2` means the range; and it
    reads `no`, `yes`, `on` and `off` as booleans, so `engine.mixed_precision=no` (a choice named
    "no") failed as `False`. Only true/false are booleans here; a boolean setting still takes
    yes/no/on/off, which pydantic reads as booleans. Everything else resolves as before."""


_BOOLEAN_WORDS = {
    word: value
    for value, words in ((True, "yes on"), (False, "no off"))
    for w in words.split()
    for word in (w, w.title(), w.upper())
}


def words_as_booleans(options):
    """storage_options go to an fsspec filesystem untyped, so nothing there reads yes/no/on/off as
    the booleans YAML 1.1 made them (as a boolean setting does): a filesystem that tests
    `if anon:` would take the word "no" as true. They become booleans here, at any depth."""
    if isinstance(options, dict):
        return {key: words_as_booleans(value) for key, value in options.items()}
    if isinstance(options, list):
        return [words_as_booleans(value) for value in options]
    return _BOOLEAN_WORDS.get(options, options) if isinstance(options, str) else options


_RESOLVED_OTHERWISE = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _RESOLVED_OTHERWISE]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str):
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['train.lr=1e-3', 'model.rrr_layers=2'] -> nested dict; values parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. data.batch_size=64)")
        try:
            value = load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw  # not a YAML scalar (e.g. '{recipe}-a'): the string as typed
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
        node[leaf] = value
    return nested


def deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def updated(config: JobConfig, update: dict) -> JobConfig:
    """`config` with `update` (nested sections) merged in, validated again (a plain model_copy
    would skip validation): how a recipe derives the configs of its stages."""
    return type(config).model_validate(deep_merge(config.model_dump(), update))


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    return data


def validate(raw: dict[str, Any], config_class: type[JobConfig]) -> JobConfig:
    try:
        return config_class.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(err, config_class)) from None


def describe_errors(err: ValidationError, config_class: type[BaseModel]) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(unknown_key_message(key, config_class))
        elif key.startswith("data.storage_options"):  # may hold a credential: never echoed
            lines.append(f"{key}: {e['msg']}")
        elif key == "data.shards" and isinstance(e.get("input"), str):  # a URL: without its credentials
            from vldist.store.location import redact

            lines.append(f"{key}: {e['msg']} (got {redact(e['input'])!r})")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid job config:\n  " + "\n  ".join(lines)


def unknown_key_message(key: str, config_class: type[BaseModel]) -> str:
    *parents, leaf = key.split(".")
    section: type[BaseModel] = config_class
    for part in parents:
        field = section.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            break
        section = field.annotation
    valid = list(section.model_fields)
    where = f" in '{'.'.join(parents)}'" if parents else ""
    hint = difflib.get_close_matches(leaf, valid, n=1)
    suggestion = f" Did you mean '{'.'.join([*parents, hint[0]])}'?" if hint else ""
    return f"unknown key '{key}'.{suggestion} Valid keys{where}: {', '.join(valid)}"


def describe_keys(config: BaseModel, prefix: str = "") -> list[str]:
    """'section.key = default  # description' lines for --help."""
    lines = []
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            lines.extend(describe_keys(value, f"{prefix}{name}."))
        else:
            doc = f"  # {field.description}" if field.description else ""
            lines.append(f"{prefix}{name} = {value!r}{doc}")
    return lines


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
