//! Project tasks: `cargo xtask <task>`.
//!
//! - `build-ptx [--check] [--arch sm_90]`: compile `normkern-gpu` to PTX for every target
//!   architecture (or the one named) and write `host/ptx/normkern_<arch>.ptx`, then assemble
//!   each PTX with ptxas (`$PTXAS` or PATH; pin PyPI's `nvidia-cuda-nvcc`, as CI does) into
//!   `host/cubin/normkern_<arch>.cubin`; with `--check`, rebuild them and fail on any byte
//!   difference. Either way, fail when any kernel has a stack frame or spills, or the PTX a
//!   local-memory frame (as `ptxas` below).
//! - `ptxas`: run ptxas (`$PTXAS` or PATH) on every PTX; print registers, stack frame and spills per
//!   kernel; fail when any kernel has a stack frame or spills, or the PTX a local-memory frame.
//! - `bundle [DIR]`: build the release test, bench and example executables and collect them with `run.sh`
//!   into DIR (default `bundle/`), for a GPU host that has a driver but no Rust toolchain.
//! - `bench [ARGS]`: run the benchmark binary here (`--sweep [--csv PATH]`: the norms over d as CSV,
//!   a relative PATH from the workspace root).
//! - `plot-sweep --csv FILE [--peers FILE] [--out FILE]`: draw a sweep's CSV as a PNG (% of copy
//!   against d), the best of `tests/peers/peers.py`'s JSON dashed; by default beside the CSV.
//!   Needs the `plot` feature: `cargo run --release -p xtask --features plot -- plot-sweep …`.
//! - `sweep-table --csv FILE [--peers FILE] [--dtype bf16]`: print one dtype of a sweep's CSV as a
//!   Markdown table (d × op and direction, % of copy), each bf16 figure beside the best peer of
//!   `tests/peers/peers.py`'s JSON from the same call.

#[cfg(feature = "plot")]
mod plot;
// Without `plot` only its tests use it: they run in every `cargo test`.
#[cfg_attr(not(feature = "plot"), allow(dead_code))]
mod sweep_lines;
mod sweep_table;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Target architectures with one PTX and one cubin each; the host loads the newest not above the
/// device's: the cubin when the device runs it (same major version), the PTX otherwise.
const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("build-ptx") => build_ptx(
            args.iter().any(|a| a == "--check"),
            (args.iter().position(|a| a == "--arch")).and_then(|i| args.get(i + 1)),
        ),
        Some("ptxas") => ptxas(),
        Some("bundle") => bundle(
            args.get(1)
                .map(PathBuf::from)
                .unwrap_or_else(|| root().join("bundle")),
        ),
        Some("bench") => bench(&args[1..]),
        #[cfg(feature = "plot")]
        Some("plot-sweep") => plot::plot_sweep(&args[1..]),
        #[cfg(not(feature = "plot"))]
        Some("plot-sweep") => {
            Err("plot-sweep needs the plot feature: cargo run --release -p xtask --features plot -- plot-sweep …".into())
        }
        Some("sweep-table") => sweep_table(&args[1..]),
        _ => Err(
            "usage: cargo xtask <build-ptx [--check] [--arch ARCH] | ptxas | bundle [DIR] | bench [ARGS] \
             | plot-sweep --csv FILE [--peers FILE] [--out FILE] \
             | sweep-table --csv FILE [--peers FILE] [--dtype DTYPE]>"
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T = ()> = std::result::Result<T, String>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result {
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !status.success() {
        return Err(format!("{cmd:?} failed: {status}"));
    }
    Ok(())
}

fn ptx_path(arch: &str) -> PathBuf {
    root()
        .join("host/ptx")
        .join(format!("normkern_{}.ptx", arch.replace('_', "")))
}

fn cubin_path(arch: &str) -> PathBuf {
    root()
        .join("host/cubin")
        .join(format!("normkern_{}.cubin", arch.replace('_', "")))
}

fn ptxas_program() -> String {
    std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into())
}

/// Assembles one architecture's PTX into a cubin with ptxas's defaults (-O3, as the driver's JIT
/// would): the machine code a cold start loads instead of JIT-compiling every entry. Returns it
/// with ptxas's resource report (`-v`, which changes only the cubin's `.nv.info` metadata, not
/// its code: one run gives both).
fn assemble_cubin(arch: &str, ptx: &str) -> Result<(Vec<u8>, String)> {
    let dir = root().join("target/ptx").join(arch);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (input, output) = (dir.join("assemble.ptx"), dir.join("assemble.cubin"));
    std::fs::write(&input, ptx).map_err(|e| format!("{}: {e}", input.display()))?;
    let ptxas = ptxas_program();
    let out = Command::new(&ptxas)
        .args(["-v", &format!("-arch={arch}")])
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .map_err(|e| format!("cannot run ptxas ({ptxas}; set $PTXAS): {e}"))?;
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(format!("ptxas -v -arch={arch} failed:\n{report}"));
    }
    let cubin = std::fs::read(&output).map_err(|e| format!("{}: {e}", output.display()))?;
    Ok((cubin, report))
}

