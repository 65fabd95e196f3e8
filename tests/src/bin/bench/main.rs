//! normkern's benchmark: every op against the device's copy bandwidth, measured in the same run.
//!
//! `cargo xtask bench [--reps N] [--warmup N] [--quick] [--shapes RxD,...] [--untracked]
//! [--param-grads] [--strategy auto|two-pass|single-launch]`, or `./bench` in a bundle (`--param-grads`: only the small-batch latency and
//! parameter-gradient strategy tables). Times are medians of CUDA event timings after warm-up; inputs rotate over enough sets
//! to exceed L2; bytes count the minimal traffic (each input read once, each output written
//! once). "host µs per call" is the median CPU time of the call itself (validation, launch plan,
//! enqueueing).

mod activation;
mod norm;
mod param_grads;

use normkern::{Context, ParamGradients};
use normkern_tests::bench::{Timing, copy_bandwidth, launch_floor_us};

/// One measured row of the table.
pub struct Measurement {
    pub op: &'static str,
    pub shape: String,
    pub dtype: &'static str,
    pub timing: Timing,
    pub bytes: f64,
}

/// Benchmark settings from the command line.
pub struct Settings {
    pub reps: usize,
    pub warmup: usize,
    pub quick: bool,
    /// `--shapes 1024x65536,4096x16384`: only these norm shapes (and no activations).
    pub shapes: Option<Vec<(usize, usize)>>,
    /// `--strategy two-pass|single-launch|auto`: how the backwards sum dγ/dβ/dbias.
    pub strategy: ParamGradients,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
    };
    let strategy = match args
        .iter()
        .position(|a| a == "--strategy")
        .map(|i| args.get(i + 1))
    {
        None => ParamGradients::Auto,
        Some(Some(s)) if s == "auto" => ParamGradients::Auto,
        Some(Some(s)) if s == "two-pass" => ParamGradients::TwoPass,
        Some(Some(s)) if s == "single-launch" => ParamGradients::SingleLaunch,
        Some(other) => {
            println!("bench: --strategy takes auto, two-pass or single-launch, not {other:?}");
            return;
        }
    };
    let settings = Settings {
        strategy,
        reps: value("--reps").unwrap_or(200),
        warmup: 20,
        quick: args.iter().any(|a| a == "--quick"),
        shapes: args
            .iter()
            .position(|a| a == "--shapes")
            .and_then(|i| args.get(i + 1))
            .map(|list| {
                list.split(',')
                    .filter_map(|s| {
                        let (r, d) = s.split_once('x')?;
                        Some((r.parse().ok()?, d.parse().ok()?))
                    })
                    .collect()
            }),
    };
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("bench: no GPU ({e}); nothing to measure");
            return;
        }
    };
    // `--untracked`: cudarc's event tracking off (as for CUDA graphs), so "host µs per call" is
    // normkern's own cost without cudarc's per-buffer event waits and records.
    let param_grads = args.iter().any(|a| a == "--param-grads");
    if param_grads || args.iter().any(|a| a == "--untracked") {
        // SAFETY: every buffer of the bench lives on its one stream.
        unsafe { ctx.cuda().disable_event_tracking() };
        println!("cudarc event tracking: off");
    }
    let stream = ctx.cuda().new_stream().expect("stream");
    let name = ctx.cuda().name().unwrap_or_default();
    let copy = copy_bandwidth(ctx.cuda(), &stream, 50);
    let launch_floor = launch_floor_us(ctx.cuda(), &stream, 1000);
    if param_grads {
        println!(
            "device: {name}; copy bandwidth {copy:.0} GB/s; launch floor {launch_floor:.1} host µs"
        );
        param_grads::run(&ctx, &stream, copy);
        return;
    }
    let mut results = Vec::new();
    results.extend(norm::run(&ctx, &stream, &settings));
    if settings.shapes.is_none() {
        results.extend(activation::run(&ctx, &stream, &settings));
    }
    println!();
    println!(
        "device: {name}, {} SMs, PTX sm_{}",
        ctx.sm_count(),
        ctx.ptx_arch()
    );
    println!("copy bandwidth (device-to-device, read + write): {copy:.0} GB/s");
    println!(
        "launch floor: {launch_floor:.1} host µs per launch of an empty kernel (cudarc, median of 1000)"
    );
    println!("| op | rows×d | dtype | µs | GB/s | % of copy | host µs per call |");
    println!("|---|---|---|---:|---:|---:|---:|");
    for m in &results {
        let gbs = m.bytes / (m.timing.device_us * 1e-6) / 1e9;
        println!(
            "| {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.1} |",
            m.op,
            m.shape,
            m.dtype,
            m.timing.device_us,
            gbs,
            100.0 * gbs / copy,
            m.timing.host_us
        );
    }
}
