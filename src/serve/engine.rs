//! The engine: one thread that owns the model and its cache and runs continuous batching.
//!
//! Each turn of its loop:
//! 1. takes the requests that arrived (never blocking while there is work);
//! 2. frees the sequences whose client went away or cancelled — before anything runs;
//! 3. admits waiting requests while the batch has room and the pool has the pages their
//!    prompt needs beyond what the running sequences are already promised;
//! 4. plans the step: one token for every decoding sequence, then prompt chunks up to
//!    `max_step_tokens`; if the pool cannot hold the step, the newest sequence is preempted
//!    (pages freed, put back at the front of the queue, recomputed later from its prompt and
//!    the tokens it produced) until it can;
//! 5. runs all of it as one [`Model::step`] — `T` = the step's tokens, each with its own
//!    position and top-k list — and samples every sequence that reached its last token, with
//!    its own temperature / top-k / top-p and its own seeded generator (rows with the same
//!    settings are sampled in one launch);
//! 6. sends each token to its request and retires the finished.
//!
//! A request's generator draws one uniform per token whatever else runs, and a preempted
//! sequence resumes from exactly the tokens it had: its output does not depend on the
//! batch it ran in (on backends whose ops are computed row by row, as the CPU reference and
//! the wgpu kernels are).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::model::cache::{CacheOptions, KvCache, SeqId};
use crate::model::device::Tensor;
use crate::model::sampler::draw_uniform;
use crate::model::{Logits, Model, SamplerConfig, StepInput};
use crate::util::Rng;
use crate::{Error, Result};

pub use super::metrics::EngineStats;

/// How the engine batches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineOptions {
    /// The cache: `max_seqs` is the largest batch, `max_seq_len` the context of one sequence,
    /// `num_pages` the pool (`None`: room for `max_seqs` full sequences, so nothing is ever
    /// preempted).
    pub cache: CacheOptions,
    /// Tokens one step runs at most (decode tokens and prompt chunks together); bounds the
    /// activations. At least `cache.max_seqs`.
    pub max_step_tokens: usize,
    /// Replay decode steps from CUDA graphs (other backends ignore it).
    pub cuda_graphs: bool,
}

impl EngineOptions {
    pub fn validate(&self) -> Result<()> {
        self.cache.validate()?;
        if self.max_step_tokens < self.cache.max_seqs {
            return Err(Error::arg(
                "--max-step-tokens",
                format!(
                    "at least --max-batch = {} (each running sequence decodes one token per step)",
                    self.cache.max_seqs
                ),
                self.max_step_tokens,
            ));
        }
        Ok(())
    }
}

/// What a request may ask for, fixed when the engine starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Positions one sequence may hold (prompt + generated).
    pub max_seq_len: usize,
    pub page_size: usize,
    pub total_pages: usize,
    pub vocab_size: usize,
    pub max_batch: usize,
}

impl Limits {
    /// The most tokens one sequence can hold: its context, and the whole pool (a sequence
    /// alone in the batch must fit, or preemption could not make room for it).
    pub fn max_tokens_per_sequence(&self) -> usize {
        self.max_seq_len.min(self.total_pages * self.page_size)
    }
}

/// One generation: a prompt and how to continue it.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Most likely alternatives to report per token (0: only the chosen token's logprob).
    pub top_logprobs: usize,
    /// End at an end-of-sequence token of the model's config (`ignore_eos` turns it off).
    pub stop_at_eos: bool,
    pub events: UnboundedSender<Event>,
    /// Set by the HTTP side to end the generation early (a stop string matched, the client
    /// went away); the engine frees the sequence before its next step.
    pub cancel: Arc<AtomicBool>,
}

/// A generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    pub id: u32,
    /// `log_softmax(logits)[id]` of the raw logits.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens and their logprobs, most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// An end-of-sequence token (not sent as a token).
    Eos,
}

/// What the engine sends a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(Generated),
    Done(Finish),
    /// The device failed under this request (not a fault of the request).
    Failed(String),
}

