//! mla-export: write the generated sparse MLA kernels (WGSL, CUDA C, PTX, cubin) and their
//! launch headers, for integrators.

use clap::{Parser, ValueEnum};
use sparse_mla::export::{
    config_files, remove_stale, stale_files, standard_files, write_files, ConfigRequest,
    ExportFile, ExportLowering, Lang, Written, ARCHES,
};
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use sparse_mla::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LangArg {
    Wgsl,
    Cuda,
    Ptx,
    Cubin,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LoweringArg {
    /// Tensor cores (mma.sync): the kernels the CUDA backend runs. CUDA, PTX and cubin only.
    Mma,
    /// Loops over shared memory: every language.
    Scalar,
}

/// Export the generated sparse MLA decode kernels.
///
///   mla-export --all [--out DIR] [--force]  the standard set into DIR/shaders and DIR/cuda
///   mla-export --check                      exit 1 if the checked-in files are stale
///   mla-export --heads 16 --topk 2048 --page-size 64 --cache bf16 --lang cuda --out build/
///                                           one configuration: its kernels and a launch header
///   mla-export --heads 128 --cache fp8_ds_mla --lang cubin --arch sm_90 --out build/
///
/// One configuration exports the production kernels by default: the tensor-core (mma)
/// variant the CUDA backend runs for that head count, both of its kernels (split, which
/// writes the output itself when a call has one split, and combine), and a launch header (dynamic shared memory and the attribute
/// call, grid, block, block_n, the split rule as a C function, scratch sizes, strides,
/// limits). `--lowering scalar` exports the scalar kernels instead (the only lowering of
/// `--lang wgsl`). PTX and cubin are compiled by NVRTC for `--arch`.
///
/// Existing files with other contents are replaced only with `--force`; every file is written
/// to a temporary name and renamed into place. `--all --force` also removes the kernel files
/// it wrote before that the set no longer has (a renamed kernel); other files are kept. The
/// launch rules are in cuda/sparse_mla.h and docs/integration.md.
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Write the standard set (shaders/, cuda/, cuda/sparse_mla.h) under --out.
    #[arg(long, conflicts_with_all = ["heads", "check"])]
    all: bool,
    /// Compare the checked-in standard set under --out with what --all would write.
    #[arg(long, conflicts_with = "heads")]
    check: bool,
    /// Query heads (one configuration); picks the variant (the runtime's choice per H).
    #[arg(long, required_unless_present_any = ["all", "check"])]
    heads: Option<u32>,
    /// Top-k entries per token (a run-time parameter; sets the header's example split count).
    #[arg(long, default_value_t = 2048)]
    topk: u32,
    /// Tokens per page of the KV cache (a run-time parameter).
    #[arg(long, default_value_t = 64)]
    page_size: u32,
    /// KV cache row format: bf16 (1152 B/token) or fp8_ds_mla (656 B/token).
    #[arg(long, default_value = "bf16")]
    cache: String,
    /// Query tokens per call (batch x s_q): only the example split count and grid depend on it.
    #[arg(long, default_value_t = 1)]
    tokens: u32,
    /// Splits of the top-k list for the example call (default: the runtime's cost model).
    #[arg(long)]
    splits: Option<u32>,
    /// Multiprocessors of the target GPU, for the split choice (RTX PRO 6000: 188, H200: 132).
    #[arg(long, default_value_t = 188)]
    sms: u32,
    /// Split-kernel workgroups resident per multiprocessor (default: estimated for --arch from
    /// shared memory; the runtime asks the driver's occupancy calculator).
    #[arg(long)]
    per_sm: Option<u32>,
    /// Output language.
    #[arg(long, value_enum, default_value = "cuda")]
    lang: LangArg,
    /// Lowering of the decode kernels (default: mma for cuda/ptx/cubin, scalar for wgsl).
    #[arg(long, value_enum)]
    lowering: Option<LoweringArg>,
    /// GPU architecture for --lang ptx / cubin and the occupancy estimate (sm_80, sm_86, sm_89,
    /// sm_90, sm_100, sm_120).
    #[arg(long, default_value = "sm_120")]
    arch: String,
    /// Output folder (default: the current directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace existing files whose contents differ.
    #[arg(long)]
    force: bool,
}

