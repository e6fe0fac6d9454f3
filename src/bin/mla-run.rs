//! mla-run: generate text with GLM-5 / DeepSeek-V3.2 through sparse MLA decode.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use sparse_mla::cli::{
    load_sharded_with_progress, load_with_progress, model_dir_or_default, open_checked,
    read_model_dir, KvCacheArg as KvCache, PAGE_SIZE,
};
use sparse_mla::model::device::{Device, Tensor};
use sparse_mla::model::memory::gib;
use sparse_mla::model::shard::plan::check_tp;
use sparse_mla::model::tokenizer::{TextStream, TOKENIZER_FILE};
use sparse_mla::model::weights::Checkpoint;
use sparse_mla::model::{
    CacheOptions, Logits, Model, ModelConfig, Sampler, SamplerConfig, Sequence, ShardedModel,
    ShardedSequence, TextTokenizer,
};
use sparse_mla::runtime::profile::{format_rows, Profiled};
use sparse_mla::runtime::{Backend, DeviceSpec};
use sparse_mla::{Error, Result};
use std::sync::Arc;

const DEFAULT_PROMPT: &str = "The lightning indexer scores every earlier token";
/// The prompt is run in steps of at most this many tokens (bounds the activations).
const PREFILL_CHUNK: usize = 256;

#[derive(Parser, Debug)]
#[command(
    name = "mla-run",
    version,
    about = "Generate text with GLM-5 or DeepSeek-V3.2 through sparse MLA decode.",
    long_about = "Generate text with GLM-5 (glm_moe_dsa) or DeepSeek-V3.2 (deepseek_v32) through sparse MLA \
decode: the lightning indexer picks each token's top-k cache slots and attention reads only those.\n\n\
With no --model it runs the tiny GLM-5 checked in under tests/fixtures (random weights: the text is \
gibberish, the point is that every stage runs), so it works on any machine.",
    after_help = "Examples:\n  \
mla-run                                      tiny checked-in GLM-5, greedy, 32 tokens\n  \
mla-run --model ~/models/GLM-5 --prompt \"Hello\" -n 64 --temperature 0.7 --top-p 0.95\n  \
mla-run --model DIR --prompt-ids 1,2,3 --output json    ids in, one JSON object per token out\n  \
mla-run --tp 2                               the same model split in 2 shards on one device\n\n\
A model directory holds config.json, model.safetensors (or model.safetensors.index.json and its \
shards) and, for text in and out, tokenizer.json.\n\
The last line reports prompt tokens, prefill and decode speed (tokens/s) and peak memory."
)]
struct Cli {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json).
    /// Default: the tiny GLM-5 fixture in this repository.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,

    /// Prompt text (needs tokenizer.json in the model directory).
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_ids")]
    prompt: Option<String>,

    /// Prompt as comma-separated token ids, e.g. 1,2,3 (works without a tokenizer).
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,

    /// Number of tokens to generate (stops early at an end-of-sequence token).
    #[arg(
        short = 'n',
        long = "sample-len",
        value_name = "N",
        default_value_t = 32
    )]
    n: usize,

    /// Sampling temperature; 0 is greedy (argmax).
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    temperature: f32,

    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1 = off).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    top_p: f32,

    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, value_name = "K", default_value_t = 0)]
    top_k: usize,

    /// Seed of the sampler, so a sampled run can be replayed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,

    /// Where the model runs: auto (a CUDA GPU, else a wgpu GPU adapter, else the CPU),
    /// cpu (the float64 reference of every op), wgpu (WGPU_BACKEND / WGPU_ADAPTER_NAME choose
    /// the adapter; lavapipe counts), cuda or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    device: String,

    /// KV cache row format: bf16 (1152 B/token) or fp8 (fp8_ds_mla, 656 B/token).
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = KvCache::Bf16)]
    kv_cache: KvCache,

    /// Replay decode steps from CUDA graphs (CUDA only; other devices ignore it).
    #[arg(long, value_enum, value_name = "ON|OFF", default_value_t = Switch::On)]
    cuda_graphs: Switch,

    /// Who runs the dense linears: auto (on CUDA, cuBLAS from 2 tokens a step for bf16
    /// weights and from 8 for FP8 ones, which it reads through a bf16 hi/lo dequant — where
    /// the H200 measured it faster; the project's kernels otherwise), kernels (always ours),
    /// cublas (always cuBLAS; an error without it). Per-head and expert linears always run
    /// the project's kernels.
    #[arg(long, value_name = "WHO", default_value = "auto",
          value_parser = clap::builder::PossibleValuesParser::new(["auto", "kernels", "cublas"]))]
    gemm: String,

    /// Split the model into N shards the way tensor and expert parallelism split it over N
    /// GPUs — attention heads, the dense and shared-expert MLP width and the routed experts
    /// divided between the shards; the latent cache, indexer and router on every shard —
    /// and run all N on the one --device, their partial sums added through host memory
    /// after every attention and MLP. For checking the sharding: the output should be the
    /// unsharded run's (the sums differ only in f32 rounding), and it runs slower (eager
    /// steps, no CUDA graphs, the caches N times over). Running the shards on several GPUs
    /// (NCCL) is not built yet. N must divide num_attention_heads, n_routed_experts and the
    /// MLP widths, and keep FP8 weights' 128 x 128 blocks whole. See docs/sharding.md.
    #[arg(long, value_name = "N", conflicts_with = "chat")]
    tp: Option<usize>,

    /// Longest sequence (prompt + generated) the cache is sized for.
    #[arg(long, value_name = "L", default_value_t = 4096)]
    max_seq_len: usize,

    /// Benchmark the decode loop instead of printing text: prefill, 3 untimed steps, then
    /// -n timed steps of exactly what a generation runs (forward on the device + sampler);
    /// prints the median step time, tokens/s and the host waits per step.
    #[arg(long)]
    bench: bool,

    /// With --bench: time every operation of the timed steps (the device waited for before
    /// and after each, CUDA graphs off) and print a table of where a step's time goes — op,
    /// calls, ms per step, µs per call, share. Each row includes one launch and one wait, so
    /// the steps run slower than without; it shows which op to look at, on any device.
    #[arg(long, requires = "bench")]
    profile: bool,

    /// Chat: read a message per line from stdin, answer it with the model's chat template
    /// (tokenizer_config.json or chat_template.jinja), and keep the conversation's cache
    /// between turns (only the new part of the prompt runs). -n caps each answer. Lines
    /// /reset (forget the conversation) and /exit; Ctrl-D also ends. With --output json,
    /// one object per turn.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids", "bench"])]
    chat: bool,

    /// System message that opens the --chat conversation.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    system: Option<String>,

    /// text: the continuation as it is generated, then a speed line.
    /// json: one object per token ({"id", "text", "logprob"}) and a final summary object.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = Output::Text)]
    output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

