//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub mod engine;
pub mod streams;

/// The repository (`ANTIPHON_REPO` when the test binary runs elsewhere, as on the GPU machine).
pub fn repo() -> PathBuf {
    std::env::var("ANTIPHON_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

pub fn fixture_dir(name: &str) -> PathBuf {
    repo().join("tests").join("fixtures").join(name)
}

/// The device the parity tests run on: `ANTIPHON_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`), default
/// CPU.
pub fn device() -> Device {
    match std::env::var("ANTIPHON_TEST_DEVICE").as_deref() {
        Err(_) | Ok("cpu") | Ok("") => Device::Cpu,
        // as the server opens it (event tracking off, so decode steps can be captured as graphs)
        Ok(d) => antiphon_models::gpu::open(
            d.parse().expect("ANTIPHON_TEST_DEVICE: cpu, cuda or cuda:N"),
        )
        .expect("ANTIPHON_TEST_DEVICE names a CUDA device this build cannot open"),
    }
}

/// Float arrays of a fixture's `io.safetensors`, on the test device.
pub fn load_io(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir(name).join("io.safetensors"), &device())
        .expect("io.safetensors")
}

/// Integer data of a fixture's `io.json`.
pub fn load_meta(name: &str) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixture_dir(name).join("io.json")).expect("io.json"),
    )
    .expect("json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("int") as u32).collect()
}

/// The largest of `v`, or +inf when any is a NaN or an infinity: no bound passes a non-finite
/// value (`f32::max` alone would drop a NaN).
pub fn finite_max(v: impl IntoIterator<Item = f32>) -> f32 {
    v.into_iter()
        .fold(0f32, |m, x| if x.is_finite() && m.is_finite() { m.max(x) } else { f32::INFINITY })
}

/// max |a - b| over two equally long slices; +inf when either holds a NaN or an infinity.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    finite_max(a.iter().zip(b).map(|(x, y)| {
        if x.is_finite() && y.is_finite() {
            (x - y).abs()
        } else {
            f32::INFINITY
        }
    }))
}

/// max |a - b| / max |b|: the error relative to the reference's magnitude; +inf when either side
/// holds a NaN or an infinity.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let diff = max_abs_diff(&a, &b);
    let scale = finite_max(b.iter().map(|y| y.abs())).max(1e-12);
    if diff.is_finite() && scale.is_finite() {
        diff / scale
    } else {
        f32::INFINITY
    }
}

#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    // on a GPU, f32 kernels sum in other orders: the bound for f32 there is 1e-3
    let tol = if got.device().is_cpu() { tol } else { tol.max(1e-3) };
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    eprintln!("{what}: relative error {e:.2e}");
}
