//! One error type for the library: every variant carries a message a user can act on.

/// Errors returned by the library. Messages name the argument or resource at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller passed a shape, size or value that the operation cannot take.
    #[error("invalid argument `{arg}`: expected {expected}, got {actual}")]
    InvalidArgument {
        arg: String,
        expected: String,
        actual: String,
    },
    /// A backend (GPU, driver, compiler) is not present on this machine.
    #[error("{backend} backend unavailable: {reason}")]
    Unavailable { backend: String, reason: String },
    /// A kernel failed to compile or validate; `log` is the compiler's own output.
    #[error("kernel `{kernel}` failed to compile for {target}:\n{log}")]
    Compile {
        kernel: String,
        target: String,
        log: String,
    },
    /// A kernel description is inconsistent (a bug in a description, caught before emitting).
    #[error("kernel description `{kernel}`: {message}")]
    Kir { kernel: String, message: String },
    /// A kernel needs more of a device resource than the device (or the portable limit) allows.
    #[error("kernel `{kernel}` needs {needed} of {resource}, but the limit is {limit}")]
    ResourceLimit {
        kernel: String,
        resource: String,
        needed: u64,
        limit: u64,
    },
    /// A runtime call (launch, copy, synchronise) failed on the device.
    #[error("{backend} runtime error: {message}")]
    Runtime { backend: String, message: String },
    /// Model files, configs and weights.
    #[error("{0}")]
    Model(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(arg: impl Into<String>, expected: impl ToString, actual: impl ToString) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        }
    }

    pub fn runtime(backend: impl Into<String>, message: impl ToString) -> Self {
        Error::Runtime {
            backend: backend.into(),
            message: message.to_string(),
        }
    }

    pub fn unavailable(backend: impl Into<String>, reason: impl ToString) -> Self {
        Error::Unavailable {
            backend: backend.into(),
            reason: reason.to_string(),
        }
    }
}
