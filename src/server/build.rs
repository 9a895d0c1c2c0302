//! Records the git revision for /api/build_info (when built from a checkout). `ANTIPHON_GIT`, when
//! set, is taken as it is: scripts/build-cuda.sh sets it to `git describe --dirty`, so a binary
//! built from a tree with uncommitted changes says so.
fn main() {
    println!("cargo:rerun-if-env-changed=ANTIPHON_GIT");
    let given = std::env::var("ANTIPHON_GIT").ok().filter(|s| !s.trim().is_empty());
    let rev = given.unwrap_or_else(|| {
        std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    });
    println!("cargo:rustc-env=ANTIPHON_GIT={rev}");
    println!("cargo:rerun-if-changed=../../.git/HEAD");
    println!("cargo:rerun-if-changed=../../.git/refs/heads");
}