/// Peak resident memory of this process in bytes (VmHWM), where /proc has it.
fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Everything checked before loading a single weight.
struct Plan {
    dir: PathBuf,
    config: ModelConfig,
    tokenizer: Option<TextTokenizer>,
    prompt: Vec<u32>,
    cache: CacheOptions,
    sampler: SamplerConfig,
    device: DeviceSpec,
}

fn plan(cli: &Cli) -> Result<Plan> {
    let device = DeviceSpec::parse(&cli.device)?;
    let dir = model_dir_or_default(cli.model.as_deref(), "mla-run");
    let (config, tokenizer) = read_model_dir(&dir)?;
    let prompt = match (&cli.prompt_ids, &cli.prompt, &tokenizer) {
        (Some(ids), _, _) => ids.clone(),
        (None, text, Some(tok)) => tok.encode(text.as_deref().unwrap_or(DEFAULT_PROMPT))?,
        (None, _, None) => {
            return Err(Error::Model(format!(
                "model directory {} has no {TOKENIZER_FILE}: give the prompt as --prompt-ids 1,2,3",
                dir.display()
            )))
        }
    };
    if prompt.is_empty() {
        return Err(Error::arg(
            "prompt",
            "at least one token",
            "an empty prompt",
        ));
    }
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= config.vocab_size) {
        return Err(Error::arg(
            "--prompt-ids",
            format!("token ids below the vocabulary size {}", config.vocab_size),
            bad,
        ));
    }
    if prompt.len() > cli.max_seq_len {
        return Err(Error::arg(
            "prompt",
            format!("at most --max-seq-len = {} tokens", cli.max_seq_len),
            format!("{} tokens", prompt.len()),
        ));
    }
    if let Some(max) = config.max_position_embeddings {
        if cli.max_seq_len > max {
            eprintln!(
                "mla-run: note: --max-seq-len {} is past the model's max_position_embeddings {max}",
                cli.max_seq_len
            );
        }
    }
    let format = cli.kv_cache.format();
    format.check_dims(config.mla_dims())?;
    let sampler = SamplerConfig {
        temperature: cli.temperature,
        top_p: cli.top_p,
        top_k: cli.top_k,
        seed: cli.seed,
    };
    sampler.validate_as("--temperature", "--top-p")?;
    if let Some(n) = cli.tp {
        check_tp(&config, None, n)?;
    }
    Ok(Plan {
        dir,
        config,
        tokenizer,
        prompt,
        cache: CacheOptions {
            format,
            page_size: PAGE_SIZE,
            max_seq_len: cli.max_seq_len,
            ..Default::default()
        },
        sampler,
        device,
    })
}

