//! What `mla-export` writes: generated kernels with their header comments, the C header of
//! launch rules and helpers for integrators ([`header`]), and per-configuration exports. Kept
//! in the library so the freshness test compares the checked-in files with exactly this.

pub mod header;

use crate::emit::{cuda, wgsl};
use crate::kernels::sparse_mla_decode::{check_shape, DecodeConfig, DecodePlan, WholeTokens};
use crate::kernels::{standard_set, Target};
use crate::kir::Kernel;
use crate::mla::DecodeShape;
use crate::{Error, Result};
pub use header::{batch_variants, c_header, decode_variants, DecodeVariant, ExportLowering};
use std::path::{Path, PathBuf};

/// A file to write, relative to the output root.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportFile {
    pub path: PathBuf,
    pub contents: Vec<u8>,
}

impl ExportFile {
    fn text(path: impl Into<PathBuf>, contents: String) -> Self {
        ExportFile {
            path: path.into(),
            contents: contents.into_bytes(),
        }
    }
}

/// The kernel source for `target`, validated (naga for WGSL, including the portable
/// workgroup limits).
pub fn render(kernel: &Kernel, target: Target) -> Result<String> {
    match target {
        Target::Wgsl => {
            wgsl::check_portable_limits(kernel)?;
            let src = wgsl::emit(kernel)?;
            wgsl::validate(&kernel.name, &src)?;
            Ok(src)
        }
        Target::Cuda => cuda::emit(kernel),
    }
}

fn ext(target: Target) -> &'static str {
    match target {
        Target::Wgsl => "wgsl",
        Target::Cuda => "cu",
    }
}

fn dir(target: Target) -> &'static str {
    match target {
        Target::Wgsl => "shaders",
        Target::Cuda => "cuda",
    }
}

/// The standard set: `shaders/*.wgsl`, `cuda/*.cu`, `cuda/sparse_mla.h` and an index per
/// folder.
pub fn standard_files() -> Result<Vec<ExportFile>> {
    let set = standard_set()?;
    let mut files = Vec::new();
    let mut index_wgsl = index_header("WGSL", "shaders");
    let mut index_cuda = index_header("CUDA C", "cuda");
    for k in &set {
        let name = format!("{}.{}", k.kernel.name, ext(k.target));
        files.push(ExportFile::text(
            Path::new(dir(k.target)).join(&name),
            render(&k.kernel, k.target)?,
        ));
        let line = format!(
            "| `{name}` | {} | {} | {} B |\n",
            k.note,
            k.kernel.workgroup_size,
            k.kernel.shared_bytes()
        );
        match k.target {
            Target::Wgsl => index_wgsl.push_str(&line),
            Target::Cuda => index_cuda.push_str(&line),
        }
    }
    let cuda_kernels: Vec<&Kernel> = set
        .iter()
        .filter(|k| k.target == Target::Cuda)
        .map(|k| &k.kernel)
        .collect();
    files.push(ExportFile::text(
        Path::new("cuda").join("sparse_mla.h"),
        c_header(&cuda_kernels)?,
    ));
    files.push(ExportFile::text(
        Path::new("shaders").join("INDEX.md"),
        index_wgsl,
    ));
    files.push(ExportFile::text(
        Path::new("cuda").join("INDEX.md"),
        index_cuda,
    ));
    Ok(files)
}

fn index_header(lang: &str, folder: &str) -> String {
    format!(
        "# {folder}/: generated {lang} kernels\n\n\
         Written by `mla-export --all` from the descriptions in `src/kernels/`; never edit by hand \
         (`mla-export --check` fails when these differ from what it would write). Each file's \
         header lists its parameters, buffers with shapes, workgroup size and launch grid.\n\n\
         | file | what | threads | workgroup memory |\n|---|---|---|---|\n"
    )
}

/// Language of a per-configuration export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    Wgsl,
    Cuda,
    /// CUDA compiled to PTX by NVRTC for an arch.
    Ptx,
    /// CUDA compiled to machine code (a cubin) by NVRTC for an arch.
    Cubin,
}

