//! Records the git revision for /api/build_info (when built from a checkout), and with the `cuda`
//! feature compiles our own CUDA kernels (`src/models/kernels/*.cu`) to PTX with nvcc (the same
//! toolchain candle's kernels need; `NVCC`, `CUDA_COMPUTE_CAP` as for them).
fn main() {
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ANTIPHON_GIT={rev}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
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
    println!("cargo:rerun-if-changed=src/models/kernels/common.cuh");
    for name in ["decode_attention", "fused"] {
        let src = format!("src/models/kernels/{name}.cu");
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
