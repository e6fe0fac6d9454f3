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
