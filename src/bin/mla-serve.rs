//! mla-serve: GLM-5 / DeepSeek-V3.2 behind an OpenAI-compatible HTTP API, with continuous
//! batching through the project's own kernels.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use sparse_mla::chat::ChatTemplate;
use sparse_mla::cli::{
    load_with_progress, model_dir_or_default, open_checked, read_model_dir, KvCacheArg, PAGE_SIZE,
};
use sparse_mla::model::{CacheOptions, TextTokenizer};
use sparse_mla::runtime::{open_device, DeviceSpec};
use sparse_mla::serve::{EngineOptions, ModelLoader, ServeOptions, Server};
use sparse_mla::{Error, Result};

#[derive(Parser, Debug)]
#[command(
    name = "mla-serve",
    version,
    about = "Serve GLM-5 or DeepSeek-V3.2 over an OpenAI-compatible HTTP API, with continuous batching.",
    long_about = "Serve GLM-5 (glm_moe_dsa) or DeepSeek-V3.2 (deepseek_v32) over an OpenAI-compatible HTTP API: \
POST /v1/completions and /v1/chat/completions (streaming over server-sent events or whole), GET /v1/models, \
GET /health and GET /metrics (Prometheus).\n\n\
Concurrent requests share one decode loop: a new request's prompt joins between decode steps, every running \
sequence advances in the same forward step, and all of them draw KV cache pages from one pool. When the pool \
runs out the newest sequence is preempted and recomputed later; its output is unchanged.\n\n\
With no --model it serves the tiny GLM-5 checked in under tests/fixtures (random weights: gibberish text), \
so it runs on any machine.",
    after_help = "Examples:\n  \
mla-serve --model ~/models/GLM-5 --device cuda --port 8000\n  \
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n    \
-d '{\"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'\n  \
curl -sN localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"stream\": true}'\n\n\
Sizing: the cache holds --max-batch sequences of --max-seq-len positions unless --cache-pages makes the pool \
smaller (more sequences than fit at once then take turns through preemption). A request whose prompt plus \
max_tokens exceeds the context is refused with a 400.\n\
Ctrl-C or SIGTERM stops taking requests, lets the running ones finish (at most --drain-timeout) and exits."
)]
struct Cli {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json, and for chat a
    /// chat template in tokenizer_config.json or chat_template.jinja). Default: the tiny GLM-5
    /// fixture in this repository.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,

    /// Where the model runs: auto (a CUDA GPU, else a wgpu GPU adapter, else the CPU),
    /// cpu (the float64 reference of every op), wgpu (lavapipe counts), cuda or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    device: String,

    /// Address to listen on.
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    host: IpAddr,

    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, value_name = "PORT", default_value_t = 8000)]
    port: u16,

    /// The model name clients send (`model`) and /v1/models lists. Default: the model
    /// directory's name.
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,

    /// Sequences decoded together at most (rows of the cache's block table).
    #[arg(long, value_name = "N", default_value_t = 32)]
    max_batch: usize,

    /// Context of one sequence: prompt + generated tokens.
    #[arg(long, value_name = "L", default_value_t = 4096)]
    max_seq_len: usize,

    /// KV cache pages (of 64 tokens) in the shared pool. Default: enough for --max-batch
    /// sequences of --max-seq-len, so nothing is ever preempted; smaller saves memory and lets
    /// sequences take turns.
    #[arg(long, value_name = "PAGES")]
    cache_pages: Option<usize>,

    /// KV cache row format: bf16 (1152 B/token) or fp8 (fp8_ds_mla, 656 B/token).
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = KvCacheArg::Bf16)]
    kv_cache: KvCacheArg,

    /// Tokens one forward step runs at most (decode tokens plus prompt chunks): bounds the
    /// activation memory; long prompts are prefilled over several steps.
    #[arg(long, value_name = "T", default_value_t = 512)]
    max_step_tokens: usize,

    /// Requests that may wait for a batch slot; beyond it new requests get 429.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_queue: usize,

    /// Seconds a Ctrl-C / SIGTERM waits for running requests before ending them.
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    drain_timeout: f64,

    /// Replay decode steps from CUDA graphs (CUDA only; other devices ignore it).
    #[arg(long, value_enum, value_name = "ON|OFF", default_value_t = Switch::On)]
    cuda_graphs: Switch,

    /// Serve a true-width model with random weights made on the device instead of a
    /// checkpoint: glm5 or deepseek-v32. For load runs at real size; there is no tokenizer,
    /// so prompts are token ids (below the shape's vocabulary: 154880 / 129280).
    #[arg(long, value_name = "SHAPE", conflicts_with = "model")]
    synthetic: Option<String>,

    /// Layers of the --synthetic model: DENSE,MOE.
    #[arg(long, value_name = "D,M", value_delimiter = ',', default_value = "1,3")]
    synthetic_layers: Vec<usize>,

    /// Weights of the --synthetic model: fp8 (block-scaled e4m3, as the releases ship) or bf16.
    #[arg(long, value_name = "fp8|bf16", default_value = "fp8")]
    synthetic_weights: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

