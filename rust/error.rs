//! What can go wrong, as types: [`Error`] (one error type for the crate; `python/errors.rs` maps each
//! variant to a Python exception class), [`Alias`] (why a tensor cannot be written in place) and
//! [`Failure`] (what became of a tensor an in-place call took). A leaf: it uses no other module
//! of the crate.

use std::fmt;

use tch::{TchError, Tensor};

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
    /// A failure injected by a test (`failpoint.rs`, feature `failpoints`), at the step it names.
    #[cfg(feature = "failpoints")]
    #[error("a failure injected at {0} (plusequals failpoint, for the tests)")]
    Injected(&'static str),
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

/// Why a tensor cannot be written in place: someone else can read its memory, or the write
/// would corrupt a gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alias {
    /// `n` handles on the tensor besides the ones the caller gave up, and who holds them as far
    /// as libtorch's counts tell ([`Holders`]).
    OtherHandles(i64, Holders),
    /// `n` weak references to the tensor, its storage, or its storage's Python object
    /// (torch.multiprocessing's `StorageWeakRef`, `weakref.ref(x.untyped_storage())`). No use
    /// count shows them, and each can be upgraded to a second name at any moment, from any thread.
    WeakRefs(i64),
    /// A view of another tensor, which it keeps alive (Python can reach it as `x._base`).
    View,
    /// `n` other tensors (or Python storages) on the same memory: views, `detach`, slices.
    SharedStorage(i64),
    /// The bytes belong to someone libtorch does not track (numpy, dlpack, `frombuffer`,
    /// `from_blob`, shared memory), who may still read them.
    ForeignMemory,
    /// libtorch's own memory, marked non-resizable: `x.numpy()` does that, so that the numpy
    /// array, which may still read it, never sees it freed (the mark stays after the array is
    /// gone, so this refusal can be stricter than needed).
    NotResizable,
    /// Elements share bytes (a stride-0 or overlapping layout), or the layout has gaps.
    NotDense,
    /// The tensor covers only part of its storage; the rest may be someone else's.
    PartOfStorage { offset: i64, nbytes: i64, storage_nbytes: i64 },
    /// A nested, sparse or other tensor without one dense storage of its own.
    NoStorage,
    /// A functorch wrapper (inside `torch.func.vmap`, `grad` or `jvp`): no storage of its own.
    Functorch,
    /// A dual tensor of forward-mode AD (`torch.autograd.forward_ad.make_dual`): its tangent sits
    /// on the handle a donation gives up, and would be dropped.
    Tangent,
    /// A tensor subclass with `__torch_dispatch__`: its data and every op on it belong to its
    /// Python code, which could keep `x` when an in-place op passes it there.
    PythonSubclass,
    /// TorchDispatchModes are active on this thread (named when the caller knows them): a mode
    /// sees every op's tensors, `x` included, and may keep them.
    DispatchModes(Vec<String>),
    /// Grad mode is on: autograd may record the in-place writes, or have saved what they
    /// overwrite.
    GradMode,
    /// `context` shares memory with `x`, which the forward overwrites before it reads `context`.
    OverlapsX,
}

/// Who holds a tensor's other handles ([`Alias::OtherHandles`]), told apart by libtorch's counts:
/// whether other tensors share its storage, and whether the caller is Python.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holders {
    /// Other tensors share its storage: a view of it (`view`, `reshape`, a slice, `transpose`,
    /// `expand`), which holds its base.
    Views,
    /// No other tensor shares its storage, and the caller is Rust: a handle on the tensor itself
    /// (`shallow_clone`, the handle an in-place op returned, a tensor autograd saved for backward).
    Rust,
    /// No other tensor shares its storage, and the caller is Python, whose names share one
    /// handle: C++ holds the tensor itself (autograd saved it for a backward that has not run, a
    /// DLPack export such as JAX's, a C++ extension).
    Cpp,
}

impl Holders {
    /// What [`Alias::OtherHandles`]' message says of them, after "has n other handle(s)".
    fn said(self) -> &'static str {
        match self {
            Holders::Views => {
                "on it, and other tensors share its storage: a view of it is alive (a view, reshape, slice, \
                 transpose or expand of x holds its base), which would read the in-place writes; drop the view \
                 first, or pass x.clone()"
            }
            Holders::Rust => {
                "on the tensor itself, and no view of it: a shallow_clone, the handle an in-place op returned, or \
                 a tensor autograd saved for backward, which would read the in-place writes"
            }
            Holders::Cpp => {
                "held by C++, not by a Python name (Python's names share one handle) and not by a view: autograd \
                 saved x for a backward that has not run (an op recorded with grad on, such as y = x * w), or a \
                 DLPack export (JAX) or a C++ extension keeps it; run or drop that graph first, or pass x.clone()"
            }
        }
    }
}