enum Command {
    Submit(Job),
    Shutdown,
}

/// The handle the HTTP side holds.
pub struct Engine {
    tx: Mutex<Option<mpsc::Sender<Command>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub limits: Limits,
}

impl Engine {
    /// Starts the engine thread, which loads the model (`load` runs there) and makes its
    /// cache; returns once it is ready, or with the error that stopped it.
    pub fn spawn(
        opts: EngineOptions,
        load: super::ModelLoader,
        metrics: Arc<Metrics>,
    ) -> Result<Engine> {
        opts.validate()?;
        let (tx, rx) = mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Limits>>();
        let thread = std::thread::Builder::new()
            .name("mla-serve-engine".into())
            .spawn(move || {
                let started = (|| -> Result<(Model, KvCache)> {
                    let model = load()?;
                    model.set_graphs(opts.cuda_graphs);
                    let cache = model.new_cache(opts.cache)?;
                    Ok((model, cache))
                })();
                match started {
                    Ok((model, cache)) => {
                        let limits = Limits {
                            max_seq_len: opts.cache.max_seq_len,
                            page_size: opts.cache.page_size,
                            total_pages: opts.cache.pages(),
                            vocab_size: model.config.vocab_size,
                            max_batch: opts.cache.max_seqs,
                        };
                        let _ = ready_tx.send(Ok(limits));
                        Scheduler::new(model, cache, opts, metrics).run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::Io {
                path: "engine thread".into(),
                source: e,
            })?;
        let limits = ready_rx
            .recv()
            .map_err(|_| Error::Model("the engine thread stopped while loading".into()))??;
        Ok(Engine {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            limits,
        })
    }

    /// Queues a job; gives it back when the engine has stopped.
    pub fn submit(&self, job: Job) -> std::result::Result<(), Job> {
        let guard = match self.tx.lock() {
            Ok(g) => g,
            Err(_) => return Err(job),
        };
        match guard.as_ref() {
            Some(tx) => tx.send(Command::Submit(job)).map_err(|e| match e.0 {
                Command::Submit(j) => j,
                Command::Shutdown => unreachable!("only jobs are sent here"),
            }),
            None => Err(job),
        }
    }

    /// Stops the engine (requests still running get [`Event::Failed`]) and joins its thread.
    pub fn shutdown(&self) {
        if let Ok(mut tx) = self.tx.lock() {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Command::Shutdown);
            }
        }
        if let Ok(mut t) = self.thread.lock() {
            if let Some(t) = t.take() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request inside the engine.
struct Live {
    job: Job,
    rng: Rng,
    /// Prompt, then the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Its row of the cache while it runs.
    seq: Option<SeqId>,
    /// Leading tokens whose cache rows are written.
    fed: usize,
    /// Order of admission: the largest is the newest, preempted first.
    admitted: u64,
}

impl Live {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn cancelled(&self) -> bool {
        self.job.cancel.load(Ordering::Relaxed) || self.job.events.is_closed()
    }
}

/// Rows sampled together must share the sampler's scalar settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum SampleKey {
    Greedy,
    Sampled {
        temperature: u32,
        top_k: usize,
        top_p: u32,
    },
}

fn sample_key(c: &SamplerConfig) -> SampleKey {
    if c.temperature == 0.0 {
        SampleKey::Greedy
    } else {
        SampleKey::Sampled {
            temperature: c.temperature.to_bits(),
            top_k: c.top_k,
            top_p: c.top_p.to_bits(),
        }
    }
}

/// One sequence's share of the planned step.
struct Planned {
    /// Index into `running`.
    run: usize,
    tokens: usize,
    /// Reaches the end of its tokens: its row is sampled.
    samples: bool,
    key: SampleKey,
}

struct Scheduler {
    model: Model,
    cache: KvCache,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Live>,
    running: Vec<Live>,
    admissions: u64,
}

fn pages_for(tokens: usize, page_size: usize) -> usize {
    tokens.div_ceil(page_size)
}

impl Scheduler {
    fn new(model: Model, cache: KvCache, opts: EngineOptions, metrics: Arc<Metrics>) -> Self {
        metrics.total_pages.set(opts.cache.pages() as u64);
        metrics.free_pages.set(cache.free_pages() as u64);
        Scheduler {
            model,
            cache,
            opts,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
        }
    }

    fn enqueue(&mut self, job: Job) {
        let rng = Rng::new(job.sampling.seed);
        let prompt_len = job.prompt.len();
        let tokens = job.prompt.clone();
        self.waiting.push_back(Live {
            job,
            rng,
            tokens,
            prompt_len,
            seq: None,
            fed: 0,
            admitted: 0,
        });
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // 1. New requests: wait for one when idle, else take what is there.
            if self.running.is_empty() && self.waiting.is_empty() {
                self.publish();
                match rx.recv() {
                    Ok(Command::Submit(job)) => self.enqueue(job),
                    Ok(Command::Shutdown) | Err(_) => break,
                }
            }
            let mut stop = false;
            loop {
                match rx.try_recv() {
                    Ok(Command::Submit(job)) => self.enqueue(job),
                    Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                        stop = true;
                        break;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            if stop {
                break;
            }
            self.drop_cancelled();
            self.admit();
            if self.running.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            let plan = self.plan_step();
            if plan.is_empty() {
                continue;
            }
            self.run_step(plan);
            self.metrics
                .step_seconds
                .observe(t0.elapsed().as_secs_f64());
            self.publish();
        }
        for l in self.running.drain(..).chain(self.waiting.drain(..)) {
            let _ = l
                .job
                .events
                .send(Event::Failed("the server is shutting down".into()));
        }
        self.publish();
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as u64);
        m.waiting.set(self.waiting.len() as u64);
        m.free_pages.set(self.cache.free_pages() as u64);
    }

    fn free(&mut self, l: &Live) {
        if let Some(s) = l.seq {
            if let Err(e) = self.cache.remove_sequence(s) {
                log::error!("freeing sequence {}: {e}", s.0);
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let l = self.running.remove(i);
                self.free(&l);
                self.metrics.cancelled.add(1);
            } else {
                i += 1;
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|l| !l.cancelled());
        self.metrics
            .cancelled
            .add((before - self.waiting.len()) as u64);
    }

    /// Pages the running sequences still need to write every token they hold.
    fn promised_pages(&self) -> usize {
        let ps = self.opts.cache.page_size;
        self.running
            .iter()
            .map(|l| {
                let held = l
                    .seq
                    .and_then(|s| self.cache.pages(s).ok())
                    .map_or(0, |p| p.len());
                pages_for(l.tokens.len(), ps).saturating_sub(held)
            })
            .sum()
    }

    fn admit(&mut self) {
        let ps = self.opts.cache.page_size;
        while self.running.len() < self.opts.cache.max_seqs {
            let Some(front) = self.waiting.front() else {
                break;
            };
            // Its whole prompt, and one page of headroom for the next decode tokens of the
            // batch, so that admitting it does not preempt someone at once.
            let need = pages_for(front.tokens.len(), ps);
            let headroom = usize::from(!self.running.is_empty());
            let promised = self.promised_pages();
            if self.cache.free_pages() < promised + need + headroom && !self.running.is_empty() {
                break;
            }
            let Some(mut l) = self.waiting.pop_front() else {
                break;
            };
            match self.cache.add_sequence() {
                Ok(s) => {
                    l.seq = Some(s);
                    l.fed = 0;
                    self.admissions += 1;
                    l.admitted = self.admissions;
                    self.running.push(l);
                }
                Err(e) => {
                    log::error!("no cache row for an admitted request: {e}");
                    self.waiting.push_front(l);
                    break;
                }
            }
        }
    }

    /// The step's inputs, preempting the newest sequences until the pool holds it.
    fn plan_step(&mut self) -> Vec<Planned> {
        let ps = self.opts.cache.page_size;
        loop {
            let mut budget = self.opts.max_step_tokens;
            let mut plan = Vec::new();
            // Decoding sequences first (one token each), then prompt chunks, oldest first.
            let mut order: Vec<usize> = (0..self.running.len()).collect();
            order.sort_by_key(|&i| {
                let l = &self.running[i];
                (l.tokens.len() - l.fed > 1, l.admitted)
            });
            let mut need = 0usize;
            for i in order {
                let l = &self.running[i];
                let pending = l.tokens.len() - l.fed;
                let n = pending.min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                let held = l
                    .seq
                    .and_then(|s| self.cache.pages(s).ok())
                    .map_or(0, |p| p.len());
                need += pages_for(l.fed + n, ps).saturating_sub(held);
                plan.push(Planned {
                    run: i,
                    tokens: n,
                    samples: n == pending,
                    key: sample_key(&l.job.sampling),
                });
            }
            if need <= self.cache.free_pages() {
                // Rows of one sampler setting next to each other; unsampled rows last.
                plan.sort_by_key(|p| (!p.samples, p.key));
                return plan;
            }
            // Preempt the newest; it is recomputed from all its tokens when readmitted.
            let Some(newest) = (0..self.running.len()).max_by_key(|&i| self.running[i].admitted)
            else {
                return Vec::new();
            };
            let mut l = self.running.remove(newest);
            self.free(&l);
            l.seq = None;
            l.fed = 0;
            if self.running.is_empty() {
                // Alone it still does not fit: the request checks make this unreachable.
                let _ = l.job.events.send(Event::Failed(format!(
                    "the sequence needs more cache pages than the pool of {} holds",
                    self.opts.cache.pages()
                )));
                return Vec::new();
            }
            self.metrics.preemptions.add(1);
            log::info!(
                "preempted a sequence of {} tokens ({} generated): the page pool is full",
                l.tokens.len(),
                l.generated()
            );
            self.waiting.push_front(l);
        }
    }

    fn run_step(&mut self, plan: Vec<Planned>) {
        let inputs: Vec<StepInput> = plan
            .iter()
            .map(|p| {
                let l = &self.running[p.run];
                StepInput {
                    seq: l.seq.expect("running sequences hold a cache row"),
                    tokens: &l.tokens[l.fed..l.fed + p.tokens],
                }
            })
            .collect();
        let prompt_tokens: usize = plan
            .iter()
            .filter(|p| {
                let l = &self.running[p.run];
                l.fed < l.prompt_len
            })
            .map(|p| p.tokens)
            .sum();
        let logits = self
            .model
            .step(&mut self.cache, &inputs, Logits::Last, None);
        drop(inputs);
        let stepped = logits.and_then(|logits| self.sample(&plan, &logits));
        self.metrics.steps.add(1);
        self.metrics.batch_size.observe(plan.len() as f64);
        self.metrics.prompt_tokens.add(prompt_tokens as u64);
        let sampled = match stepped {
            Ok(s) => s,
            Err(e) => {
                log::error!("step failed: {e}");
                let mut gone: Vec<usize> = plan.iter().map(|p| p.run).collect();
                gone.sort_unstable();
                for &i in gone.iter().rev() {
                    let l = self.running.remove(i);
                    let _ = l
                        .job
                        .events
                        .send(Event::Failed(format!("the model failed: {e}")));
                    self.free(&l);
                }
                return;
            }
        };
        let mut done = Vec::new();
        for (p, token) in plan.iter().zip(sampled) {
            let l = &mut self.running[p.run];
            l.fed += p.tokens;
            let Some(token) = token else {
                continue;
            };
            let eos = l.job.stop_at_eos && self.model.config.is_eos(token.id);
            let finish = if eos {
                Some(Finish::Eos)
            } else {
                self.metrics.generated_tokens.add(1);
                l.tokens.push(token.id);
                let sent = l.job.events.send(Event::Token(token)).is_ok();
                if !sent {
                    // The client went away: freed like a cancel.
                    l.job.cancel.store(true, Ordering::Relaxed);
                    None
                } else if l.generated() >= l.job.max_tokens
                    || l.tokens.len() >= self.opts.cache.max_seq_len
                {
                    Some(Finish::Length)
                } else {
                    None
                }
            };
            if let Some(f) = finish {
                let _ = l.job.events.send(Event::Done(f));
                done.push(p.run);
            }
        }
        done.sort_unstable();
        for &i in done.iter().rev() {
            let l = self.running.remove(i);
            self.free(&l);
        }
        // Sequences whose client went away while the step ran go before the next one.
        self.drop_cancelled();
    }

    /// One token per sampled row of `logits` (rows in plan order), `None` for the rows of
    /// prompt chunks that do not reach their sequence's end.
    fn sample(&mut self, plan: &[Planned], logits: &Tensor) -> Result<Vec<Option<Generated>>> {
        let mut out: Vec<Option<Generated>> = vec![None; plan.len()];
        let device = self.model.device();
        let mut start = 0;
        while start < plan.len() && plan[start].samples {
            let key = plan[start].key;
            let end = (start..plan.len())
                .find(|&i| !plan[i].samples || plan[i].key != key)
                .unwrap_or(plan.len());
            let cfg = self.running[plan[start].run].job.sampling;
            let uniforms: Vec<f32> = plan[start..end]
                .iter()
                .map(|p| draw_uniform(&mut self.running[p.run].rng))
                .collect();
            let rows = logits.rows_slice(start as u32, (end - start) as u32)?;
            let top_k = u32::try_from(cfg.top_k).unwrap_or(u32::MAX);
            let got = device.sample(&rows, &uniforms, cfg.temperature, top_k, cfg.top_p)?;
            for (k, (id, logprob, bad)) in got.into_iter().enumerate() {
                let row = start + k;
                if bad > 0 || id < 0 {
                    return Err(Error::Model(format!(
                        "the logits of a sequence hold {bad} NaN or infinite values: nothing to sample"
                    )));
                }
                let want = self.running[plan[row].run].job.top_logprobs;
                let top = if want > 0 {
                    top_logprobs(&device.download(&logits.rows_slice(row as u32, 1)?)?, want)
                } else {
                    Vec::new()
                };
                out[row] = Some(Generated {
                    id: id as u32,
                    logprob,
                    top,
                });
            }
            start = end;
        }
        Ok(out)
    }
}

/// The `n` largest `log_softmax(logits)` entries, largest first (ties to the lower id).
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let lse = crate::model::sampler::log_sum_exp(logits);
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(ids.len());
    let by = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n < ids.len() {
        ids.select_nth_unstable_by(n, by);
        ids.truncate(n);
    }
    ids.sort_by(by);
    ids.into_iter()
        .map(|i| (i, (logits[i as usize] as f64 - lse) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_are_sorted_and_normalised() {
        let got = top_logprobs(&[0.0, 2.0, 1.0, 2.0], 3);
        let ids: Vec<u32> = got.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let total: f64 = [0.0f64, 2.0, 1.0, 2.0].iter().map(|x| x.exp()).sum();
        assert!((got[0].1 as f64 - (2.0 - total.ln())).abs() < 1e-6);
        assert_eq!(top_logprobs(&[1.0, 2.0], 5).len(), 2);
    }

    #[test]
    fn greedy_rows_share_a_key_whatever_their_top_k() {
        let a = SamplerConfig {
            top_k: 5,
            ..Default::default()
        };
        assert_eq!(sample_key(&a), sample_key(&SamplerConfig::default()));
        let b = SamplerConfig {
            temperature: 0.5,
            ..Default::default()
        };
        assert_ne!(sample_key(&b), SampleKey::Greedy);
    }

    #[test]
    fn step_budget_must_cover_the_batch() {
        let o = EngineOptions {
            cache: CacheOptions {
                max_seqs: 8,
                ..Default::default()
            },
            max_step_tokens: 4,
            cuda_graphs: false,
        };
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--max-batch"));
    }
}
