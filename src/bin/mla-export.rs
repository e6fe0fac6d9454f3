//! mla-export: write the generated sparse MLA kernels (WGSL, CUDA C, PTX) and their launch
//! parameters, for integrators.

use clap::{Parser, ValueEnum};
use sparse_mla::export::{config_files, stale_files, standard_files, write_files, Lang};
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LangArg {
    Wgsl,
    Cuda,
    Ptx,
}

/// Export the generated sparse MLA decode kernels.
///
/// Two modes:
///
///   mla-export --all [--out DIR]       the standard set into DIR/shaders and DIR/cuda
///   mla-export --check                 exit 1 if the checked-in files are stale
///   mla-export --heads 16 --topk 2048 --page-size 64 --cache bf16 --lang cuda --out build/
///                                      one configuration: its kernels and a launch header
///
/// Every file opens with a header comment: the configuration, every parameter and buffer
/// with its shape and type, the launch grid, and how to launch. Heads, topk, page size,
/// tokens and splits are run-time parameters of the kernels; the per-configuration
/// header fills them in (and the split count chosen for --sms multiprocessors).
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Write the standard set (shaders/, cuda/, cuda/sparse_mla.h) under --out.
    #[arg(long, conflicts_with_all = ["heads", "check"])]
    all: bool,
    /// Compare the checked-in standard set under --out with what --all would write.
    #[arg(long, conflicts_with = "heads")]
    check: bool,
    /// Query heads (one configuration).
    #[arg(long, required_unless_present_any = ["all", "check"])]
    heads: Option<u32>,
    /// Top-k entries per token.
    #[arg(long, default_value_t = 2048)]
    topk: u32,
    /// Tokens per page of the KV cache.
    #[arg(long, default_value_t = 64)]
    page_size: u32,
    /// KV cache row format: bf16 (1152 B/token) or fp8_ds_mla (656 B/token).
    #[arg(long, default_value = "bf16")]
    cache: String,
    /// Query tokens per call (batch x s_q): only the split choice and grid depend on it.
    #[arg(long, default_value_t = 1)]
    tokens: u32,
    /// Splits of the top-k list (default: chosen for --sms).
    #[arg(long)]
    splits: Option<u32>,
    /// Multiprocessors of the target GPU, for the split choice (RTX PRO 6000: 188).
    #[arg(long, default_value_t = 188)]
    sms: u32,
    /// Output language.
    #[arg(long, value_enum, default_value = "cuda")]
    lang: LangArg,
    /// GPU architecture for --lang ptx (sm_80, sm_89, sm_90, sm_120).
    #[arg(long, default_value = "sm_120")]
    arch: String,
    /// Output folder (default: the repository root for --all/--check, `.` otherwise).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn main() -> ExitCode {
    env_logger::init();
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mla-export: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> sparse_mla::Result<ExitCode> {
    if args.all || args.check {
        let root = args.out.clone().unwrap_or_else(repo_root);
        let files = standard_files()?;
        if args.check {
            let stale = stale_files(&root, &files);
            if stale.is_empty() {
                println!(
                    "{} generated files under {} are up to date",
                    files.len(),
                    root.display()
                );
                return Ok(ExitCode::SUCCESS);
            }
            for s in &stale {
                eprintln!("stale: {s}");
            }
            eprintln!("run `cargo run --release --bin mla-export -- --all` and commit the result");
            return Ok(ExitCode::FAILURE);
        }
        write_files(&root, &files)?;
        for f in &files {
            println!("wrote {}", root.join(&f.path).display());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let heads = args.heads.unwrap_or(0);
    let shape = DecodeShape {
        tokens: args.tokens,
        heads,
        topk: args.topk,
        num_pages: 1,
        page_size: args.page_size,
        dims: MlaDims::PRODUCTION,
        format: CacheFormat::parse(&args.cache)?,
        scale: 1.0,
        has_topk_length: false,
    };
    shape.validate()?;
    let lang = match args.lang {
        LangArg::Wgsl => Lang::Wgsl,
        LangArg::Cuda => Lang::Cuda,
        LangArg::Ptx => Lang::Ptx,
    };
    if !["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"].contains(&args.arch.as_str()) {
        return Err(sparse_mla::Error::arg(
            "--arch",
            "sm_80, sm_86, sm_89, sm_90, sm_100 or sm_120",
            &args.arch,
        ));
    }
    let files = config_files(&shape, args.splits, args.sms, lang, &args.arch)?;
    let root = args.out.clone().unwrap_or_else(|| PathBuf::from("."));
    write_files(&root, &files)?;
    for f in &files {
        println!("wrote {}", root.join(&f.path).display());
    }
    Ok(ExitCode::SUCCESS)
}