/// Opens the device and checks the run fits it, before a weight is read.
fn open(plan: &Plan) -> Result<(Arc<dyn Backend>, Checkpoint)> {
    open_checked(
        "mla-run",
        plan.device,
        &plan.dir,
        &plan.config,
        &plan.cache,
        PREFILL_CHUNK.min(plan.prompt.len().max(1)) as u64,
    )
}

fn load(plan: &Plan, backend: Arc<dyn Backend>, ckpt: &Checkpoint) -> Result<Model> {
    load_with_progress(&plan.config, backend, ckpt)
}

/// What the generation and bench loops need of a model: the whole one, or the sharded one.
trait Generator {
    type Seq;
    fn config(&self) -> &ModelConfig;
    fn new_seq(&self, opts: CacheOptions) -> Result<Self::Seq>;
    /// The tokens at the sequence's next positions: the last row's logits, on the device.
    fn forward(&self, seq: &mut Self::Seq, tokens: &[u32]) -> Result<Tensor>;
    fn seq_len(seq: &Self::Seq) -> usize;
    /// Where the logits are (the sampler runs there).
    fn device(&self) -> &Device;
    /// Device bytes of the weights, the caches and the activation pools.
    fn device_bytes(&self, seq: &Self::Seq) -> [u64; 3];
    /// (recordings, replays) of CUDA graphs.
    fn graph_counts(&self) -> (u64, u64);
}

impl Generator for Model {
    type Seq = Sequence;
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_seq(&self, opts: CacheOptions) -> Result<Sequence> {
        self.new_sequence(opts)
    }
    fn forward(&self, seq: &mut Sequence, tokens: &[u32]) -> Result<Tensor> {
        self.forward_on_device(seq, tokens, Logits::Last)
    }
    fn seq_len(seq: &Sequence) -> usize {
        seq.len()
    }
    fn device(&self) -> &Device {
        Model::device(self)
    }
    fn device_bytes(&self, seq: &Sequence) -> [u64; 3] {
        [
            self.weight_bytes(),
            seq.cache.bytes(),
            Model::device(self).pool_bytes(),
        ]
    }
    fn graph_counts(&self) -> (u64, u64) {
        Model::graph_counts(self)
    }
}

impl Generator for ShardedModel {
    type Seq = ShardedSequence;
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_seq(&self, opts: CacheOptions) -> Result<ShardedSequence> {
        self.new_sequence(opts)
    }
    fn forward(&self, seq: &mut ShardedSequence, tokens: &[u32]) -> Result<Tensor> {
        self.forward_on_device(seq, tokens, Logits::Last)
    }
    fn seq_len(seq: &ShardedSequence) -> usize {
        seq.len()
    }
    fn device(&self) -> &Device {
        ShardedModel::device(self)
    }
    fn device_bytes(&self, seq: &ShardedSequence) -> [u64; 3] {
        [self.weight_bytes(), seq.cache.bytes(), self.pool_bytes()]
    }
    fn graph_counts(&self) -> (u64, u64) {
        (0, 0)
    }
}

