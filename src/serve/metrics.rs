//! The server's Prometheus metrics (`GET /metrics`, text exposition format 0.0.4): counters
//! and gauges as atomics, histograms with fixed buckets. Written here rather than taken from a
//! metrics crate: a dozen series, no labels beyond endpoint and status, and nothing to
//! register at run time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// A histogram with cumulative buckets (Prometheus' `le`).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// The sum, as f64 bits (updated by compare-and-swap).
    sum: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if v <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        let _ = self.sum.fetch_update(Relaxed, Relaxed, |s| {
            Some((f64::from_bits(s) + v).to_bits())
        });
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Relaxed));
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count());
        let _ = writeln!(
            out,
            "{name}_sum {}\n{name}_count {}",
            f64::from_bits(self.sum.load(Relaxed)),
            self.count()
        );
    }
}

/// Latency buckets in seconds: 1 ms to 60 s.
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Sequences per step.
const BATCH: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// What the engine has done, as counted by the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: u64,
    pub waiting: u64,
    pub free_pages: u64,
    pub total_pages: u64,
    pub steps: u64,
    pub preemptions: u64,
    /// Sequences freed before their end because the client went away or cancelled.
    pub cancelled: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
}

#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed)
    }
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, v: u64) {
        self.0.fetch_add(v, Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

pub struct Metrics {
    /// (endpoint, HTTP status) → requests answered.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub running: Gauge,
    pub waiting: Gauge,
    pub free_pages: Gauge,
    pub total_pages: Gauge,
    pub steps: Counter,
    pub preemptions: Counter,
    pub cancelled: Counter,
    /// Prompt tokens run through the model (a preempted sequence's recompute counts again).
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub batch_size: Histogram,
    pub step_seconds: Histogram,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            running: Gauge::default(),
            waiting: Gauge::default(),
            free_pages: Gauge::default(),
            total_pages: Gauge::default(),
            steps: Counter::default(),
            preemptions: Counter::default(),
            cancelled: Counter::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            batch_size: Histogram::new(BATCH),
            step_seconds: Histogram::new(SECONDS),
            ttft: Histogram::new(SECONDS),
            itl: Histogram::new(SECONDS),
            e2e: Histogram::new(SECONDS),
        }
    }

    pub fn request(&self, endpoint: &'static str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint, status)).or_default() += 1;
        }
    }

    pub fn engine_stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.get(),
            waiting: self.waiting.get(),
            free_pages: self.free_pages.get(),
            total_pages: self.total_pages.get(),
            steps: self.steps.get(),
            preemptions: self.preemptions.get(),
            cancelled: self.cancelled.get(),
            prompt_tokens: self.prompt_tokens.get(),
            generated_tokens: self.generated_tokens.get(),
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP mla_serve_requests_total HTTP requests answered, by endpoint and status.\n# TYPE mla_serve_requests_total counter"
        );
        if let Ok(m) = self.requests.lock() {
            for ((e, s), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "mla_serve_requests_total{{endpoint=\"{e}\",status=\"{s}\"}} {n}"
                );
            }
        }
        let mut one = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        one(
            "mla_serve_prompt_tokens_total",
            "counter",
            "Prompt tokens run through the model (recomputed ones after a preemption count again).",
            self.prompt_tokens.get(),
        );
        one(
            "mla_serve_generation_tokens_total",
            "counter",
            "Tokens generated.",
            self.generated_tokens.get(),
        );
        one(
            "mla_serve_steps_total",
            "counter",
            "Forward steps the engine ran.",
            self.steps.get(),
        );
        one(
            "mla_serve_preemptions_total",
            "counter",
            "Sequences preempted (pages freed, recomputed later) because the page pool ran out.",
            self.preemptions.get(),
        );
        one(
            "mla_serve_cancelled_total",
            "counter",
            "Sequences freed early: client disconnected, or a stop string ended the text.",
            self.cancelled.get(),
        );
        one(
            "mla_serve_queue_depth",
            "gauge",
            "Requests waiting for a batch slot (preempted ones included).",
            self.waiting.get(),
        );
        one(
            "mla_serve_running_sequences",
            "gauge",
            "Sequences in the running batch.",
            self.running.get(),
        );
        one(
            "mla_serve_cache_free_pages",
            "gauge",
            "KV cache pages free in the pool.",
            self.free_pages.get(),
        );
        one(
            "mla_serve_cache_pages",
            "gauge",
            "KV cache pages in the pool.",
            self.total_pages.get(),
        );
        self.batch_size.render(
            &mut out,
            "mla_serve_batch_size",
            "Sequences per forward step.",
        );
        self.step_seconds.render(
            &mut out,
            "mla_serve_step_seconds",
            "Wall time of a forward step and its sampling.",
        );
        self.ttft.render(
            &mut out,
            "mla_serve_time_to_first_token_seconds",
            "From the request's arrival to its first token.",
        );
        self.itl.render(
            &mut out,
            "mla_serve_inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
        );
        self.e2e.render(
            &mut out,
            "mla_serve_request_seconds",
            "From the request's arrival to its last token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 3.0] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"2\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_sum 6.5\nx_count 4\n"), "{s}");
    }

    #[test]
    fn render_has_every_series() {
        let m = Metrics::new();
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 200);
        m.waiting.set(3);
        let s = m.render();
        assert!(
            s.contains("mla_serve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2")
        );
        assert!(s.contains("mla_serve_queue_depth 3"));
        for name in [
            "mla_serve_batch_size_bucket",
            "mla_serve_time_to_first_token_seconds_count",
            "mla_serve_inter_token_latency_seconds_sum",
        ] {
            assert!(s.contains(name), "{name}");
        }
    }
}
