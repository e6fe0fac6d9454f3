//! Model operations as one generic door into every backend.
//!
//! Each model kernel (GEMM, norms, RoPE, top-k, routing, sampling, ...) is described once in
//! `src/kernels/` and implements [`Op`]: the buffers it binds (by name, with the bytes each
//! needs), the kernel launches a GPU backend runs, and the reference the CPU backend runs on
//! the same bytes. [`super::Backend::run_op`] checks the bindings and then does one or the
//! other, so the model, `mla-check` and the tests reach a kernel through the same call.
//!
//! Rules every op keeps:
//! - buffers are bound by name; one buffer is bound at most once per op (wgpu refuses a
//!   buffer that is both read and written in one dispatch, and it keeps the CPU path simple);
//! - a binding states the bytes it needs (`min_bytes`) — checked before any launch — and
//!   whether the op writes it;
//! - the launch of a written buffer never touches bytes outside the op's declared outputs.

use crate::kernels::Launch;
use crate::{Error, Result};

/// One buffer an op binds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The kernel's buffer name.
    pub name: &'static str,
    /// The buffer must hold at least this many bytes.
    pub min_bytes: u64,
    /// The op writes (some of) the buffer.
    pub written: bool,
    /// What the buffer holds, for messages: `[rows, cols] bf16`.
    pub what: String,
}

impl Binding {
    pub fn read(name: &'static str, min_bytes: u64, what: impl Into<String>) -> Self {
        Binding {
            name,
            min_bytes,
            written: false,
            what: what.into(),
        }
    }

    pub fn write(name: &'static str, min_bytes: u64, what: impl Into<String>) -> Self {
        Binding {
            name,
            min_bytes,
            written: true,
            what: what.into(),
        }
    }
}

/// A model operation: a kernel (or a few) on GPU backends, a reference on the CPU.
pub trait Op: Send + Sync {
    /// For messages and traces.
    fn name(&self) -> String;
    /// Every buffer the op binds. Checked against the buffers given before anything runs.
    fn bindings(&self) -> Vec<Binding>;
    /// The launches, in order; buffers are bound by name.
    fn launches(&self) -> Result<Vec<Launch>>;
    /// The CPU reference, on the bound buffers' bytes.
    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()>;
}

/// The bytes of an op's buffers on the host (the CPU backend), by binding name.
pub struct HostBuffers<'a> {
    read: Vec<(&'static str, &'a [u8])>,
    write: Vec<(&'static str, &'a mut [u8])>,
}

impl<'a> HostBuffers<'a> {
    pub fn new() -> Self {
        HostBuffers {
            read: Vec::new(),
            write: Vec::new(),
        }
    }

    pub fn add_read(&mut self, name: &'static str, bytes: &'a [u8]) {
        self.read.push((name, bytes));
    }

    pub fn add_write(&mut self, name: &'static str, bytes: &'a mut [u8]) {
        self.write.push((name, bytes));
    }

    /// A bound buffer's bytes (read-only and written buffers alike).
    pub fn get(&self, name: &str) -> Result<&[u8]> {
        if let Some((_, b)) = self.read.iter().find(|(n, _)| *n == name) {
            return Ok(b);
        }
        if let Some((_, b)) = self.write.iter().find(|(n, _)| *n == name) {
            return Ok(b);
        }
        Err(Error::arg(name, "a bound buffer", "none"))
    }

    /// A written buffer's bytes.
    pub fn get_mut(&mut self, name: &str) -> Result<&mut [u8]> {
        self.write
            .iter_mut()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| &mut **b)
            .ok_or_else(|| Error::arg(name, "a buffer the op writes", "not bound for writing"))
    }

    /// Two buffers at once: `src` to read, `dst` to write (they are distinct bindings).
    pub fn read_write(&mut self, src: &str, dst: &str) -> Result<(&[u8], &mut [u8])> {
        let r = match self.read.iter().find(|(n, _)| *n == src) {
            Some((_, b)) => *b,
            None => return Err(Error::arg(src, "a buffer bound for reading", "none")),
        };
        let w = self.get_mut(dst)?;
        Ok((r, w))
    }
}

impl Default for HostBuffers<'_> {
    fn default() -> Self {
        Self::new()
    }
}

/// Checks the buffers given to an op against its bindings: every binding is given, large
/// enough, and no buffer is given twice. `given` pairs names with (buffer identity, length).
pub fn check_bindings(op: &dyn Op, given: &[(&str, (usize, u64))]) -> Result<()> {
    let bindings = op.bindings();
    for b in &bindings {
        let (_, len) = given
            .iter()
            .find(|(n, _)| *n == b.name)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                Error::arg(
                    b.name,
                    format!("a buffer for {} ({})", b.what, op.name()),
                    "none",
                )
            })?;
        if len < b.min_bytes {
            return Err(Error::arg(
                b.name,
                format!("at least {} bytes ({}, {})", b.min_bytes, b.what, op.name()),
                format!("{len} bytes"),
            ));
        }
    }
    for (i, (n, (id, _))) in given.iter().enumerate() {
        if !bindings.iter().any(|b| b.name == *n) {
            return Err(Error::arg(
                *n,
                format!("one of the buffers of {}", op.name()),
                "an unknown binding",
            ));
        }
        if let Some((m, _)) = given[..i].iter().find(|(_, (j, _))| j == id) {
            return Err(Error::arg(
                *n,
                format!(
                    "a buffer of its own (it is also bound as `{m}` in {})",
                    op.name()
                ),
                "the same buffer twice",
            ));
        }
    }
    Ok(())
}
