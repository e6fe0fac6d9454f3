//! The stress run: many random sparse-decode launches, each checked against the float64
//! reference like a conformance case, under a watchdog.
//!
//! Shapes are drawn log-uniformly — H 1–128, topk 1–4096, T 1–256, page sizes 1 to 64
//! (53 included), both cache formats and scale flavours, every index pattern (valid, mixed
//! invalid / duplicate / out-of-range, empty rows), `topk_length`, forced splits 1–16,
//! multi-token s_q, padded strides — and a case whose `T · H · topk` exceeds the per-launch
//! budget is drawn again (the reference is float64 on the host; the budget keeps a run of
//! 10⁴ launches to minutes). Inputs and references are computed on worker threads while the
//! device runs earlier cases.
//!
//! The watchdog: a launch (with its download) that has not returned after `watchdog`
//! seconds is a hang. Nothing can cancel a running GPU kernel, so the run prints the case
//! and its seed and exits the process with status 3.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::decode::{
    check_decode_case, prepare_decode_case, DecodeCase, IndexPattern, QRange, ScaleBand,
};
use crate::mla::{CacheFormat, ScaleFlavour};
use crate::runtime::Backend;
use crate::util::Rng;

/// What a stress run is asked to do.
#[derive(Clone, Debug)]
pub struct StressOptions {
    pub launches: usize,
    pub seed: u64,
    /// Largest `T · H · topk` of one launch.
    pub max_pairs: u64,
    /// Seconds one launch may take before it counts as a hang.
    pub watchdog_s: f64,
    /// Worker threads for inputs and references (0: one per core, less one).
    pub threads: usize,
}

/// What a stress run found.
#[derive(Clone, Debug, Default)]
pub struct StressReport {
    pub launches: usize,
    pub wrong: usize,
    /// Launches the backend refused with an error (a refusal of a valid shape is a failure).
    pub errors: usize,
    /// Forced split counts the device refused by its own limit (lavapipe's loop budget
    /// needs enough splits for a long top-k): a clear refusal, counted, not a failure.
    pub refused_splits: usize,
    pub hangs: usize,
    pub worst_rel_l2: f64,
    pub worst_lse: f64,
    pub slowest_s: f64,
    pub seconds: f64,
    /// The first failures: case name, seed and what was wrong.
    pub failures: Vec<String>,
}

impl StressReport {
    pub fn passed(&self) -> bool {
        self.wrong == 0 && self.errors == 0 && self.hangs == 0 && self.launches > 0
    }
}

fn log_uniform(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    let (a, b) = ((lo as f64).ln(), (hi as f64 + 1.0).ln());
    ((a + rng.unit() * (b - a)).exp() as u32).clamp(lo, hi)
}

/// One random case within the budget.
pub fn random_case(rng: &mut Rng, max_pairs: u64) -> DecodeCase {
    loop {
        let s_q = if rng.below(8) == 0 { 2 } else { 1 };
        let mut tokens = log_uniform(rng, 1, 256);
        if s_q == 2 {
            tokens = (tokens + 1) & !1;
        }
        let heads = log_uniform(rng, 1, 128);
        let topk = log_uniform(rng, 1, 4096);
        if tokens as u64 * heads as u64 * topk as u64 > max_pairs {
            continue;
        }
        let page_size = [1, 2, 16, 53, 64][rng.below(5) as usize];
        // Enough slots for topk distinct ones, sometimes many more (indices spread wide).
        let slots = topk as u64 + rng.below(topk as u64 * 3 + 64);
        let num_pages = slots.div_ceil(page_size as u64).max(1) as u32;
        let (format, flavour) = match rng.below(3) {
            0 => (CacheFormat::Bf16, ScaleFlavour::Arbitrary),
            1 => (CacheFormat::Fp8DsMla, ScaleFlavour::Pow2),
            _ => (CacheFormat::Fp8DsMla, ScaleFlavour::Arbitrary),
        };
        let pattern = match rng.below(4) {
            0 => IndexPattern::Valid,
            1 => IndexPattern::SomeRowsEmpty,
            _ => IndexPattern::Mixed,
        };
        let splits = if rng.below(3) == 0 {
            Some(1 + rng.below(16) as u32)
        } else {
            None
        };
        let mut case = DecodeCase {
            name: String::new(),
            tokens,
            heads,
            topk,
            page_size,
            num_pages,
            format,
            flavour,
            pattern,
            topk_length: rng.below(4) == 0,
            splits,
            s_q,
            // a sixth strided: half of those by one word (rows off 16 bytes)
            stride_pad: match rng.below(12) {
                0 => 16,
                1 => 4,
                _ => 0,
            },
            // a quarter of the fp8 cases with scales over 18 binades (ScaleBand::Wide)
            band: if format == CacheFormat::Fp8DsMla && rng.below(4) == 0 {
                ScaleBand::Wide
            } else {
                ScaleBand::Flavour
            },
            // a tenth each with q's latent all zero and with heads 14 binades apart
            q_range: match rng.below(10) {
                0 => QRange::LatentZero,
                1 => QRange::HeadsWide,
                _ => QRange::Normal,
            },
        };
        case.name = format!(
            "stress_t{tokens}_h{heads}_k{topk}_p{page_size}{}{}{}{}{}{}{}{}",
            match (format, flavour) {
                (CacheFormat::Bf16, _) => "",
                (_, ScaleFlavour::Pow2) => "_fp8pow2",
                _ => "_fp8",
            },
            match pattern {
                IndexPattern::Valid => "",
                IndexPattern::Mixed => "_mixed",
                IndexPattern::SomeRowsEmpty => "_empty_rows",
                IndexPattern::Rising => "_rising",
            },
            if case.topk_length { "_len" } else { "" },
            if s_q > 1 { "_sq2" } else { "" },
            case.stride_tag(),
            if case.band == ScaleBand::Wide {
                "_wide"
            } else {
                ""
            },
            match case.q_range {
                QRange::Normal => "",
                QRange::LatentZero => "_q_latent0",
                QRange::HeadsWide => "_q_wide",
            },
            splits.map(|s| format!("_s{s}")).unwrap_or_default(),
        );
        return case;
    }
}

