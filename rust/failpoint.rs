//! Fault injection for the tests of a transaction: the next in-place forward on this thread
//! fails at a chosen step, so that the tests can show what each failure leaves (`x` handed back
//! untouched before the first write; consumed after it). Thread-local: a test arms only its own
//! thread, and an armed point fires once.

use std::cell::Cell;

use crate::error::{Error, Result};

/// Where an in-place forward can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// After every check and after `x` was taken, before anything is written into it.
    BeforeFirstWrite,
    /// After the first residual was added into `x`.
    AfterFirstWrite,
}

thread_local! {
    static ARMED: Cell<Option<Step>> = const { Cell::new(None) };
}

/// Makes the next in-place forward on this thread fail at `step` (`None` disarms).
pub fn fail_next_at(step: Option<Step>) {
    ARMED.with(|armed| armed.set(step));
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::BeforeFirstWrite => "BeforeFirstWrite",
            Step::AfterFirstWrite => "AfterFirstWrite",
        }
    }
}

/// `Err` once, if this thread armed `step`.
pub(crate) fn check(step: Step) -> Result<()> {
    ARMED.with(|armed| {
        if armed.get() == Some(step) {
            armed.set(None);
            return Err(Error::Injected(step.name()));
        }
        Ok(())
    })
}
