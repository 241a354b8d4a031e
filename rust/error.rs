//! One error type for the block; `lib.rs` maps each variant to a Python exception.

use tch::TchError;

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
    /// An exception the C++ twin caught (`cpp/capi.cpp`), with its message.
    #[error("{0}")]
    Cpp(String),
    /// An error raised inside libtorch.
    #[error(transparent)]
    Torch(#[from] TchError),
}

impl Error {
    pub fn input(arg: &'static str, msg: String) -> Self {
        Error::Input { arg, msg }
    }

    pub fn config(msg: String) -> Self {
        Error::Config(msg)
    }
}