impl Alias {
    /// The kind, as Python's `OwnershipError.why` spells it.
    pub fn kind(&self) -> &'static str {
        match self {
            Alias::OtherHandles(..) => "other_handles",
            Alias::WeakRefs(_) => "weak_refs",
            Alias::View => "view",
            Alias::SharedStorage(_) => "shared_storage",
            Alias::ForeignMemory => "foreign_memory",
            Alias::NotResizable => "not_resizable",
            Alias::NotDense => "not_dense",
            Alias::PartOfStorage { .. } => "part_of_storage",
            Alias::NoStorage => "no_storage",
            Alias::Functorch => "functorch",
            Alias::Tangent => "tangent",
            Alias::PythonSubclass => "python_subclass",
            Alias::DispatchModes(_) => "dispatch_modes",
            Alias::GradMode => "grad_mode",
            Alias::OverlapsX => "overlaps_x",
        }
    }

    /// How many other handles, weak references or tensors on the storage, for the kinds that count.
    pub fn count(&self) -> Option<i64> {
        match self {
            Alias::OtherHandles(n, _) | Alias::WeakRefs(n) | Alias::SharedStorage(n) => Some(*n),
            _ => None,
        }
    }

    /// A few words for tables (the demo's run-time column).
    pub fn label(&self) -> String {
        match self {
            Alias::OtherHandles(n, _) => format!("{n} other handle(s)"),
            Alias::WeakRefs(n) => format!("{n} weak reference(s)"),
            Alias::View => "a view".into(),
            Alias::SharedStorage(n) => format!("storage shared with {n}"),
            Alias::ForeignMemory => "foreign memory".into(),
            Alias::NotResizable => "non-resizable (numpy view?)".into(),
            Alias::NotDense => "not dense".into(),
            Alias::PartOfStorage { .. } => "part of a storage".into(),
            Alias::NoStorage => "no storage".into(),
            Alias::Functorch => "functorch wrapper".into(),
            Alias::Tangent => "forward-mode AD tangent".into(),
            Alias::PythonSubclass => "__torch_dispatch__ subclass".into(),
            Alias::DispatchModes(_) => "dispatch mode active".into(),
            Alias::GradMode => "grad mode on".into(),
            Alias::OverlapsX => "overlaps x".into(),
        }
    }
}

impl fmt::Display for Alias {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Alias::OtherHandles(n, holders) => write!(f, "has {n} other handle(s) {}", holders.said()),
            Alias::WeakRefs(n) => write!(
                f,
                "has {n} weak reference(s) on it or its storage (torch.multiprocessing's StorageWeakRef, a Python \
                 weakref to its storage object): no use count shows them, and any of them can become a second \
                 name at any moment, from any thread"
            ),
            Alias::View => write!(
                f,
                "is a view of another tensor, which the view keeps alive and which would read the in-place writes"
            ),
            Alias::SharedStorage(n) => write!(
                f,
                "shares its storage with {n} other tensor(s) or storage object(s) (views, detach(), slices), \
                 which would read the in-place writes"
            ),
            Alias::ForeignMemory => write!(
                f,
                "is memory libtorch did not allocate (numpy, dlpack, frombuffer, from_blob or shared memory): \
                 its owner may still read it"
            ),
            Alias::NotResizable => {
                write!(f, "has a storage marked non-resizable, as x.numpy() leaves it: a numpy array may still read it")
            }
            Alias::NotDense => write!(f, "has overlapping or non-dense memory (a stride-0 dimension or gaps)"),
            Alias::PartOfStorage { offset, nbytes, storage_nbytes } => write!(
                f,
                "covers {nbytes} of its storage's {storage_nbytes} bytes from byte offset {offset}: \
                 the rest of the storage may be another tensor's"
            ),
            Alias::NoStorage => write!(f, "has no dense storage of its own (nested, sparse, ...)"),
            Alias::Functorch => write!(
                f,
                "is a functorch-wrapped tensor (inside torch.func.vmap, grad or jvp), which has no storage of its \
                 own to write into: call forward() inside the transform, or forward_owned outside it"
            ),
            Alias::Tangent => write!(
                f,
                "is a dual tensor (forward-mode AD, torch.autograd.forward_ad): a donation moves its buffer to a new \
                 handle, which would drop its tangent; pass donate=False, which keeps it"
            ),
            Alias::PythonSubclass => write!(
                f,
                "is a tensor subclass with __torch_dispatch__: its data and every op on it belong to its Python \
                 code, which an in-place op would hand x to, and which may keep it"
            ),
            Alias::DispatchModes(names) if names.is_empty() => write!(
                f,
                "is written while a TorchDispatchMode is active: the mode sees every op's tensors, x included, \
                 and may keep them"
            ),
            Alias::DispatchModes(names) => write!(
                f,
                "is written while a TorchDispatchMode is active ({}): the mode sees every op's tensors, x \
                 included, and may keep them",
                names.join(", ")
            ),
            Alias::GradMode => write!(
                f,
                "is written in place while grad mode is on (tch::with_grad inside the no-grad scope?): autograd \
                 may have saved what the writes overwrite"
            ),
            Alias::OverlapsX => write!(f, "overlaps x, which the in-place forward overwrites before reading it"),
        }
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
