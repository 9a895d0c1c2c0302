//! With the `cuda` feature, compiles our own CUDA kernels (`kernels/*.cu`) to PTX with nvcc (the
//! same toolchain candle's kernels need; `NVCC`, `CUDA_COMPUTE_CAP` as for them).
fn main() {
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels();
    }
}

fn cuda_kernels() {
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=kernels/common.cuh");
    for name in ["batch_decode", "dit", "fused", "sample"] {
        let src = format!("kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{name}.ptx"));
        let status = std::process::Command::new(&nvcc)
            .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("running {nvcc} for {src}: {e}"));
        assert!(status.success(), "{nvcc} failed on {src}");
    }
}