/// Where `--all` / `--check` look without `--out`: the current directory. (It used to be the
/// source tree the binary was built from, which wrote into a checkout a user never named.)
/// From the repository root, `cargo run --bin mla-export -- --all` regenerates the checked-in
/// `shaders/` and `cuda/`.
fn repo_root() -> PathBuf {
    PathBuf::from(".")
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

fn at_least_one(name: &str, v: u32) -> sparse_mla::Result<()> {
    if v == 0 {
        return Err(Error::arg(name, "at least 1", 0));
    }
    Ok(())
}

fn report(root: &Path, files: &[ExportFile], written: &[Written]) {
    for (f, w) in files.iter().zip(written) {
        let what = match w {
            Written::Wrote => "wrote",
            Written::Unchanged => "unchanged",
        };
        println!("{what} {}", root.join(&f.path).display());
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
            eprintln!(
                "run `cargo run --release --bin mla-export -- --all --force` and commit the result"
            );
            return Ok(ExitCode::FAILURE);
        }
        let written = write_files(&root, &files, args.force)?;
        report(&root, &files, &written);
        // kernels this tool wrote that the set no longer has (a renamed kernel): removed
        // with --force, like the files it replaces
        for rel in remove_stale(&root, &files, args.force)? {
            if args.force {
                println!(
                    "removed {} (not in the standard set)",
                    root.join(rel).display()
                );
            } else {
                eprintln!(
                    "stale: {} was written by mla-export and is not in the standard set; \
                     --force removes it",
                    root.join(rel).display()
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let heads = args.heads.unwrap_or(0);
    at_least_one("--heads", heads)?;
    at_least_one("--topk", args.topk)?;
    at_least_one("--page-size", args.page_size)?;
    at_least_one("--sms", args.sms)?;
    if args.tokens == 0 || args.tokens > 65535 {
        return Err(Error::arg("--tokens", "1..=65535 (grid z)", args.tokens));
    }
    if let Some(s) = args.splits {
        at_least_one("--splits", s)?;
    }
    if let Some(n) = args.per_sm {
        at_least_one("--per-sm", n)?;
    }
    let format = CacheFormat::parse(&args.cache)
        .map_err(|_| Error::arg("--cache", "bf16 or fp8_ds_mla", &args.cache))?;
    let lang = match args.lang {
        LangArg::Wgsl => Lang::Wgsl,
        LangArg::Cuda => Lang::Cuda,
        LangArg::Ptx => Lang::Ptx,
        LangArg::Cubin => Lang::Cubin,
    };
    let lowering = match args.lowering {
        None => lang.default_lowering(),
        Some(LoweringArg::Mma) => ExportLowering::Mma,
        Some(LoweringArg::Scalar) => ExportLowering::Scalar,
    };
    if !ARCHES.contains(&args.arch.as_str()) {
        return Err(Error::arg("--arch", ARCHES.join(", "), &args.arch));
    }
    let shape = DecodeShape {
        tokens: args.tokens,
        heads,
        topk: args.topk,
        num_pages: 1,
        page_size: args.page_size,
        dims: MlaDims::PRODUCTION,
        format,
        scale: 1.0,
        has_topk_length: false,
    };
    let files = config_files(&ConfigRequest {
        shape,
        splits: args.splits,
        sms: args.sms,
        per_sm: args.per_sm,
        lang,
        lowering,
        arch: args.arch.clone(),
    })?;
    let root = args.out.clone().unwrap_or_else(|| PathBuf::from("."));
    if root.is_file() {
        return Err(Error::arg(
            "--out",
            "a folder",
            format!("{} is a file", root.display()),
        ));
    }
    let written = write_files(&root, &files, args.force)?;
    report(&root, &files, &written);
    Ok(ExitCode::SUCCESS)
}
