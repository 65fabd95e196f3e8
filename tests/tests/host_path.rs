//! The README's promises about a call's host side, checked without a GPU: once a shape has been
//! seen, a call makes no driver query, device allocation or synchronization and no heap
//! allocation, the same driver calls every time, and with cudarc's event tracking off no event
//! traffic. The `host_path` binary runs every op at shapes that reach each launch plan against a
//! fake CUDA driver that counts calls (`tests/fake-cuda/fake_cuda.rs`) and fails on a broken one.

use std::process::Command;

#[test]
fn calls_make_no_driver_query_allocation_or_synchronization_once_their_shape_was_seen() {
    if !cfg!(target_os = "linux") {
        println!("skipped: the fake CUDA driver is a Linux libcuda.so");
        return;
    }
    let exe = env!("CARGO_BIN_EXE_host_path");
    if !std::path::Path::new(exe).exists() {
        // Test binaries carried to another machine (the GPU host) without the workspace.
        println!("skipped: {exe} is not here");
        return;
    }
    let out = Command::new(exe)
        .args(["--check", "--calls", "200"])
        .output()
        .expect("running host_path");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "host_path --check failed:\n{stderr}");
    assert!(stdout.contains("check: every promise holds"), "{stdout}");
}
