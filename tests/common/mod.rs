//! Shared by the integration tests: one backend per kind per test process, and the rule
//! for a backend that is absent (skip with the reason, unless SPARSE_MLA_REQUIRE names it).

#![allow(dead_code)]

use sparse_mla::runtime::{discover, Backend, BackendKind};
use std::sync::OnceLock;

/// Kinds that must be present (comma list in `SPARSE_MLA_REQUIRE`, e.g. `wgpu,nvrtc`): CI
/// sets it so that a missing lavapipe or NVRTC fails instead of skipping.
pub fn required(what: &str) -> bool {
    std::env::var("SPARSE_MLA_REQUIRE")
        .map(|v| v.split(',').any(|k| k.trim() == what))
        .unwrap_or(false)
}

/// Report a skipped backend; panics when it is required.
pub fn skip(what: &str, reason: &str) {
    if required(what) {
        panic!("{what} is required (SPARSE_MLA_REQUIRE) but unavailable: {reason}");
    }
    eprintln!("SKIPPED {what}: {reason}");
}

type Shared = Result<Box<dyn Backend>, String>;

fn first(kind: BackendKind) -> Shared {
    let mut reasons = Vec::new();
    for (_, b) in discover(&[kind]) {
        match b {
            Ok(b) => return Ok(b),
            Err(e) => reasons.push(e.to_string()),
        }
    }
    Err(reasons.join("; "))
}

/// The first backend of `kind` on this machine, shared by all tests of the process.
pub fn backend(kind: BackendKind) -> Option<&'static dyn Backend> {
    static CPU: OnceLock<Shared> = OnceLock::new();
    static WGPU: OnceLock<Shared> = OnceLock::new();
    static CUDA: OnceLock<Shared> = OnceLock::new();
    let cell = match kind {
        BackendKind::Cpu => &CPU,
        BackendKind::Wgpu => &WGPU,
        BackendKind::Cuda => &CUDA,
    };
    match cell.get_or_init(|| first(kind)) {
        Ok(b) => Some(b.as_ref()),
        Err(reason) => {
            skip(kind.name(), reason);
            None
        }
    }
}

type SharedArc = Result<std::sync::Arc<dyn Backend>, String>;

/// [`backend`] as a shared handle (what `Model` takes).
pub fn backend_arc(kind: BackendKind) -> Option<std::sync::Arc<dyn Backend>> {
    static CPU: OnceLock<SharedArc> = OnceLock::new();
    static WGPU: OnceLock<SharedArc> = OnceLock::new();
    static CUDA: OnceLock<SharedArc> = OnceLock::new();
    let cell = match kind {
        BackendKind::Cpu => &CPU,
        BackendKind::Wgpu => &WGPU,
        BackendKind::Cuda => &CUDA,
    };
    match cell.get_or_init(|| first(kind).map(std::sync::Arc::from)) {
        Ok(b) => Some(b.clone()),
        Err(reason) => {
            skip(kind.name(), reason);
            None
        }
    }
}

/// A backend of `kind` of its own (not shared with the other tests of the process): for
/// checks that read its counters.
pub fn fresh_backend_arc(kind: BackendKind) -> Option<std::sync::Arc<dyn Backend>> {
    match first(kind) {
        Ok(b) => Some(std::sync::Arc::from(b)),
        Err(reason) => {
            skip(kind.name(), &reason);
            None
        }
    }
}

/// `f` over every item on all cores, results in the items' order. The NVRTC checks compile
/// hundreds of independent (kernel, arch) programs; one at a time they leave a CI machine's
/// other cores idle. NVRTC is thread-safe for distinct programs.
pub fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(items.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                results.lock().unwrap()[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every item mapped"))
        .collect()
}

/// The architectures every emitted CUDA kernel must compile for (NVRTC, no spills).
pub const NVRTC_ARCHS: [&str; 4] = ["sm_80", "sm_89", "sm_90", "sm_120"];

/// Every kernel emitted as CUDA C (which must be self-contained: no `#include`) and compiled
/// by NVRTC for every arch of [`NVRTC_ARCHS`] with ptxas's report, each (kernel, arch) its own
/// program, on all cores: `(kernel index, arch, result)` in the kernels' then the archs' order.
pub fn compile_every_arch(
    kernels: &[sparse_mla::kir::Kernel],
) -> Vec<(
    usize,
    &'static str,
    sparse_mla::Result<sparse_mla::runtime::cuda::Compiled>,
)> {
    let sources: Vec<String> = kernels
        .iter()
        .map(|kernel| {
            let src = sparse_mla::emit::cuda::emit(kernel).expect("emit");
            assert!(
                !src.contains("#include"),
                "{}: CUDA C must be self-contained",
                kernel.name
            );
            src
        })
        .collect();
    let jobs: Vec<(usize, &'static str)> = (0..kernels.len())
        .flat_map(|i| NVRTC_ARCHS.map(|arch| (i, arch)))
        .collect();
    let compiled = par_map(&jobs, |&(i, arch)| {
        sparse_mla::runtime::cuda::compile(&kernels[i].name, &sources[i], arch, true)
    });
    jobs.into_iter()
        .zip(compiled)
        .map(|((i, arch), r)| (i, arch, r))
        .collect()
}

/// ptxas's register and spill lines of an NVRTC log, trimmed, and whether any of them
/// reports a spill.
pub fn ptxas_report(log: &str) -> (Vec<&str>, bool) {
    let report: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("registers") || l.contains("spill"))
        .map(str::trim)
        .collect();
    let spills = report
        .iter()
        .any(|l| l.contains("spill") && !l.contains("0 bytes spill stores, 0 bytes spill loads"));
    (report, spills)
}