/// Compiles the kernel crate for one architecture and returns the PTX text.
fn compile_ptx(arch: &str) -> Result<String> {
    let root = root();
    let target_dir = root.join("target/ptx").join(arch);
    // The nested cargo must not inherit this process's flags; everything it needs is set here.
    let rustflags = [
        format!("-C target-cpu={arch}"),
        // sm_90's cluster mailboxes use `st.async` (PTX ISA 8.1); LLVM would declare 7.8 there.
        // sm_80 keeps LLVM's default (7.0), which every driver that runs it accepts.
        if arch == "sm_90" {
            "-C target-feature=+ptx81".into()
        } else {
            String::new()
        },
        "-Zunstable-options".into(),
        "-Cpanic=immediate-abort".into(),
        // Keep per-thread register tiles unrolled: LLVM's default threshold leaves loops over
        // them rolled, which puts the tiles in local memory (a stack frame in the ptxas report).
        "-C llvm-args=-unroll-threshold=4000".into(),
        format!("--remap-path-prefix={}=.", root.display()),
    ]
    .join(" ");
    run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&root)
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTC_WRAPPER")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .env("RUSTFLAGS", rustflags)
            .args([
                "rustc",
                "--quiet",
                "-p",
                "normkern-gpu",
                "--release",
                "--target",
                "nvptx64-nvidia-cuda",
            ])
            .args(["-Zbuild-std=core", "--crate-type", "cdylib", "--target-dir"])
            .arg(&target_dir),
    )?;
    let out = target_dir.join("nvptx64-nvidia-cuda/release/normkern_gpu.ptx");
    let ptx = read_text(&out)?;
    if let Some(line) = ptx.lines().find(|l| l.contains(&*root.to_string_lossy())) {
        return Err(format!(
            "{arch}: PTX contains a path of this checkout, so it is not reproducible: {line}"
        ));
    }
    Ok(with_register_budgets(&ptx))
}