/// `--synthetic`: the shape's model on the device, no checkpoint.
fn synthetic_load(cli: &Cli, shape: &str, device: DeviceSpec) -> Result<(String, ModelLoader)> {
    use sparse_mla::model::synthetic::{self, Shape};
    let shape = [Shape::Glm5, Shape::DeepseekV32]
        .into_iter()
        .find(|s| s.name() == shape)
        .ok_or_else(|| Error::arg("--synthetic", "glm5 or deepseek-v32", shape))?;
    let [dense, moe] = cli.synthetic_layers[..] else {
        return Err(Error::arg(
            "--synthetic-layers",
            "DENSE,MOE (two counts)",
            format!("{:?}", cli.synthetic_layers),
        ));
    };
    let fp8 = match cli.synthetic_weights.as_str() {
        "fp8" => true,
        "bf16" => false,
        other => return Err(Error::arg("--synthetic-weights", "fp8 or bf16", other)),
    };
    let (backend, why) = open_device(device)?;
    eprintln!(
        "mla-serve: device {}{}",
        backend.device_name(),
        if why.is_empty() {
            String::new()
        } else {
            format!(" ({why})")
        }
    );
    let name = format!(
        "{}-{}dense-{}moe-{}-random",
        shape.name(),
        dense,
        moe,
        cli.synthetic_weights
    );
    Ok((
        name,
        Box::new(move || synthetic::build(shape, dense, moe, fp8, backend, 0x5eed)),
    ))
}

fn run(cli: Cli) -> Result<()> {
    let device = DeviceSpec::parse(&cli.device)?;
    if let Some(shape) = cli.synthetic.clone() {
        return serve_synthetic(&cli, &shape, device);
    }
    let dir = model_dir_or_default(cli.model.as_deref(), "mla-serve");
    let (config, tokenizer) = read_model_dir(&dir)?;
    let chat = ChatTemplate::from_model_dir(&dir)?;
    if tokenizer.is_none() {
        eprintln!(
            "mla-serve: note: {} has no tokenizer.json: prompts must be token ids, and chat is off",
            dir.display()
        );
    } else if chat.is_none() {
        eprintln!(
            "mla-serve: note: {} has no chat template: /v1/chat/completions answers 400",
            dir.display()
        );
    }
    cli.kv_cache.format().check_dims(config.mla_dims())?;
    let engine = engine_options(&cli)?;
    let model_name = cli.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let (backend, ckpt) = open_checked(
        "mla-serve",
        device,
        &dir,
        &config,
        &engine.cache,
        cli.max_step_tokens as u64,
    )?;
    let load = Box::new(move || load_with_progress(&config, backend, &ckpt));
    let opts = ServeOptions {
        addr: SocketAddr::new(cli.host, cli.port),
        model_name,
        engine,
        max_queue: cli.max_queue,
        drain_timeout: Duration::from_secs_f64(cli.drain_timeout),
    };
    serve(&cli, opts, load, tokenizer, chat)
}

fn serve_synthetic(cli: &Cli, shape: &str, device: DeviceSpec) -> Result<()> {
    let engine = engine_options(cli)?;
    let (name, load) = synthetic_load(cli, shape, device)?;
    let opts = ServeOptions {
        addr: SocketAddr::new(cli.host, cli.port),
        model_name: cli.served_model_name.clone().unwrap_or(name),
        engine,
        max_queue: cli.max_queue,
        drain_timeout: Duration::from_secs_f64(cli.drain_timeout),
    };
    serve(cli, opts, load, None, None)
}

fn engine_options(cli: &Cli) -> Result<EngineOptions> {
    if !(cli.drain_timeout.is_finite() && cli.drain_timeout >= 0.0) {
        return Err(Error::arg(
            "--drain-timeout",
            "seconds ≥ 0",
            cli.drain_timeout,
        ));
    }
    let engine = EngineOptions {
        cache: CacheOptions {
            format: cli.kv_cache.format(),
            page_size: PAGE_SIZE,
            max_seq_len: cli.max_seq_len,
            max_seqs: cli.max_batch,
            num_pages: cli.cache_pages,
        },
        max_step_tokens: cli.max_step_tokens,
        cuda_graphs: cli.cuda_graphs == Switch::On,
    };
    engine.validate()?;
    Ok(engine)
}

fn serve(
    cli: &Cli,
    opts: ServeOptions,
    load: ModelLoader,
    tokenizer: Option<TextTokenizer>,
    chat: Option<ChatTemplate>,
) -> Result<()> {
    let (name, cache) = (opts.model_name.clone(), opts.engine.cache);
    let mut server = Server::start(opts, load, tokenizer.map(Arc::new), chat)?;
    server.stop_on_signals();
    eprintln!(
        "mla-serve: serving `{name}` at {} (batch ≤ {}, context {} tokens, {} cache pages of {PAGE_SIZE})",
        server.url(),
        cli.max_batch,
        cli.max_seq_len,
        cache.pages()
    );
    server.join()?;
    eprintln!("mla-serve: stopped");
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mla-serve: error: {e}");
            ExitCode::FAILURE
        }
    }
}