struct Summary {
    /// Device bytes of the weights, the caches and the activation pool.
    device_bytes: [u64; 3],
    device: String,
    prompt_tokens: usize,
    generated: usize,
    prefill_s: f64,
    decode_steps: usize,
    decode_s: f64,
    stop: &'static str,
}

fn run(cli: &Cli) -> Result<()> {
    let plan = plan(cli)?;
    let (backend, ckpt) = open(&plan)?;
    let profiled = cli
        .profile
        .then(|| Arc::new(Profiled::new(backend.clone())));
    let backend = match &profiled {
        Some(p) => p.clone() as Arc<dyn Backend>,
        None => backend,
    };
    let profile = profiled.as_deref();
    if let Some(n) = cli.tp {
        let model = load_sharded_with_progress(&plan.config, backend, &ckpt, n)?;
        drop(ckpt);
        eprintln!(
            "mla-run: {n} shards on {}, partial sums through {}; steps run eagerly",
            model.device().backend().device_name(),
            model.collective_name()
        );
        if cli.bench {
            return bench(cli, &plan, &model, profile);
        }
        return generate(cli, &plan, &model);
    }
    let model = load(&plan, backend, &ckpt)?;
    drop(ckpt);
    model.set_graphs(cli.cuda_graphs == Switch::On);
    model
        .device()
        .set_dense_gemm(sparse_mla::model::device::DenseGemm::parse(
            "--gemm", &cli.gemm,
        )?)?;
    if cli.bench {
        return bench(cli, &plan, &model, profile);
    }
    if cli.chat {
        return chat::run(cli, &plan, &model);
    }
    generate(cli, &plan, &model)
}

/// The plain run: the prompt, then up to -n sampled tokens, streamed.
fn generate<G: Generator>(cli: &Cli, plan: &Plan, model: &G) -> Result<()> {
    let mut sampler = Sampler::new(plan.sampler)?;
    let mut seq = model.new_seq(plan.cache)?;
    let out = std::io::stdout();
    let mut out = out.lock();
    let io = |e: std::io::Error| Error::Io {
        path: "stdout".into(),
        source: e,
    };

    let mut stream = plan.tokenizer.as_ref().map(TextStream::new);
    if cli.output == Output::Text {
        match &plan.tokenizer {
            Some(tok) => write!(out, "{}", tok.decode(&plan.prompt)?).map_err(io)?,
            None => write!(out, "{}", join_ids(&plan.prompt)).map_err(io)?,
        }
        out.flush().map_err(io)?;
    }

    let t0 = Instant::now();
    let mut logits = None;
    for chunk in plan.prompt.chunks(PREFILL_CHUNK) {
        logits = Some(model.forward(&mut seq, chunk)?);
    }
    let mut logits =
        logits.ok_or_else(|| Error::arg("prompt", "at least one token", "an empty prompt"))?;
    let prefill_s = t0.elapsed().as_secs_f64();

    let mut summary = Summary {
        device_bytes: [0; 3],
        device: String::new(),
        prompt_tokens: plan.prompt.len(),
        generated: 0,
        prefill_s,
        decode_steps: 0,
        decode_s: 0.0,
        stop: "length",
    };
    let t1 = Instant::now();
    for i in 0..cli.n {
        let token = sampler
            .sample(model.device(), &logits)
            .map_err(|e| Error::Model(format!("step {i}: {e}")))?[0];
        let id = token.id;
        summary.generated += 1;
        let text = match stream.as_mut() {
            Some(s) => Some(s.push(id)?),
            None => None,
        };
        match cli.output {
            Output::Text => match &text {
                Some(t) => write!(out, "{t}").map_err(io)?,
                None => write!(out, " {id}").map_err(io)?,
            },
            Output::Json => {
                let obj = serde_json::json!({ "id": id, "text": text, "logprob": token.logprob });
                writeln!(out, "{obj}").map_err(io)?;
            }
        }
        out.flush().map_err(io)?;
        if model.config().is_eos(id) {
            summary.stop = "eos";
            break;
        }
        if i + 1 == cli.n {
            break;
        }
        if G::seq_len(&seq) >= plan.cache.max_seq_len {
            summary.stop = "max_seq_len";
            break;
        }
        logits = model.forward(&mut seq, &[id])?;
        summary.decode_steps += 1;
    }
    summary.decode_s = t1.elapsed().as_secs_f64();
    if let (Some(s), Output::Text) = (stream.as_mut(), cli.output) {
        write!(out, "{}", s.finish()?).map_err(io)?;
    }
    summary.device_bytes = model.device_bytes(&seq);
    summary.device = model.device().backend().device_name();
    report(&mut out, cli, &summary, &seq_note(&summary, plan)).map_err(io)
}