impl Lang {
    pub fn name(&self) -> &'static str {
        match self {
            Lang::Wgsl => "wgsl",
            Lang::Cuda => "cuda",
            Lang::Ptx => "ptx",
            Lang::Cubin => "cubin",
        }
    }

    /// The lowering an export of this language carries unless asked otherwise: the
    /// production tensor-core kernels for CUDA, the portable scalar ones for WGSL.
    pub fn default_lowering(&self) -> ExportLowering {
        match self {
            Lang::Wgsl => ExportLowering::Scalar,
            Lang::Cuda | Lang::Ptx | Lang::Cubin => ExportLowering::Mma,
        }
    }
}

/// The GPU architectures an export compiles for (NVRTC names).
pub const ARCHES: [&str; 6] = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"];

/// What one per-configuration export is asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigRequest {
    /// The example call: heads, topk, page size, cache format, tokens (the macros of the launch
    /// header; every one of them stays a run-time parameter of the kernels).
    pub shape: DecodeShape,
    pub splits: Option<u32>,
    /// Multiprocessors of the target GPU.
    pub sms: u32,
    /// Split-kernel workgroups per multiprocessor (None: estimated for `arch`).
    pub per_sm: Option<u32>,
    pub lang: Lang,
    pub lowering: ExportLowering,
    pub arch: String,
}

/// One configuration's kernels and its launch header. CUDA / PTX / cubin: the variant the
/// CUDA runtime picks for the head count under the lowering (tensor cores by default), both
/// of its kernels (the split kernel, which also writes the output itself when a call has one
/// split, and the combine) since the split count changes with the number of tokens per call. WGSL: the portable scalar kernels.
pub fn config_files(req: &ConfigRequest) -> Result<Vec<ExportFile>> {
    let shape = &req.shape;
    shape.validate()?;
    if req.sms == 0 {
        return Err(Error::arg("--sms", "at least 1", 0));
    }
    if let Some(0) = req.per_sm {
        return Err(Error::arg("--per-sm", "at least 1", 0));
    }
    if req.lang != Lang::Wgsl && !ARCHES.contains(&req.arch.as_str()) {
        return Err(Error::arg("--arch", ARCHES.join(", "), &req.arch));
    }
    if req.lang == Lang::Wgsl {
        if req.lowering != ExportLowering::Scalar {
            return Err(Error::arg(
                "--lowering",
                "scalar for --lang wgsl (tensor-core kernels are CUDA only)",
                req.lowering.name(),
            ));
        }
        return wgsl_config_files(req);
    }
    // the head count's variant outside the size rules (DecodeConfig::tensor_core): v7 with
    // tensor cores, on every GPU since v42
    let config = header::cuda_config(req.lowering, shape.format, shape.heads);
    let variants = decode_variants(req.lowering, shape.format)?;
    let variant = variants
        .into_iter()
        .find(|v| v.contains(shape.heads) && v.config == config)
        .ok_or_else(|| Error::arg("--heads", "a head count some variant serves", shape.heads))?;
    let per_sm = req
        .per_sm
        .unwrap_or_else(|| header::estimate_per_sm(&variant.config, &variant.split, &req.arch));
    check_shape(shape, &variant.config)?;
    let blocks = shape.topk.div_ceil(variant.config.block_n);
    if let Some(s) = req.splits {
        if s > blocks {
            return Err(Error::arg(
                "--splits",
                format!(
                    "at most ceil(topk / block_n) = ceil({} / {}) = {blocks}",
                    shape.topk, variant.config.block_n
                ),
                s,
            ));
        }
    }
    // the exported kernels take the plain grid: every token split alike
    let plan = DecodePlan::with_config_whole(
        variant.config,
        shape,
        req.sms * per_sm,
        req.sms,
        req.splits,
        WholeTokens::Off,
    )?;
    let mut files = Vec::new();
    for k in [&variant.split, &variant.combine] {
        let src = render(k, Target::Cuda)?;
        files.push(match req.lang {
            Lang::Cuda => ExportFile::text(format!("{}.cu", k.name), src),
            Lang::Ptx => {
                let c = crate::runtime::cuda::compile(&k.name, &src, &req.arch, false)?;
                ExportFile::text(format!("{}.{}.ptx", k.name, req.arch), c.ptx)
            }
            Lang::Cubin => {
                let c = crate::runtime::cuda::compile(&k.name, &src, &req.arch, false)?;
                ExportFile {
                    path: format!("{}.{}.cubin", k.name, req.arch).into(),
                    contents: c.cubin,
                }
            }
            Lang::Wgsl => unreachable!("handled above"),
        });
    }
    files.push(ExportFile::text(
        launch_header_name(shape, req.lowering),
        header::config_header(
            shape,
            req.lowering,
            &variant,
            &plan,
            req.sms,
            per_sm,
            &req.arch,
        )?,
    ));
    Ok(files)
}

