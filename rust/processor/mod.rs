//! Attention processors: diffusers' replacements for an attention's computation that carry layers
//! of their own (Custom Diffusion), chosen by name in the configuration ([`ProcessorSpec`]).
//!
//! A processor is one file of this folder: its layers loaded by key, its forward op for op as
//! diffusers computes it, and its weights by key ([`AttnProcessor`]); plus its line in [`KINDS`].
//! Python's reading of diffusers' processor is the twin module of the same name
//! (`python/plusequals/twin/`), which writes the [`ProcessorSpec`].

pub mod custom_diffusion;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::weights::{WeightKey, Weights};

/// The processors this crate computes, by [`ProcessorKind::kind`].
pub const KINDS: &[ProcessorKind] = &[custom_diffusion::KIND];

/// The attentions a processor may sit on.
pub const ATTENTIONS: [&str; 2] = ["attn1", "attn2"];

/// Which processor an attention carries, and its options that are on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessorSpec {
    /// The processor: one of [`KINDS`] (`"custom_diffusion"`).
    pub kind: String,
    /// The attention that carries it: `attn1` or `attn2`.
    pub attn: String,
    /// Its options that are on, by name ([`ProcessorKind::flags`] lists those it has).
    pub flags: Vec<String>,
}

impl ProcessorSpec {
    /// Whether the option `flag` is on.
    pub fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// The widths of an attention's layers: (query, context, inner = heads * d_head).
pub type Widths = (i64, i64, i64);

/// A processor's layers, loaded: what the attention computes instead of its own forward.
pub trait AttnProcessor: Send {
    /// Its weights by key, in a fixed order (the custom ops' order).
    fn named(&self) -> Vec<(WeightKey<'_>, &Tensor)>;

    /// diffusers' processor `__call__`: `x` the hidden states, `context` the encoder hidden
    /// states (`None`: self-attention), `mask` the attention mask, viewed per head or not as
    /// diffusers does (or refused, naming it); `base` the attention's own layers.
    fn forward(&self, base: &Base<'_>, x: &Tensor, context: Option<&Tensor>, mask: Option<&Tensor>) -> Result<Tensor>;
}

/// The attention's own layers and head count, which a processor falls back on.
pub struct Base<'a> {
    pub q: &'a Linear,
    pub k: &'a Linear,
    pub v: &'a Linear,
    pub out: &'a Linear,
    pub heads: i64,
}

/// A processor this crate computes: its name in the configuration and in messages, its options,
/// and how its layers load (from `w`, under the attention's prefix `spec.attn`).
pub struct ProcessorKind {
    pub kind: &'static str,
    pub name: &'static str,
    pub flags: &'static [&'static str],
    pub load: fn(w: &mut Weights, spec: &ProcessorSpec, widths: Widths) -> Result<Box<dyn AttnProcessor>>,
}

impl ProcessorKind {
    /// The kind named `kind`, or an error naming those there are.
    pub fn find(kind: &str) -> Result<&'static ProcessorKind> {
        KINDS.iter().find(|k| k.kind == kind).ok_or_else(|| {
            let known: Vec<&str> = KINDS.iter().map(|k| k.kind).collect();
            Error::config(format!("no attention processor {kind:?}: this crate computes {known:?}"))
        })
    }
}

/// The processor of the attention `attn` in `specs`, loaded, if it carries one; an error for an
/// unknown kind or option, or for two processors on one attention.
pub(crate) fn load(
    w: &mut Weights,
    attn: &str,
    widths: Widths,
    specs: &[ProcessorSpec],
) -> Result<Option<Box<dyn AttnProcessor>>> {
    if let Some(spec) = specs.iter().find(|s| !ATTENTIONS.contains(&s.attn.as_str())) {
        return Err(Error::config(format!(
            "{} on {:?}: a block's attentions are {ATTENTIONS:?}",
            spec.kind, spec.attn
        )));
    }
    let mut on_attn = specs.iter().filter(|s| s.attn == attn);
    let Some(spec) = on_attn.next() else {
        return Ok(None);
    };
    if let Some(other) = on_attn.next() {
        return Err(Error::config(format!("{attn} carries two processors: {:?} and {:?}", spec.kind, other.kind)));
    }
    let kind = ProcessorKind::find(&spec.kind)?;
    if let Some(flag) = spec.flags.iter().find(|f| !kind.flags.contains(&f.as_str())) {
        return Err(Error::config(format!("{} has no option {flag:?}: its options are {:?}", kind.name, kind.flags)));
    }
    (kind.load)(w, spec, widths).map(Some)
}
