//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join(name)
}

/// Float arrays of a fixture's `io.safetensors`.
pub fn load_io(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir(name).join("io.safetensors"), &Device::Cpu).expect("io.safetensors")
}

/// Integer data of a fixture's `io.json`.
pub fn load_meta(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("io.json")).expect("io.json")).expect("json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("int") as u32).collect()
}

/// max |a - b| / max |b|: the error relative to the reference's magnitude.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max).max(1e-12);
    diff / scale
}

#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    eprintln!("{what}: relative error {e:.2e}");
}
