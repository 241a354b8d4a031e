//! Fault injection for the tests of a transaction: the next in-place forward on this thread
//! fails at a chosen step, so that the tests can show what each failure leaves (`x` handed back
//! untouched before the first write; consumed after it). Thread-local: a test arms only its own
//! thread, and an armed point fires once.
//!
//! Only with the cargo feature `failpoints` (cargo test, `make build-dev`); without it (the
//! wheel, `make wheel`) `check` is `Ok(())` and nothing can arm it.

#[cfg(feature = "failpoints")]
use std::cell::Cell;

#[cfg(feature = "failpoints")]
use crate::error::Error;
use crate::error::Result;

/// Where an in-place forward can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// After every check and after `x` was taken, before anything is written into it.
    BeforeFirstWrite,
    /// After the first residual was added into `x`.
    AfterFirstWrite,
}

#[cfg(feature = "failpoints")]
thread_local! {
    static ARMED: Cell<Option<Step>> = const { Cell::new(None) };
}

/// Makes the next in-place forward on this thread fail at `step` (`None` disarms).
#[cfg(feature = "failpoints")]
pub fn fail_next_at(step: Option<Step>) {
    ARMED.with(|armed| armed.set(step));
}

#[cfg(feature = "failpoints")]
impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::BeforeFirstWrite => "BeforeFirstWrite",
            Step::AfterFirstWrite => "AfterFirstWrite",
        }
    }
}

/// `Err` once, if this thread armed `step`.
#[cfg(feature = "failpoints")]
pub(crate) fn check(step: Step) -> Result<()> {
    ARMED.with(|armed| {
        if armed.get() == Some(step) {
            armed.set(None);
            return Err(Error::Injected(step.name()));
        }
        Ok(())
    })
}

/// Without the feature no fail point is armed: always `Ok(())`.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn check(_step: Step) -> Result<()> {
    Ok(())
}