fn launch_header_name(shape: &DecodeShape, lowering: ExportLowering) -> String {
    format!(
        "sparse_mla_h{}_k{}_p{}_{}_{}_launch.h",
        shape.heads,
        shape.topk,
        shape.page_size,
        shape.format.name(),
        lowering.name()
    )
}

/// WGSL: the portable configuration, its split count as the wgpu backend's planner picks it
/// for `sms` multiprocessors (two workgroups each), and a header of the launch numbers.
fn wgsl_config_files(req: &ConfigRequest) -> Result<Vec<ExportFile>> {
    let shape = &req.shape;
    let config = DecodeConfig::portable(shape.dims, shape.format);
    check_shape(shape, &config)?;
    let plan = DecodePlan::new(config, shape, req.sms * 2, req.splits, None)?;
    let (split, combine) = crate::kernels::sparse_mla_decode::lowered_kernels(&plan.config)?;
    let mut kernels = vec![split];
    if plan.splits > 1 {
        kernels.push(combine);
    }
    let mut files = Vec::new();
    for k in &kernels {
        files.push(ExportFile::text(
            format!("{}.wgsl", k.name),
            render(k, Target::Wgsl)?,
        ));
    }
    let grid = plan.grid_split(shape);
    let mut h = format!(
        "// Launch numbers for the WGSL sparse MLA decode: heads {}, topk {}, page size {}, cache {},\n\
         // tokens {}, splits {} (chosen for {} SMs unless given). Generated by mla-export; do not edit.\n\
         // 1. {}: workgroups ({}, {}, tokens) of {} invocations, workgroup memory {} B.\n",
        shape.heads,
        shape.topk,
        shape.page_size,
        shape.format.name(),
        shape.tokens,
        plan.splits,
        req.sms,
        kernels[0].name,
        grid[0],
        grid[1],
        kernels[0].workgroup_size,
        kernels[0].shared_bytes()
    );
    if kernels.len() > 1 {
        h.push_str(&format!(
            "// 2. {}: workgroups ({}, tokens, 1); o_part f32 [tokens, heads, {}, {}], lse_part f32 [tokens, heads, {}]\n",
            kernels[1].name,
            shape.heads,
            plan.splits,
            shape.dims.d_v(),
            plan.splits
        ));
    }
    h.push_str(&format!(
        "// Parameters: one uniform struct per kernel, fields as listed in each .wgsl header.\n\
         #pragma once\n\n#define SPARSE_MLA_HEADS {}\n#define SPARSE_MLA_TOPK {}\n#define SPARSE_MLA_PAGE_SIZE {}\n\
         #define SPARSE_MLA_SPLITS {}\n#define SPARSE_MLA_CHUNK {}\n#define SPARSE_MLA_GRID_X {}\n\
         #define SPARSE_MLA_THREADS {}\n#define SPARSE_MLA_ROW_BYTES {}\n",
        shape.heads,
        shape.topk,
        shape.page_size,
        plan.splits,
        plan.chunk,
        grid[0],
        kernels[0].workgroup_size,
        shape.row_bytes()
    ));
    files.push(ExportFile::text(
        launch_header_name(shape, ExportLowering::Scalar),
        h,
    ));
    Ok(files)
}

/// What [`write_files`] did with one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    /// Created, or replaced (with `force`).
    Wrote,
    /// Already held exactly these bytes: left alone.
    Unchanged,
}