/// `--bench`: the decode loop timed step by step.
fn bench<G: Generator>(
    cli: &Cli,
    plan: &Plan,
    model: &G,
    profile: Option<&Profiled>,
) -> Result<()> {
    let steps = cli.n.max(1);
    let need = plan.prompt.len() + steps + 4;
    if need > plan.cache.max_seq_len {
        return Err(Error::arg(
            "--max-seq-len",
            format!("at least {need} for the prompt, 3 warm-up and {steps} timed steps"),
            plan.cache.max_seq_len,
        ));
    }
    let mut sampler = Sampler::new(plan.sampler)?;
    let mut seq = model.new_seq(plan.cache)?;
    let t0 = Instant::now();
    let mut logits = None;
    for chunk in plan.prompt.chunks(PREFILL_CHUNK) {
        logits = Some(model.forward(&mut seq, chunk)?);
    }
    let mut logits = logits.ok_or_else(|| Error::arg("prompt", "at least one token", 0))?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut times = Vec::with_capacity(steps);
    let backend = model.device().backend();
    let mut waits = 0;
    for i in 0..steps + 3 {
        if let Some(p) = profile.filter(|_| i == 3) {
            // the prefill's and the warm-up steps' rows are not the timed steps' (each op
            // waited for its own end, so nothing of theirs is still running)
            p.reset();
        }
        let t = Instant::now();
        let w0 = backend.host_syncs();
        let id = sampler.sample(model.device(), &logits)?[0].id;
        logits = model.forward(&mut seq, &[id])?;
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
            waits += backend.host_syncs() - w0;
        }
    }
    // The last step's logits are not sampled: finish them before the clock stops mattering.
    backend.synchronize()?;
    times.sort_by(f64::total_cmp);
    let q = |f: f64| times[((times.len() - 1) as f64 * f) as usize];
    let (records, replays) = model.graph_counts();
    let line = format!(
        "decode bench on {}: {} prompt tokens ({:.1} tok/s prefill), {steps} steps: median {:.3} ms/token (p10 {:.3}, p90 {:.3}), {:.1} tok/s, {:.2} host waits per step, graphs recorded {records} / replayed {replays}",
        backend.device_name(),
        plan.prompt.len(),
        plan.prompt.len() as f64 / prefill_s,
        q(0.5) * 1e3,
        q(0.1) * 1e3,
        q(0.9) * 1e3,
        1.0 / q(0.5),
        waits as f64 / steps as f64
    );
    let rows = profile.map(|p| p.rows()).unwrap_or_default();
    match cli.output {
        Output::Text => {
            println!("{line}");
            if profile.is_some() {
                println!(
                    "profile of the {steps} timed steps (each op between two waits for the device; graphs off):"
                );
                print!("{}", format_rows(&rows, steps as u64));
            }
        }
        Output::Json => println!(
            "{}",
            serde_json::json!({
                "profile": profile.map(|_| rows.iter().map(|r| serde_json::json!({
                    "op": r.name,
                    "calls": r.calls,
                    "ms_per_step": r.ms_per_step(steps as u64),
                    "us_per_call": r.us_per_call(),
                })).collect::<Vec<_>>()),
                "device": backend.device_name(),
                "prompt_tokens": plan.prompt.len(),
                "steps": steps,
                "median_ms_per_token": q(0.5) * 1e3,
                "p10_ms": q(0.1) * 1e3,
                "p90_ms": q(0.9) * 1e3,
                "decode_tok_s": 1.0 / q(0.5),
                "host_waits_per_step": waits as f64 / steps as f64,
                "graphs_recorded": records,
                "graphs_replayed": replays,
            })
        ),
    }
    Ok(())
}

