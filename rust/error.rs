//! One error type for the block; `python.rs` maps each variant to a Python exception.

use std::fmt;

use tch::{TchError, Tensor};

use crate::ownership::Alias;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A key the block needs is not in the state_dict.
    #[error("missing weight {0:?}")]
    MissingWeight(String),
    /// A key in the state_dict that no module takes.
    #[error("unexpected weight {0:?}")]
    UnexpectedWeight(String),
    #[error("weight {key:?} has shape {got:?}, expected {expected:?}")]
    WeightShape { key: String, expected: Vec<i64>, got: Vec<i64> },
    #[error("weight {key:?} is {got}, but the other weights are {expected}")]
    WeightType { key: String, got: String, expected: String },
    /// Constructor arguments that cannot describe a block.
    #[error("{0}")]
    Config(String),
    /// An argument of `forward`/`forward_owned` the block cannot take; `arg` names it.
    #[error("{arg} {msg}")]
    Input { arg: &'static str, msg: String },
    /// A tensor the in-place forward would write into, or read while writing, is not the
    /// caller's alone to give (see `ownership::check_owned`); nothing was written.
    #[error("{arg} refused for an in-place write: it {why}")]
    NotOwned { arg: &'static str, why: Alias },
    /// An in-place write to a weight (its version counter moved) happened while a forward read
    /// the weights: the weights are shared with Python, and another thread wrote them.
    #[error(
        "the block's weights were written in place while this forward read them (an optimizer step or \
         p.add_() in another thread?): the result is discarded; do not write the weights during a forward"
    )]
    WeightsChanged,
    /// A weight's shape, dtype or device is no longer what the block was built on (an in-place
    /// metadata change on a shared weight: `w.t_()`, `w.resize_()`, `p.data = other`).
    #[error(
        "weight {key:?} changed since the block was built: it was {was}, it is {now}; build the block again \
         (RustBlock, following its module, does so itself)"
    )]
    WeightChanged { key: String, was: String, now: String },
    /// A refused donation: nothing moved, and `x` is as it was.
    #[error("{0}; nothing was donated: x is unchanged and usable (donate=False works on a copy)")]
    Donation(Box<Error>),
    /// A failure injected by a test (`failpoint`), at the step it names.
    #[error("a failure injected at {0:?} (plusequals failpoint, for the tests)")]
    Injected(crate::failpoint::Step),
    /// An exception the C++ twin caught (`cpp/capi.cpp`), with its message.
    #[error("{0}")]
    Cpp(String),
    /// An error raised inside libtorch.
    #[error(transparent)]
    Torch(#[from] TchError),
}

impl Error {
    /// The error itself, under the context a refused donation adds.
    pub fn root(&self) -> &Error {
        match self {
            Error::Donation(inner) => inner.root(),
            other => other,
        }
    }

    pub fn input(arg: &'static str, msg: String) -> Self {
        Error::Input { arg, msg }
    }

    pub fn config(msg: String) -> Self {
        Error::Config(msg)
    }
}

/// How an in-place call that took `x` by value failed, and what became of `x`.
pub enum Failure {
    /// Refused, or failed before the first write: `x` comes back, untouched, with the error.
    Unwritten(Error, Tensor),
    /// Failed after the first write: `x`'s buffer was partly overwritten, and is dropped.
    Consumed(Error),
}

impl Failure {
    pub fn error(&self) -> &Error {
        match self {
            Failure::Unwritten(e, _) | Failure::Consumed(e) => e,
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Unwritten(e, _) | Failure::Consumed(e) => e,
        }
    }
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Unwritten(e, _) => write!(f, "Unwritten({e:?}, x)"),
            Failure::Consumed(e) => write!(f, "Consumed({e:?})"),
        }
    }
}
