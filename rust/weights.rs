//! The state_dict a block is built from: [`Weights`], which hands each weight out once, by key,
//! checking its shape and that all of them share one dtype and device; and [`WeightKey`], the key
//! a built block names each weight by.

use std::collections::HashMap;
use std::fmt;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::facts::{dense_size, device, device_name, dtype_name};

/// A weight's CompVis state_dict key, `{prefix}.{name}` ("attn1.to_q" and "weight"), formatted
/// only when asked: a block names its weights on every call ([`crate::BasicTransformerBlock::named_weights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightKey<'a> {
    prefix: &'a str,
    name: &'static str,
}

impl<'a> WeightKey<'a> {
    pub fn new(prefix: &'a str, name: &'static str) -> Self {
        WeightKey { prefix, name }
    }
}

impl fmt::Display for WeightKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.prefix, self.name)
    }
}

/// A name → tensor map (a state_dict) from which modules take their weights by key.
///
/// Every take checks the shape; [`Weights::finish`] rejects keys nobody took.
pub struct Weights {
    /// `None`: [`Weights::stand_ins`].
    map: Option<HashMap<String, Tensor>>,
    /// The dtype and device of the first weight taken (its device as `facts::device` codes it,
    /// and as torch names it), which every other weight must share.
    first: Option<(Kind, i64, String)>,
}

impl Weights {
    pub fn new(map: HashMap<String, Tensor>) -> Self {
        Weights { map: Some(map), first: None }
    }

    /// Weights that answer every take with a stand-in of the shape asked for: one zero expanded
    /// to it (no memory). A block built on them knows its keys ([`crate::BlockConfig::weight_keys`]).
    pub fn stand_ins() -> Self {
        Weights { map: None, first: None }
    }

    /// Takes `prefix.name`, checking its shape and that all weights share one dtype and device.
    pub fn take(&mut self, prefix: &str, name: &str, shape: &[i64]) -> Result<Tensor> {
        let key = format!("{prefix}.{name}");
        let t = match &mut self.map {
            Some(map) => map.remove(&key).ok_or_else(|| Error::MissingWeight(key.clone()))?,
            None => Tensor::f_zeros([0i64; 0], (Kind::Float, Device::Cpu))?.f_expand(shape, false)?,
        };
        let got = dense_size(&t).ok_or_else(|| Error::WeightType {
            key: key.clone(),
            got: "a tensor without a dense shape (nested, sparse, ...)".to_string(),
            expected: "dense tensors".to_string(),
        })?;
        if got != shape {
            return Err(Error::WeightShape { key, expected: shape.to_vec(), got });
        }
        let (kind, device) = (t.f_kind()?, device(&t).ok_or_else(|| Error::MissingWeight(key.clone()))?);
        let (first_kind, first_device, first_name) = self.first.get_or_insert_with(|| (kind, device, device_name(&t)));
        if (*first_kind, *first_device) != (kind, device) {
            return Err(Error::WeightType {
                key,
                got: format!("{} on {}", dtype_name(kind), device_name(&t)),
                expected: format!("{} on {first_name}", dtype_name(*first_kind)),
            });
        }
        Ok(t)
    }

    /// Errors on the first key (in sorted order) that no module took.
    pub fn finish(self) -> Result<(Kind, i64, String)> {
        let mut extra: Vec<_> = self.map.into_iter().flat_map(HashMap::into_keys).collect();
        extra.sort();
        if let Some(key) = extra.into_iter().next() {
            return Err(Error::UnexpectedWeight(key));
        }
        match self.first {
            Some((kind, device, name)) if matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double) => {
                Ok((kind, device, name))
            }
            Some((kind, ..)) => {
                Err(Error::config(format!("the weights are {}, not a floating-point dtype", dtype_name(kind))))
            }
            None => Err(Error::config("the block has no weights".to_string())),
        }
    }
}