fn seq_note(s: &Summary, plan: &Plan) -> String {
    if s.stop == "max_seq_len" {
        format!(" (stopped at --max-seq-len {})", plan.cache.max_seq_len)
    } else {
        String::new()
    }
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

fn report(out: &mut impl Write, cli: &Cli, s: &Summary, note: &str) -> std::io::Result<()> {
    let peak = peak_memory_bytes();
    let prefill = rate(s.prompt_tokens, s.prefill_s);
    let decode = rate(s.decode_steps, s.decode_s);
    match cli.output {
        Output::Text => {
            let mem = peak
                .map(|b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)))
                .unwrap_or_else(|| "n/a".into());
            writeln!(out)?;
            let [w, c, a] = s.device_bytes;
            writeln!(
                out,
                "prompt {} tokens | prefill {prefill:.1} tok/s | decode {decode:.1} tok/s | {} generated | device {}: weights {}, caches {}, activations {} | peak memory {mem}{note}",
                s.prompt_tokens,
                s.generated,
                s.device,
                gib(w),
                gib(c),
                gib(a)
            )
        }
        Output::Json => {
            let obj = serde_json::json!({
                "prompt_tokens": s.prompt_tokens,
                "generated_tokens": s.generated,
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "peak_memory_bytes": peak,
                "device": s.device,
                "device_weight_bytes": s.device_bytes[0],
                "device_cache_bytes": s.device_bytes[1],
                "device_activation_bytes": s.device_bytes[2],
                "stop": s.stop,
            });
            writeln!(out, "{obj}")
        }
    }
}

mod chat {
    //! `mla-run --chat`: the conversation is re-rendered through the template each turn,
    //! and the cache keeps the longest prefix it shares with what is already there.

    use super::*;
    use sparse_mla::chat::{reusable_prefix, ChatMessage, ChatTemplate};
    use std::io::BufRead;