/// Write files under `root`, creating folders. A file that exists with other contents is
/// replaced only with `force`; without it nothing is written and the error lists every such
/// file. Each file is written to a temporary name beside it and renamed over the target, so a
/// reader never sees half a file and an interrupted export leaves the old one.
pub fn write_files(root: &Path, files: &[ExportFile], force: bool) -> Result<Vec<Written>> {
    let io = |p: &Path, e: std::io::Error| Error::Io {
        path: p.display().to_string(),
        source: e,
    };
    let mut outcome = Vec::with_capacity(files.len());
    let mut clash = Vec::new();
    for f in files {
        let p = root.join(&f.path);
        match std::fs::read(&p) {
            Ok(old) if old == f.contents => outcome.push(Written::Unchanged),
            Ok(_) => {
                clash.push(p.display().to_string());
                outcome.push(Written::Wrote);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => outcome.push(Written::Wrote),
            Err(e) if p.is_dir() => {
                return Err(Error::arg(
                    "--out",
                    "a folder where the exported files can be written",
                    format!("{} is a directory ({e})", p.display()),
                ))
            }
            Err(e) => return Err(io(&p, e)),
        }
    }
    if !clash.is_empty() && !force {
        return Err(Error::arg(
            "--force",
            "to be given to replace existing files with other contents (nothing was written)",
            format!("not given; these differ: {}", clash.join(", ")),
        ));
    }
    for (f, w) in files.iter().zip(&outcome) {
        if *w == Written::Unchanged {
            continue;
        }
        let p = root.join(&f.path);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = p.with_file_name(format!(".{name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, &f.contents).map_err(|e| io(&tmp, e))?;
        if let Err(e) = std::fs::rename(&tmp, &p) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&p, e));
        }
    }
    Ok(outcome)
}

/// Entries of `root`'s `shaders/` and `cuda/` that `files` does not contain, relative to
/// `root`, sorted: what [`stale_files`] reports and [`remove_stale`] picks from.
fn unlisted(root: &Path, files: &[ExportFile]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in ["shaders", "cuda"] {
        if let Ok(entries) = std::fs::read_dir(root.join(d)) {
            for e in entries.flatten() {
                let rel = Path::new(d).join(e.file_name());
                if !files.iter().any(|f| f.path == rel) {
                    out.push(rel);
                }
            }
        }
    }
    out.sort();
    out
}

/// Kernel files under `root`'s `shaders/` and `cuda/` that `mla-export` wrote (their first
/// line carries [`crate::emit::GENERATED_MARK`]) and `files` no longer contains, such as a
/// kernel whose name changed: removed where `remove`, else only listed. Other files there
/// are left alone (and [`stale_files`] still reports them). Returns the paths, relative to
/// `root`, sorted.
pub fn remove_stale(root: &Path, files: &[ExportFile], remove: bool) -> Result<Vec<PathBuf>> {
    let mut gone = Vec::new();
    for rel in unlisted(root, files) {
        let path = root.join(&rel);
        let Ok(f) = std::fs::File::open(&path) else {
            continue;
        };
        // the first line only (a folder fails to read and is skipped)
        let mut first = String::new();
        if std::io::BufRead::read_line(&mut std::io::BufReader::new(f), &mut first).is_err()
            || !first.contains(crate::emit::GENERATED_MARK)
        {
            continue;
        }
        if remove {
            std::fs::remove_file(&path).map_err(|source| Error::Io {
                path: path.display().to_string(),
                source,
            })?;
        }
        gone.push(rel);
    }
    Ok(gone)
}

/// Files under `root` that differ from (or are missing for) `files`, plus generated files in
/// `shaders/` and `cuda/` that the set no longer contains.
pub fn stale_files(root: &Path, files: &[ExportFile]) -> Vec<String> {
    let mut stale = Vec::new();
    for f in files {
        match std::fs::read(root.join(&f.path)) {
            Ok(s) if s == f.contents => {}
            Ok(_) => stale.push(format!("{} differs", f.path.display())),
            Err(_) => stale.push(format!("{} is missing", f.path.display())),
        }
    }
    for rel in unlisted(root, files) {
        stale.push(format!("{} is not in the standard set", rel.display()));
    }
    stale.sort();
    stale
}