/// Runs the stress on `backend`; `progress(done)` is called after each launch.
pub fn run(
    backend: &dyn Backend,
    opts: &StressOptions,
    progress: &mut dyn FnMut(usize),
) -> StressReport {
    let t0 = Instant::now();
    let threads = if opts.threads > 0 {
        opts.threads
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get().saturating_sub(1).max(1))
            .unwrap_or(1)
    };
    // Cases are drawn up front from one seed, so a run is replayable whatever the threads do.
    let mut rng = Rng::new(opts.seed);
    let cases: Vec<(DecodeCase, u64)> = (0..opts.launches)
        .map(|_| (random_case(&mut rng, opts.max_pairs), rng.next_u64()))
        .collect();
    let cases = Arc::new(cases);
    let next = Arc::new(AtomicU64::new(0));
    // A bounded queue: workers run ahead of the device by at most 2 cases each.
    let (tx, rx) = mpsc::sync_channel(threads * 2);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (cases, next, tx, stop) = (cases.clone(), next.clone(), tx.clone(), stop.clone());
            std::thread::spawn(move || loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some((case, seed)) = cases.get(i) else {
                    return;
                };
                let prepared = prepare_decode_case(case, *seed);
                if tx.send((i, prepared)).is_err() {
                    return;
                }
            })
        })
        .collect();
    drop(tx);

    // The watchdog: `current` holds the running case and when it started.
    let current: Arc<Mutex<Option<(String, u64, Instant)>>> = Arc::new(Mutex::new(None));
    let watchdog = {
        let (current, stop) = (current.clone(), stop.clone());
        let limit = Duration::from_secs_f64(opts.watchdog_s);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let hung = current
                    .lock()
                    .ok()
                    .and_then(|c| c.clone())
                    .filter(|(_, _, since)| since.elapsed() > limit);
                if let Some((name, seed, since)) = hung {
                    eprintln!(
                        "stress: HANG: {name} (seed {seed}) has not returned after {:.1} s; \
                         a GPU kernel cannot be cancelled, exiting",
                        since.elapsed().as_secs_f64()
                    );
                    std::process::exit(3);
                }
            }
        })
    };

    let mut report = StressReport::default();
    let mut pending = std::collections::BTreeMap::new();
    let mut want = 0usize;
    for (i, prepared) in rx.iter() {
        pending.insert(i, prepared);
        while let Some(prepared) = pending.remove(&want) {
            let (case, seed) = &cases[want];
            want += 1;
            report.launches += 1;
            let prepared = match prepared {
                Ok(p) => p,
                Err(e) => {
                    report.errors += 1;
                    report
                        .failures
                        .push(format!("{} seed {seed}: inputs: {e}", case.name));
                    continue;
                }
            };
            if let Ok(mut c) = current.lock() {
                *c = Some((case.name.clone(), *seed, Instant::now()));
            }
            let started = Instant::now();
            let outcome = check_decode_case(backend, case, &prepared);
            report.slowest_s = report.slowest_s.max(started.elapsed().as_secs_f64());
            if let Ok(mut c) = current.lock() {
                *c = None;
            }
            match outcome {
                Ok(o) => {
                    report.worst_rel_l2 = report.worst_rel_l2.max(o.rel_l2);
                    report.worst_lse = report.worst_lse.max(o.lse_err);
                    if !o.passed() {
                        report.wrong += 1;
                        if report.failures.len() < 10 {
                            report.failures.push(format!(
                                "{} seed {seed}: {}",
                                case.name,
                                o.failures.join("; ")
                            ));
                        }
                    }
                }
                Err(crate::Error::InvalidArgument { arg, .. })
                    if arg == "splits" && case.splits.is_some() =>
                {
                    report.refused_splits += 1;
                }
                Err(e) => {
                    report.errors += 1;
                    if report.failures.len() < 10 {
                        report
                            .failures
                            .push(format!("{} seed {seed}: {e}", case.name));
                    }
                }
            }
            progress(report.launches);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let _ = watchdog.join();
    report.seconds = t0.elapsed().as_secs_f64();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_cases_stay_in_budget_and_cover_the_space() {
        let mut rng = Rng::new(5);
        let cases: Vec<_> = (0..3000).map(|_| random_case(&mut rng, 1 << 18)).collect();
        for c in &cases {
            assert!(c.tokens as u64 * c.heads as u64 * c.topk as u64 <= 1 << 18);
            assert!(c.num_pages as u64 * c.page_size as u64 >= c.topk as u64);
            assert_eq!(c.tokens % c.s_q, 0);
        }
        let any = |f: &dyn Fn(&DecodeCase) -> bool| cases.iter().any(f);
        assert!(any(&|c| c.heads == 128) && any(&|c| c.heads == 1));
        assert!(any(&|c| c.topk > 2048) && any(&|c| c.topk == 1));
        assert!(any(&|c| c.tokens > 128));
        assert!(any(&|c| c.page_size == 53) && any(&|c| c.page_size == 1));
        assert!(any(&|c| c.format == CacheFormat::Fp8DsMla) && any(&|c| c.stride_pad == 4));
        assert!(any(&|c| c.topk_length) && any(&|c| c.s_q == 2) && any(&|c| c.splits.is_some()));
    }
}