    pub fn run(cli: &Cli, plan: &Plan, model: &Model) -> Result<()> {
        let tok = plan.tokenizer.as_ref().ok_or_else(|| {
            Error::Model(format!(
                "--chat needs {TOKENIZER_FILE} in {}",
                plan.dir.display()
            ))
        })?;
        let template = ChatTemplate::from_model_dir(&plan.dir)?.ok_or_else(|| {
            Error::Model(format!(
                "--chat needs a chat template: {} has no chat_template in tokenizer_config.json and no chat_template.jinja",
                plan.dir.display()
            ))
        })?;
        let mut sampler = Sampler::new(plan.sampler)?;
        let mut seq = model.new_sequence(plan.cache)?;
        let opening: Vec<ChatMessage> = cli
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s))
            .collect();
        let mut messages = opening.clone();
        // The tokens whose cache rows are written, in order.
        let mut cached: Vec<u32> = Vec::new();
        let json = cli.output == Output::Json;
        let out = std::io::stdout();
        let mut out = out.lock();
        let io = |e: std::io::Error| Error::Io {
            path: "stdout".into(),
            source: e,
        };
        eprintln!(
            "mla-run: chat with {} (one message per line; /reset forgets, /exit or Ctrl-D ends)",
            plan.dir.display()
        );
        let stdin = std::io::stdin();
        let mut turn = 0;
        for line in stdin.lock().lines() {
            let line = line.map_err(|e| Error::Io {
                path: "stdin".into(),
                source: e,
            })?;
            let text = line.trim();
            match text {
                "" => continue,
                "/exit" | "/quit" => break,
                "/reset" => {
                    messages = opening.clone();
                    cached.clear();
                    seq.cache.truncate(seq.id, 0)?;
                    eprintln!("mla-run: conversation reset");
                    continue;
                }
                _ => {}
            }
            messages.push(ChatMessage::new("user", text));
            let ids = tok.encode_with(&template.render(&messages, true)?, false)?;
            if ids.len() >= plan.cache.max_seq_len {
                messages.pop();
                eprintln!(
                    "mla-run: the conversation would be {} tokens, past --max-seq-len {}: /reset or a shorter message",
                    ids.len(),
                    plan.cache.max_seq_len
                );
                continue;
            }
            turn += 1;
            let t0 = Instant::now();
            let keep = reusable_prefix(&cached, &ids);
            seq.cache.truncate(seq.id, keep)?;
            cached.truncate(keep);
            let mut logits = None;
            for chunk in ids[keep..].chunks(PREFILL_CHUNK) {
                logits = Some(model.forward_on_device(&mut seq, chunk, Logits::Last)?);
            }
            cached.extend_from_slice(&ids[keep..]);
            let mut logits = logits.ok_or_else(|| Error::Model("nothing to run".into()))?;
            let mut stream = TextStream::new(tok);
            let mut reply_ids = Vec::new();
            let mut reply = String::new();
            for i in 0..cli.n {
                let id = sampler.sample(model.device(), &logits)?[0].id;
                if model.config.is_eos(id) {
                    break;
                }
                reply_ids.push(id);
                let piece = stream.push(id)?;
                if !json {
                    write!(out, "{piece}").map_err(io)?;
                    out.flush().map_err(io)?;
                }
                reply.push_str(&piece);
                if i + 1 == cli.n || seq.len() + 1 >= plan.cache.max_seq_len {
                    break;
                }
                logits = model.forward_on_device(&mut seq, &[id], Logits::Last)?;
                cached.push(id);
            }
            let rest = stream.finish()?;
            reply.push_str(&rest);
            let secs = t0.elapsed().as_secs_f64();
            if json {
                let obj = serde_json::json!({
                    "turn": turn,
                    "reply": reply,
                    "ids": reply_ids,
                    "prompt_tokens": ids.len(),
                    "reused_tokens": keep,
                    "seconds": secs,
                });
                writeln!(out, "{obj}").map_err(io)?;
            } else {
                writeln!(out, "{rest}").map_err(io)?;
                eprintln!(
                    "[turn {turn}: {} prompt tokens, {keep} reused from the cache, {} generated, {:.1} tok/s]",
                    ids.len(),
                    reply_ids.len(),
                    rate(reply_ids.len(), secs)
                );
            }
            out.flush().map_err(io)?;
            messages.push(ChatMessage::new("assistant", &reply));
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mla-run: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("mla-run").chain(args.iter().copied()))
    }

    #[test]
    fn devices_parse() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("auto").unwrap(), DeviceSpec::Auto);
        assert_eq!(DeviceSpec::parse("wgpu").unwrap(), DeviceSpec::Wgpu);
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        assert!(DeviceSpec::parse("gpu")
            .unwrap_err()
            .to_string()
            .contains("--device"));
        assert!(DeviceSpec::parse("cuda:x").is_err());
    }

    #[test]
    fn prompt_and_prompt_ids_conflict() {
        assert!(cli(&["--prompt", "hi", "--prompt-ids", "1,2"]).is_err());
        let c = cli(&["--prompt-ids", "1,2,3", "-n", "4", "--kv-cache", "fp8"]).unwrap();
        assert_eq!(c.prompt_ids, Some(vec![1, 2, 3]));
        assert_eq!(c.n, 4);
        assert_eq!(c.kv_cache, KvCache::Fp8);
        assert!(cli(&["--prompt-ids", "1,x"]).is_err());
        assert!(cli(&["--kv-cache", "int4"]).is_err());
    }

    #[test]
    fn prompt_longer_than_max_seq_len_is_refused() {
        let c = cli(&["--prompt-ids", "1,2,3,4,5", "--max-seq-len", "4"]).unwrap();
        let e = plan(&c).err().unwrap().to_string();
        assert!(e.contains("max-seq-len") && e.contains("5 tokens"), "{e}");
    }

    #[test]
    fn missing_model_files_are_named() {
        let dir = std::env::temp_dir().join(format!("mla-run-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = cli(&["--model", dir.to_str().unwrap()]).unwrap();
        let e = plan(&c).err().unwrap().to_string();
        assert!(e.contains("config.json"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        let c = cli(&["--model", "/nonexistent/model"]).unwrap();
        assert!(plan(&c)
            .err()
            .unwrap()
            .to_string()
            .contains("does not exist"));
    }
}
