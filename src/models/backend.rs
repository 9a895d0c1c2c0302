//! `VarBuilder` backends: one that checks names and shapes and says what was expected, and one
//! shared through an `Arc` so its owner can inspect it after loading.

use std::collections::HashSet;
use std::sync::Mutex;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

/// A backend that checks names and shapes with messages that say what was expected, and can
/// record which tensors were read.
pub struct Checked {
    pub inner: Box<dyn SimpleBackend>,
    pub origin: String,
    pub seen: Option<Mutex<HashSet<String>>>,
}

impl Checked {
    pub fn recording(inner: Box<dyn SimpleBackend>, origin: impl Into<String>) -> Self {
        Self { inner, origin: origin.into(), seen: Some(Mutex::new(HashSet::new())) }
    }

    /// Names read so far (when recording).
    pub fn seen(&self) -> HashSet<String> {
        self.seen.as_ref().map(|m| m.lock().expect("not poisoned").clone()).unwrap_or_default()
    }

    fn note(&self, name: &str) {
        if let Some(m) = &self.seen {
            m.lock().expect("not poisoned").insert(name.to_string());
        }
    }
}

impl SimpleBackend for Checked {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if !self.inner.contains_tensor(name) {
            candle_core::bail!(
                "{}: missing tensor {name} (expected shape {:?})",
                self.origin,
                s.dims()
            );
        }
        let t = self.inner.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "{}: tensor {name} has shape {:?}, expected {:?}",
                self.origin,
                t.shape().dims(),
                s.dims()
            );
        }
        let _ = h;
        self.note(name);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if !self.inner.contains_tensor(name) {
            candle_core::bail!("{}: missing tensor {name}", self.origin);
        }
        self.note(name);
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// A backend shared through an `Arc`, so its owner can inspect it (e.g. what was read) after a
/// `VarBuilder` has been handed to a loader.
pub struct SharedBackend<T: SimpleBackend>(pub std::sync::Arc<T>);

impl<T: SimpleBackend> SimpleBackend for SharedBackend<T> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}
