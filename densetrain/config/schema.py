"""The configuration tree's sections other than ``data``: model, optimizer, schedule, stages, training,
checkpoints, logging, evaluation, and the whole :class:`Config`. Each field's docstring (the string
literal right below it) is its ``--help-config`` text."""

from __future__ import annotations

from dataclasses import dataclass, field

from densetrain.config.data import DataConfig
from densetrain.config.recovery import FaultConfig, GuardConfig, HealthConfig, ProbeConfig, WatchdogConfig


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling for context extension, applied to the fp32 inverse frequencies
    (formulas and sources in densetrain/model/rope.py)."""

    type: str = "none"
    """'none'; 'linear' (position interpolation, Chen et al. 2023: every frequency / factor); 'llama3' (Llama
    3.1: wavelengths above original_max_position_embeddings / low_freq_factor divided by factor, below
    original / high_freq_factor unchanged, smooth in between); 'yarn' (Peng et al. 2023: NTK-by-parts ramp
    over beta_fast..beta_slow rotations plus an attention temperature). On a stage, '' (the stage default)
    inherits the previous stage's scaling."""
    factor: float = 1.0
    """Context extension factor s (new context / original_max_position_embeddings); >= 1."""
    original_max_position_embeddings: int = 8192
    """Context length L (tokens) the unscaled frequencies were trained for (llama3, yarn)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than L / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than L / high_freq_factor are unchanged (must exceed low_freq_factor)."""
    beta_fast: float = 32.0
    """yarn: dimensions turning more than beta_fast times over L keep their frequency."""
    beta_slow: float = 1.0
    """yarn: dimensions turning fewer than beta_slow times over L are divided by factor."""
    attention_factor: float = 0.0
    """yarn: multiplier of cos and sin (so of every q.k by its square); 0 means 0.1 ln(factor) + 1 (YaRN eq. 22)."""


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder (pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases)."""

    vocab_size: int = 8192
    """Vocabulary size (tokens). Must be >= the tokenizer's vocabulary; extra rows are never targets."""
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = d_model / n_heads."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads. Equal to n_heads is MHA."""
    d_ff: int = 768
    """Hidden width of the SwiGLU MLP (each of the gate and up projections is d_model x d_ff)."""
    rope_theta: float = 10000.0
    """RoPE base frequency for the first stage; a stage may change it (long-context extension)."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE frequency scaling of the first stage (e.g. { type = "llama3", factor = 8.0 }); a stage may change it."""
    document_mask: bool = True
    """Document-masked attention in long stages: in every stage whose seq_len exceeds train.seq_len, each
    token attends only to earlier tokens of its own document (documents end at EOS), not to the unrelated
    documents packed before it (Llama 3 report, sec. 3.2). false: never, except stages that set document_mask."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    init: str = "standard"
    """Initialisation: 'standard' (normal std init_std, residual projections / sqrt(2 n_layers)) or 'mup'."""
    init_std: float = 0.02
    """Std of the normal init for matmul weights and embeddings (GPT-2 / Llama convention)."""
    base_d_model: int = 256
    """μP base width: width_mult = d_model / base_d_model (only read when init = 'mup')."""
    qk_norm: bool = False
    """Normalise queries and keys to unit RMS per head after RoPE (parameter-free RMSNorm; QK-norm of Henry et
    al. 2020 and Dehghani et al. 2023, as nanochat and OLMo 2 use it): attention logits stay bounded, which
    tolerates larger learning rates. Off: the Llama architecture (Meta's checkpoints have no QK-norm)."""
    logit_softcap: float = 0.0
    """If > 0, output logits become logit_softcap * tanh(logits / logit_softcap) (Gemma 2, Team et al. 2024;
    nanochat uses 15): bounded logits, no runaway confidence early in training. 0: off (Llama)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class OptimConfig:
    """AdamW (default) or Muon + AdamW, weight decay on 2-D matmul weights only, global-norm clipping,
    optional z-loss."""

    name: str = "adamw"
    """'adamw': AdamW for every parameter. 'muon': torch.optim.Muon (Jordan et al. 2024,
    https://kellerjordan.github.io/posts/muon/) for the hidden matrices (attention wq/wk/wv/wo, MLP w1/w2/w3)
    with the muon_* fields, AdamW (peak_lr, beta1, beta2, ...) for embeddings, output head and norm gains, the
    split of modded-nanogpt and nanochat. The schedule and stage lr_mult/re-warmups scale both groups alike."""

    peak_lr: float = 1e-3
    """Learning rate at the end of warmup."""
    min_lr: float = 1e-4
    """Final learning rate of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to 2-D matmul weights (not norms, not embeddings by default)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the embedding matrix (with model.tie_embeddings: the one matrix shared with the
    output head, which is otherwise not decayed either)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss (log^2 of the softmax normaliser, PaLM 2022); 0 disables."""
    muon_lr: float = 0.02
    """name='muon': peak learning rate of the hidden matrices (the schedule's shape, scaled by muon_lr / peak_lr).
    torch's Muon further multiplies it per matrix by muon_adjust_lr's shape factor. 0.02 is nanochat's matrix_lr
    and torch.optim.Muon's documented example."""
    muon_momentum: float = 0.95
    """name='muon': momentum of the Muon buffer (Jordan et al. 2024 and torch.optim.Muon default)."""
    muon_nesterov: bool = True
    """name='muon': Nesterov momentum (torch.optim.Muon default)."""
    muon_weight_decay: float = 0.0
    """name='muon': decoupled weight decay of the hidden matrices; torch's Muon multiplies each matrix by
    1 - lr * muon_weight_decay per step (lr of that step, so it follows the schedule). 0 as in the Muon speedruns
    (Jordan et al. 2024); Moonshot (Liu et al. 2025, "Muon is Scalable for LLM Training") use 0.1 at scale."""
    muon_ns_steps: int = 5
    """name='muon': Newton-Schulz iterations that orthogonalise each update (Jordan et al. 2024: 5)."""
    muon_adjust_lr: str = "original"
    """name='muon': per-matrix lr factor of torch.optim.Muon for an A x B (out x in) matrix: 'original'
    sqrt(max(1, A / B)) (Jordan's implementation), 'match_rms_adamw' 0.2 sqrt(max(A, B)) (Liu et al. 2025: an
    update RMS like AdamW's, so AdamW's lr and weight decay can be reused)."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule lr(step): linear warmup, then cosine / WSD / constant."""

    kind: str = "cosine"
    """'cosine' (to min_lr at the last step), 'wsd' (warmup-stable-decay) or 'constant'."""
    unit: str = "steps"
    """What progress is counted in: 'steps' (iterations, skipped ones included) or 'tokens' (tokens consumed;
    stage starts, warmup_fraction, decay_fraction and the lr curve are then fractions of the run's tokens,
    which differs from steps only when stages have different batch_tokens)."""
    warmup_steps: int = -1
    """Warmup length in optimizer steps (unit='tokens': the tokens of the first warmup_steps steps); -1 means
    warmup_fraction of the total (at least one step)."""
    warmup_fraction: float = 0.005
    """Warmup length as a fraction of total steps (or of total tokens when unit='tokens') when warmup_steps is -1."""
    decay_fraction: float = 0.15
    """WSD: fraction of total steps (or of total tokens when unit='tokens') spent in the final decay."""
    decay_shape: str = "linear"
    """WSD decay shape: 'linear', 'cosine' or '1-sqrt' (Hägele et al. 2024)."""


@dataclass
class StageConfig:
    """One row of the stage table. Unset fields (0 / empty) inherit from the previous stage."""

    name: str = ""
    """Stage name, shown in logs, metrics and the report."""
    start: float = 0.0
    """Start as a fraction of train.steps, or of the run's tokens when schedule.unit='tokens' (the first stage must
    start at 0)."""
    mix: dict[str, float] = field(default_factory=dict)
    """Source name -> sampling weight (normalised); empty inherits the previous stage's mix."""
    seq_len: int = 0
    """Sequence length in tokens; 0 inherits. Tokens per step stay as batch_tokens (fewer, longer sequences)."""
    batch_tokens: int = 0
    """Global batch in tokens per optimizer step (sequences per step = batch_tokens / seq_len, must divide); 0
    inherits; the first stage's default is train.batch_size * train.seq_len."""
    rope_theta: float = 0.0
    """RoPE base for this stage; 0 inherits."""
    rope_scaling: RopeScalingConfig = field(default_factory=lambda: RopeScalingConfig(type=""))
    """RoPE frequency scaling for this stage (model.rope_scaling keys); type '' inherits, 'none' switches it off."""
    document_mask: bool = False
    """Document-masked attention in this stage even if it is not longer than train.seq_len (not inherited);
    longer stages have it whenever model.document_mask is true."""
    lr_mult: float = 1.0
    """Multiplier on the scheduled learning rate during this stage (not inherited)."""
    rewarmup_steps: int = 0
    """Re-warm the lr over the stage's first N steps: the k-th step (0-based) uses scheduled lr * (k+1)/N (Gupta et al.
    2023); 0 disables; not inherited; must be 0 on the first stage."""
    parallel: dict[str, int | float | str | bool] = field(default_factory=dict)
    """This stage's own parallel layout: keys of [parallel] (e.g. { cp = 16, dp_shard = 8 }); unset keys take
    [parallel]'s (not the previous stage's). The degrees must multiply to the world size. At the first step of a
    stage whose layout differs from the one in force the run checkpoints, rebuilds the mesh, the model's parallel
    wrappers and the optimizer on the new layout and reloads the checkpoint resharded, in the same processes
    (Llama 3 405B: TP 8 / PP 16 for 8K, CP 16 for 128K; Llama 3 report, Table 4). {} runs [parallel]."""


@dataclass
class TrainConfig:
    """The training loop."""

    run_dir: str = "runs/default"
    """Run directory: resolved config, checkpoints, metrics, TensorBoard events, report."""
    steps: int = 100
    """Total optimizer steps."""
    seq_len: int = 256
    """Sequence length (tokens) of the first stage."""
    batch_size: int = 16
    """Sequences per optimizer step at train.seq_len (global, across all ranks)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward per rank at train.seq_len; grad accumulation is derived."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu' or 'cuda'."""
    dtype: str = "auto"
    """Autocast dtype: 'auto' (bf16 on GPU; on a CPU bf16 where it has AVX512-BF16/AMX-BF16 and its bf16 matmuls
    measure >= 1.3x its fp32 ones at start, else fp32: densetrain/model/precision.py; a resume keeps the dtype
    its checkpoint was trained in), 'bf16' or 'fp32';
    parameters, gradients and AdamW state stay fp32. An fp32 run ('fp32', or 'auto' resolved to it) also keeps
    the foreach AdamW kernel (the recorded golden trajectory); otherwise the fused kernel is used."""
    compile: bool = False
    """Wrap the model with torch.compile."""
    seed: int = 0
    """Seed of model init and of all training randomness."""
    threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    keep_freed_memory: bool = True
    """CPU with glibc: malloc keeps freed memory for reuse instead of unmapping every tensor over 32 MiB (each
    fresh one, e.g. a step's logits, then cost a page fault per 4 KiB: 34k faults, ~10% of a bf16 step of the
    13.8M benchmark shape). The process's memory stays at its peak; false keeps glibc's default."""
    reset_positions: bool = True
    """With document masking, restart RoPE positions at 0 at each document in the window (false: positions
    count from the window start)."""
    gc_freq: int = 50
    """Python's automatic garbage collection is off while training; one generation-1 collection runs every
    ``gc_freq`` optimizer steps, a full one every 20 of those (torchtitan's ``training.gc_freq``): collections,
    a full one ~0.27 s at the 13.8M benchmark shape, run after an optimizer step, at the same step on every
    rank, instead of anywhere inside steps. 0 keeps Python's automatic collection."""
    max_nonfinite_steps: int = 10
    """Stop with an error after this many consecutive steps with a non-finite loss or gradient."""
    resume: str = ""
    """'auto': continue from the run directory's newest complete checkpoint when it has one, start fresh when it
    has none, refuse when it holds another run's config.toml: the same command restarts a job (torchrun
    --max-restarts, a Slurm requeue). '' (the default): a fresh start refuses a used run directory (--resume)."""


@dataclass
class CheckpointConfig:
    """Checkpointing and retention."""

    every: int = 50
    """Save every N optimizer steps (and at the end); 0 saves only at the end."""
    keep: int = 3
    """Keep the newest N complete checkpoints (older ones are deleted); 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save, on a gloo group of its
    own): a save blocks only while the state is copied to CPU memory (about one more copy of the model and
    optimizer state in RAM); the completion marker follows when the write finished; at most one in flight."""
    dir: str = ""
    """Where checkpoints are kept besides the run directory: '' (only RUN_DIR/checkpoints), or a URL such as
    s3://bucket/run1/checkpoints (any fsspec protocol; `pip install 'densetrain[s3]'`) or another folder. Each
    checkpoint is written to RUN_DIR/checkpoints first, then uploaded with its COMPLETE marker last; retention
    deletes there too; --resume fetches the newest one the run directory lacks; eval/export take the URL."""


@dataclass
class LoggingConfig:
    """Metrics sinks."""

    every: int = 1
    """Console line every N steps (metrics.jsonl and TensorBoard get every step)."""
    mfu_every: int = 10
    """Compute mfu and memory every N steps (and at the first and last step); memory is the peak since the
    previous sample (:func:`densetrain.metrics.memory_stats`)."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for mfu; 0 measures it once with a matmul probe at start."""
    tensorboard: bool = True
    """Write TensorBoard event files under RUN_DIR/tb."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`; imported only when on): the same metrics and events
    as TensorBoard; WANDB_MODE=offline writes under RUN_DIR/wandb without network (`wandb sync` uploads it)."""
    wandb_project: str = "densetrain"
    """W&B project of the run (logging.wandb)."""
    wandb_name: str = ""
    """W&B display name of the run; '' = the run directory's name. --resume continues the same W&B run."""


@dataclass
class EvalConfig:
    """In-loop evaluation."""

    every: int = 50
    """Validation loss every N steps (and at the end); 0 only at the end."""
    max_batches: int = 8
    """Validation micro-batches per source per evaluation."""
    tasks: str = ""
    """Downstream multiple-choice tasks run in the loop: comma list or group ('light', 'all'), 'task:k' for k
    shots (e.g. 'arc_challenge_mc:5', reported as arc_challenge_mc_5shot); '' disables."""
    tasks_every: int = 0
    """Run eval.tasks every N steps (and at the end); 0 only at the end."""
    tasks_limit: int = 200
    """Examples per task for in-loop evaluation (the first N rows, a fixed subset); 0 = all."""
    final_tasks: str = ""
    """Tasks evaluated once after the last step (e.g. 'all'); '' disables."""
    final_limit: int = 0
    """Examples per task for final_tasks; 0 = all."""
    position_buckets: list[int] = field(default_factory=lambda: [0, 256, 1024])
    """Validation loss by position in the document (densetrain/evals/position_loss.py), before each stage that
    is longer than train.seq_len and at the end: lower edges of the buckets in tokens, increasing from 0 ([0,
    256, 1024] reports 0-255, 256-1023, 1024+); [] disables."""
    samples: int = 0
    """Greedy sample tokens per source printed and saved in summary.json at the end of the schedule (the
    prompt is the start of the source's first held-out document); 0 disables."""
    position_len: int = 0
    """Tokens scored per long document by the position-bucket evaluation; 0 = the longest stage's seq_len."""
    position_docs: int = 16
    """Documents per long-document source (data.sources[i].long_docs) scored by the position-bucket evaluation."""
    ladder: str = ""
    """A scaling ladder directory (densetrain ladder; its fit.json from densetrain ladder fit): the run's first lines,
    summary.json and report give the predicted final val loss and bpb with an interval, and each validation is
    compared with the run's predicted curve for its own lr schedule (train/watch/curve.py); '' disables."""
    off_curve_patience: int = 3
    """An off_curve event when this many validations in a row are above their band (per source and overall;
    train/watch/curve.py)."""
    off_curve_margin: float = 0.0
    """The off_curve band, as a fraction of the loss; 0 = from the fits (3 times the robust scale of their
    relative residuals, at least 0.01; train/watch/curve.py)."""


@dataclass
class ParallelConfig:
    """How the processes of a job split the work: one torch.distributed DeviceMesh (pp, dp_replicate, dp_shard, cp,
    tp), row-major, pp outermost, tp innermost (the fastest link). pp * dp_replicate * dp_shard * cp * tp = world
    size."""

    dp_replicate: int = -1
    """Data-parallel replicas: DDP when dp_shard = tp = 1, else the replicate dimension of HSDP; -1 fills the world
    size."""
    dp_shard: int = 1
    """Data-parallel shards: FSDP2 fully_shard of parameters, gradients and optimizer state over this many ranks; -1
    fills the world size."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-style: q/k/v and gate/up column-wise, o/down row-wise); must divide
    model.n_kv_heads, model.d_ff and model.vocab_size; -1 fills."""
    cp: int = 1
    """Context-parallel degree: each sequence split along time over this many ranks (two load-balanced chunks
    each; K/V all-gathered in attention); must divide every stage's seq_len by 2 * cp; -1 fills."""
    sequence_parallel: bool = False
    """Under tp > 1, run the norms and the residual stream between blocks on seq_len / tp tokens per rank (torch's
    SequenceParallel; reduce-scatter + all-gather instead of all-reduce). Every forward's length must then be a
    multiple of tp: every seq_len, and no evaluation that scores or generates texts of any length (eval.tasks,
    eval.final_tasks, eval.samples); loss evaluations run."""
    loss_parallel: bool = True
    """Under tp > 1, the training cross-entropy is vocabulary-parallel (torch's loss_parallel): each rank computes the
    logits of its vocabulary slice and no rank gathers them; false gathers them (the column-wise head's output)."""
    activation_checkpointing: str = "none"
    """Recompute activations in the backward per block: 'none', 'full' (keep only each block's input) or 'selective'
    (keep matmul and attention outputs, recompute norms and pointwise ops)."""
    compile_blocks: bool = False
    """torch.compile each transformer block separately (after tensor parallel and activation checkpointing, before
    FSDP2)."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into this many stages (the embedding and the output head each count
    as one layer), outermost mesh dimension; must divide the world size (densetrain/parallel/pipeline.py)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining): 'gpipe' (all forwards, then all backwards: every micro-batch's
    activations held), '1f1b' (at most pp micro-batches in flight) or 'interleaved_1f1b' (pp_virtual_stages stages
    per rank: a bubble pp_virtual_stages times smaller, more point-to-point messages)."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank; >= 2 only with pp_schedule = 'interleaved_1f1b' (rank r holds stages r, r + pp,
    ...)."""
    pp_microbatches: int = 0
    """Micro-batches (of micro_batch_size rows) per pipeline schedule call; 0: the fewest of at least pp that keep the
    bubble (pp - 1) / (pp_virtual_stages * (microbatches + pp - 1)) under 15%, capped by the micro-batches a rank has.
    Fewer than pp is refused. A rank's batch runs as batch / (dp * micro_batch_size * pp_microbatches) schedule
    calls."""
    pp_layers_per_stage: int = 0
    """Layers per pipeline stage, the embedding and the output head counted as one layer each; 0: as even as possible
    (n_layers + 2 over pp * pp_virtual_stages stages). Must then multiply to n_layers + 2 exactly."""
    pp_grad_sync: str = "last"
    """When a pipelined FSDP2 rank reduce-scatters its gradients: 'last' (torch's PipelineStage: every gradient of
    the rank's stages held unsharded in fp32, 4 bytes a parameter / tp, until the last micro-batch of a schedule
    call, then one reduce-scatter) or 'microbatch' (one reduce-scatter per micro-batch, shards accumulated: a few
    blocks' unsharded gradients at a time; HSDP's all-reduce still once per call). No effect at pp = 1 (FSDP2 then
    always reduce-scatters every micro-batch) nor without data parallelism (logged)."""
    timeout_s: float = 600.0
    """Seconds a collective waits for the other ranks before it fails, on every process group densetrain creates
    (the world, the mesh's subgroups, the async-save group): the job then exits naming the collective and the
    ranks that did not arrive, and torchrun's elastic agent can restart it. 600 is torch's NCCL default
    (torch.distributed.constants.default_pg_nccl_timeout); gloo's own default is 30 minutes."""


@dataclass
class Config:
    """The whole recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data preparation."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig(name="main")])
    """The stage table (main, anneal, long_context, ...)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout: data-parallel replicas and shards, tensor parallel, activation checkpointing."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Non-finite and loss-spike handling: skip, roll back."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Throughput drops per rank and phase; hang detection."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Hardware health checks per rank (matmul rate, memory and collective bandwidth) while training."""
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """Data quality while training: duplicate rate and per-source loss trend."""
    faults: list[FaultConfig] = field(default_factory=list)
    """Injected faults ([[faults]] tables) for rehearsals and tests."""