/// Writes the register budgets the kernel tables declare (`Kernel::max_registers`, `.maxnreg`)
/// after the parameter lists of their entries: a kernel whose natural allocation would cost a
/// resident block gets one. Every budget must leave ptxas without spills (`cargo xtask ptxas`).
fn with_register_budgets(ptx: &str) -> String {
    let budgets: std::collections::HashMap<&str, u32> = normkern_gpu::kernels()
        .filter(|k| k.max_registers > 0)
        .map(|k| (k.name, k.max_registers))
        .collect();
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut pending: Option<u32> = None;
    for line in ptx.lines() {
        if let Some(name) = line
            .strip_prefix(".visible .entry ")
            .and_then(|rest| rest.strip_suffix('('))
        {
            pending = budgets.get(name).copied();
        }
        if line == "{"
            && let Some(budget) = pending.take()
        {
            out.push_str(&format!(".maxnreg {budget}\n"));
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn build_ptx(check: bool, only: Option<&String>) -> Result {
    // `--arch sm_90`: that architecture alone (a quicker build while measuring on one GPU).
    let archs: Vec<&str> = (ARCHS.into_iter())
        .filter(|arch| only.is_none_or(|o| o == arch))
        .collect();
    if archs.is_empty() {
        return Err(format!("--arch takes one of {}", ARCHS.join(", ")));
    }
    // The architectures build side by side, each in its own target directory: each build is
    // mostly one LLVM thread, and the two of them were most of CI's time.
    let built: Vec<Result<(String, Vec<u8>, String)>> = std::thread::scope(|scope| {
        let builds: Vec<_> = (archs.iter())
            .map(|&arch| {
                scope.spawn(move || {
                    let ptx = compile_ptx(arch)?;
                    let (cubin, report) = assemble_cubin(arch, &ptx)?;
                    Ok((ptx, cubin, report))
                })
            })
            .collect();
        (builds.into_iter())
            .map(|b| (b.join()).unwrap_or_else(|_| Err("a PTX build thread panicked".into())))
            .collect()
    });
    let (mut stale, mut bad) = (Vec::new(), Vec::new());
    for (&arch, built) in archs.iter().zip(built) {
        let (ptx, cubin, report) = built?;
        bad.extend(resource_problems(
            arch,
            &parse_ptxas(&report),
            &ptx,
            KNOWN_SPILLS,
        )?);
        let (ptx_file, cubin_file) = (ptx_path(arch), cubin_path(arch));
        if check {
            if std::fs::read(&ptx_file).unwrap_or_default() != ptx.as_bytes() {
                stale.push(ptx_file.display().to_string());
            }
            if std::fs::read(&cubin_file).unwrap_or_default() != cubin {
                stale.push(cubin_file.display().to_string());
            }
            continue;
        }
        for (file, bytes) in [(&ptx_file, ptx.as_bytes()), (&cubin_file, &cubin[..])] {
            if let Some(dir) = file.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            std::fs::write(file, bytes).map_err(|e| format!("{}: {e}", file.display()))?;
        }
        println!(
            "wrote {} ({} kernels, {} bytes) and {} ({} bytes)",
            ptx_file.display(),
            ptx.matches(".entry ").count(),
            ptx.len(),
            cubin_file.display(),
            cubin.len()
        );
    }
    if !stale.is_empty() {
        return Err(format!(
            "out of date (run `cargo xtask build-ptx` and commit): {}",
            stale.join(", ")
        ));
    }
    if check {
        println!("PTX and cubins up to date for {}", archs.join(", "));
    }
    resources_verdict(&bad)
}

/// One kernel's line of the ptxas report.
struct Resources {
    kernel: String,
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

fn number_before(text: &str, unit: &str) -> u32 {
    text.split(',')
        .find(|part| part.contains(unit))
        .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
        .unwrap_or(0)
}

/// The entries and functions of a ptxas report, in its order. ptxas reports a function's stack
/// frame and spills under "Function properties for <name>", which for an entry follows its
/// "Compiling entry function" line but may be followed by the properties of the functions it
/// calls (the in-launch column sum): each block belongs to the function it names, never to the
/// entry compiled last. The register count follows its entry's own properties.
fn parse_ptxas(report: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    // The function whose properties the next stack-frame line gives, by index into `out`.
    let mut described: Option<usize> = None;
    let mut entry: Option<usize> = None;
    let index_of = |out: &mut Vec<Resources>, name: &str| {
        if let Some(i) = out.iter().position(|r| r.kernel == name) {
            return i;
        }
        out.push(Resources {
            kernel: name.to_string(),
            registers: 0,
            stack: 0,
            spill_stores: 0,
            spill_loads: 0,
        });
        out.len() - 1
    };
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("");
            entry = Some(index_of(&mut out, name));
            described = None;
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            described = Some(index_of(&mut out, rest.trim()));
        } else if line.contains("bytes stack frame")
            && let Some(r) = described.map(|i| &mut out[i])
        {
            r.stack = number_before(line, "stack frame");
            r.spill_stores = number_before(line, "spill stores");
            r.spill_loads = number_before(line, "spill loads");
        } else if line.contains("Used ")
            && line.contains("registers")
            && let Some(r) = entry.map(|i| &mut out[i])
        {
            r.registers = line
                .split("Used ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        }
    }
    out
}

fn ptxas() -> Result {
    let ptxas = ptxas_program();
    let mut bad = Vec::new();
    for arch in ARCHS {
        let path = ptx_path(arch);
        let output = Command::new(&ptxas)
            .args(["-v", &format!("-arch={arch}")])
            .arg(&path)
            .args(["-o", "/dev/null"])
            .output()
            .map_err(|e| format!("cannot run ptxas ({ptxas}; set $PTXAS): {e}"))?;
        let report = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            return Err(format!("ptxas failed on {}:\n{report}", path.display()));
        }
        let kernels = parse_ptxas(&report);
        println!(
            "{arch}: {} entries and functions ({})",
            kernels.len(),
            path.display()
        );
        println!(
            "  {:<28} {:>5} {:>6} {:>7}",
            "kernel", "regs", "stack", "spills"
        );
        for r in &kernels {
            println!(
                "  {:<28} {:>5} {:>6} {:>7}",
                r.kernel,
                r.registers,
                r.stack,
                r.spill_stores + r.spill_loads
            );
        }
        let ptx = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        bad.extend(resource_problems(arch, &kernels, &ptx, KNOWN_SPILLS)?);
    }
    resources_verdict(&bad)
}

/// The kernels that spill, knowingly: `(arch, kernel, most bytes of stack frame + spill stores +
/// spill loads)`. None today: every kernel of both builds fits its register budget (issue 15 asks
/// for 0 bytes of stack and spills everywhere). A kernel that must spill goes here with its
/// measured cost; any other kernel that spills, or one of these spilling more, fails the check;
/// one that stops spilling must leave the list.
const KNOWN_SPILLS: &[(&str, &str, u32)] = &[];

/// The kernels of one architecture's ptxas report with a stack frame or spills beyond
/// [`KNOWN_SPILLS`], and the functions of its PTX with a local-memory frame. A local-memory
/// frame that ptxas then optimizes away still reports 0 bytes of stack, yet it cost the backwards
/// up to 45 % of their bandwidth once (an array indexed at run time, an aggregate passed to a
/// call): none may appear.
fn resource_problems(
    arch: &str,
    kernels: &[Resources],
    ptx: &str,
    known: &[(&str, &str, u32)],
) -> Result<Vec<String>> {
    if kernels.is_empty() {
        return Err(format!("ptxas reported no kernels for {arch}"));
    }
    let mut bad: Vec<String> = Vec::new();
    for r in kernels {
        let bytes = r.stack + r.spill_stores + r.spill_loads;
        let allowed = known
            .iter()
            .find(|(a, kernel, _)| *a == arch && *kernel == r.kernel)
            .map(|k| k.2);
        match allowed {
            Some(most) if bytes == 0 => bad.push(format!(
                "{arch} {} (no longer spills: take it off KNOWN_SPILLS, which allows {most} bytes)",
                r.kernel
            )),
            Some(most) if bytes > most => bad.push(format!(
                "{arch} {} ({bytes} bytes of stack and spills, more than the {most} known)",
                r.kernel
            )),
            None if bytes > 0 => bad.push(format!("{arch} {}", r.kernel)),
            _ => {}
        }
    }
    let mut function = "";
    for line in ptx.lines() {
        if let Some(name) =
            (line.strip_prefix(".visible .entry ")).or_else(|| line.strip_prefix(".func "))
        {
            function = name.trim_end_matches('(');
        }
        if line.trim_start().starts_with(".local ") {
            bad.push(format!(
                "{arch} {function} (a local-memory frame in the PTX)"
            ));
        }
    }
    Ok(bad)
}

fn resources_verdict(bad: &[String]) -> Result {
    if !bad.is_empty() {
        return Err(format!(
            "kernels with a stack frame, spills or local memory: {}",
            bad.join(", ")
        ));
    }
    println!(
        "ptxas: no kernel has a stack frame or spills beyond KNOWN_SPILLS ({} listed), and no local \
         memory in the PTX",
        KNOWN_SPILLS.len()
    );
    Ok(())
}

/// Paths of the executables a cargo build with `--message-format=json` produced.
fn executables(json: &str) -> Vec<PathBuf> {
    json.lines()
        .filter_map(|l| l.split("\"executable\":\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(PathBuf::from)
        .collect()
}

fn cargo_json(args: &[&str]) -> Result<String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root())
        .args(args)
        .args(["--release", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn bundle(dir: PathBuf) -> Result {
    let tests = cargo_json(&["test", "-p", "normkern-tests", "--no-run"])?;
    let bins = cargo_json(&["build", "-p", "normkern-tests", "--bins"])?;
    let examples = cargo_json(&["build", "-p", "normkern", "--examples"])?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tests")).map_err(|e| e.to_string())?;
    let mut test_names = Vec::new();
    // Integration tests only: the library and the binaries have no tests of their own.
    let integration: String = tests
        .lines()
        .filter(|l| l.contains("\"kind\":[\"test\"]"))
        .collect::<Vec<_>>()
        .join("\n");
    for exe in executables(&integration) {
        // Test executables are named `<target>-<hash>`; keep the target name.
        let file = exe
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or("test")
            .to_string();
        let name = file
            .rsplit_once('-')
            .map_or(file.as_str(), |(n, _)| n)
            .to_string();
        std::fs::copy(&exe, dir.join("tests").join(&name))
            .map_err(|e| format!("{}: {e}", exe.display()))?;
        test_names.push(name);
    }
    for exe in executables(&bins).into_iter().chain(executables(&examples)) {
        let name = exe.file_name().and_then(|f| f.to_str()).unwrap_or("bin");
        std::fs::copy(&exe, dir.join(name)).map_err(|e| format!("{}: {e}", exe.display()))?;
    }
    let script = r#"#!/usr/bin/env bash
# Runs normkern's GPU tests and benchmark on a host with a CUDA driver (no Rust needed).
# Usage: ./run.sh [tests|bench|demo|sanitize|all] [extra args for the bench]
#   tests     every test binary, GPU tests required (NORMKERN_REQUIRE_GPU=1)
#   sanitize  compute-sanitizer's memcheck, racecheck, initcheck and synccheck over the sweep
#             (every op, dtype and kernel family once), one run per tool and dtype
#   all       tests, demo, bench
set -uo pipefail
cd "$(dirname "$0")"
what=${1:-all}; shift || true
status=0
if [[ $what == tests || $what == all ]]; then
  for t in tests/*; do
    echo "== $t"
    NORMKERN_REQUIRE_GPU=1 "$t" --test-threads=1 || status=1
  done
fi
if [[ $what == sanitize ]]; then
  for tool in memcheck racecheck initcheck synccheck; do
    for dtype in f32 f16 bf16; do
      echo "== compute-sanitizer --tool $tool ./sweep $dtype"
      compute-sanitizer --tool "$tool" --error-exitcode 99 ./sweep "$dtype" || status=1
    done
  done
fi
if [[ $what == demo || $what == all ]]; then ./demo || status=1; fi
if [[ $what == bench || $what == all ]]; then ./bench "$@" || status=1; fi
exit $status
"#;
    let run_sh = dir.join("run.sh");
    std::fs::write(&run_sh, script).map_err(|e| e.to_string())?;
    run(Command::new("chmod").arg("+x").arg(&run_sh))?;
    println!(
        "bundle in {} ({} test executables)",
        dir.display(),
        test_names.len()
    );
    Ok(())
}

fn bench(args: &[String]) -> Result {
    run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(root())
            .args([
                "run",
                "--quiet",
                "--release",
                "-p",
                "normkern-tests",
                "--bin",
                "bench",
                "--",
            ])
            .args(args),
    )
}

/// The value after `name` in a task's arguments (`--csv FILE`).
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).map(String::as_str)
}

/// A text file, or an error that names it.
fn read_text(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `sweep-table --csv FILE [--peers FILE] [--dtype bf16]`.
fn sweep_table(args: &[String]) -> Result {
    let csv =
        flag(args, "--csv").ok_or("sweep-table needs --csv FILE (the bench's --sweep output)")?;
    let peers = flag(args, "--peers").map(read_text).transpose()?;
    let dtype = flag(args, "--dtype").unwrap_or("bf16");
    print!(
        "{}",
        sweep_table::markdown(&read_text(csv)?, peers.as_deref(), dtype)?
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry's spills are its own, not those of a function reported after it (the report of
    /// one sm_90 backward, a spilling one, as ptxas 13 prints it).
    #[test]
    fn properties_belong_to_the_function_they_name() {
        let report = "\
ptxas info    : Compiling entry function 'rms_norm_bwd_bf16_v2' for 'sm_90'
ptxas info    : Function properties for rms_norm_bwd_bf16_v2
    8 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Compile time = 175.885 ms
ptxas info    : Function properties for column_sum_in_launch
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'rms_norm_bwd_bf16_sx' for 'sm_90'
ptxas info    : Function properties for rms_norm_bwd_bf16_sx
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
";
        let found = parse_ptxas(report);
        let of = |name: &str| found.iter().find(|r| r.kernel == name).unwrap();
        let v2 = of("rms_norm_bwd_bf16_v2");
        assert_eq!(
            (v2.registers, v2.stack, v2.spill_stores, v2.spill_loads),
            (80, 8, 16, 16)
        );
        let sx = of("rms_norm_bwd_bf16_sx");
        assert_eq!((sx.registers, sx.stack, sx.spill_stores), (40, 0, 0));
        assert_eq!(of("column_sum_in_launch").stack, 0);
        let bad = resource_problems("sm_90", &found, "", KNOWN_SPILLS).unwrap();
        assert_eq!(bad, ["sm_90 rms_norm_bwd_bf16_v2"]);
    }

    /// A known spill passes up to its listed bytes, fails past them or once it is gone.
    #[test]
    fn known_spills_are_bounded() {
        let known = [("sm_80", "rms_norm_bwd_bf16_v4", 120)];
        let (arch, kernel, most) = known[0];
        let with = |bytes: u32| {
            let r = Resources {
                kernel: kernel.to_string(),
                registers: 80,
                stack: 0,
                spill_stores: bytes,
                spill_loads: 0,
            };
            resource_problems(arch, &[r], "", &known).unwrap().len()
        };
        assert_eq!((with(most), with(most + 1), with(0)), (0, 1, 1));
    }
}
