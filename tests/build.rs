//! Compiles the fake CUDA driver (`fake-cuda/fake_cuda.rs`) into `$OUT_DIR/fake-cuda/libcuda.so`
//! for the host-path check (`src/bin/host_path.rs`), which loads it in place of the real driver.
//! The file alone, by the same rustc, no dependencies: a second crate of the workspace would put a
//! `libcuda.so` into `target/`, where a program might load it by mistake.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "fake-cuda/fake_cuda.rs";
    println!("cargo::rerun-if-changed={source}");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("fake-cuda");
    std::fs::create_dir_all(&out).expect("creating OUT_DIR/fake-cuda");
    // Only Linux loads a `libcuda.so`; elsewhere the check says it cannot run.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        let status = Command::new(rustc)
            .args([
                "--edition",
                "2024",
                "--crate-type",
                "cdylib",
                "--crate-name",
                "cuda",
            ])
            .args(["-C", "opt-level=2", "-D", "warnings", "-o"])
            .arg(out.join("libcuda.so"))
            .arg(source)
            .status()
            .expect("running rustc on the fake CUDA driver");
        assert!(status.success(), "the fake CUDA driver did not compile");
    }
    println!("cargo::rustc-env=NORMKERN_FAKE_CUDA_DIR={}", out.display());
}
