//! normkern's benchmark: every op against the device's copy bandwidth, measured in the same run.
//!
//! `cargo xtask bench [--reps N] [--warmup N] [--quick] [--shapes RxD,...] [--untracked]
//! [--param-grads] [--strategy auto|two-pass|single-launch] [--sweep [--dtypes bf16,f32,f16]]
//! [--activations] [--grid-limit BLOCKS] [--csv PATH]`, or `./bench` in a bundle
//! (`--param-grads`: only the small-batch latency and parameter-gradient strategy tables;
//! `--activations`: only the activations, at the `--shapes` given if any; `--sweep`: the norms
//! over d = 128 … 65536 at 64 Mi elements (or the `--shapes` given), bf16, both plain norms also
//! in f32 and f16 (`--dtypes`: only those), 50 reps unless `--reps` says otherwise; `--csv PATH`:
//! the table as CSV too, for `cargo xtask plot-sweep`, by default `sweep.csv` with `--sweep`;
//! `--grid-limit`: every persistent grid capped at that many blocks, as
//! `Context::with_grid_limit` does, to see what fewer blocks in flight do to a shape). Times are
//! medians of CUDA event timings after warm-up (`--warmup` calls, and at least 200 ms of them),
//! each call enqueued behind a spin kernel so that its events time its device work alone
//! (`NORMKERN_BENCH_IDLE=1`: on an idle stream, as before 2026-12-02; the `--param-grads` latency
//! table always times lone calls on an idle stream, launch included); inputs rotate over enough
//! sets to exceed L2; bytes count the minimal traffic (each input read once, each output written
//! once). "host µs per call" is the median CPU time of the call itself (validation, launch plan,
//! enqueueing), over calls issued back to back and over calls each issued on an idle stream, as
//! the launch floors' empty launches are.

mod activation;
mod norm;
mod param_grads;

use normkern::{Context, ParamGradients};
use normkern_tests::bench::{
    HostTime, LaunchFloor, Timing, copy_bandwidth, idle_timing, launch_floor,
};

/// One measured row of the table.
pub struct Measurement {
    /// The op and direction, as the table labels them: "rms_norm fwd", "rms_norm bwd + dresidual".
    pub op: &'static str,
    pub rows: usize,
    pub d: usize,
    pub dtype: &'static str,
    pub timing: Timing,
    pub bytes: f64,
}

impl Measurement {
    fn gbs(&self) -> f64 {
        self.bytes / (self.timing.device_us * 1e-6) / 1e9
    }

    fn pct_of(&self, copy_gbs: f64) -> f64 {
        100.0 * self.gbs() / copy_gbs
    }

    /// The label split into the op and its direction (the word that starts with fwd or bwd):
    /// "rms_norm bwd + dresidual" is ("rms_norm + dresidual", "bwd").
    fn op_and_direction(&self) -> (String, &'static str) {
        let is_direction = |word: &str| word.starts_with("fwd") || word.starts_with("bwd");
        let words = self.op.split(' ');
        let direction = words.clone().find(|w| is_direction(w)).unwrap_or("");
        let op = words.filter(|w| !is_direction(w)).collect::<Vec<_>>();
        (op.join(" "), direction)
    }
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
    /// `--dtypes bf16,f16`: the sweep's dtypes (all three when absent). Each dtype's operands
    /// are allocated when it is measured, so one alone also sits elsewhere in memory.
    pub dtypes: Option<Vec<String>>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The value after `flag`, parsed (a number, a path).
    fn value<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1)?.parse().ok()
    }
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
    // The sweep measures 100 rows: fewer reps and warm-ups than the fixed shapes keep it short.
    let sweep = args.iter().any(|a| a == "--sweep");
    let csv: Option<String> = value(&args, "--csv").or(sweep.then(|| "sweep.csv".into()));
    let settings = Settings {
        strategy,
        dtypes: value::<String>(&args, "--dtypes")
            .map(|list| list.split(',').map(str::to_owned).collect()),
        reps: value(&args, "--reps").unwrap_or(if sweep { 50 } else { 200 }),
        warmup: value(&args, "--warmup").unwrap_or(if sweep { 10 } else { 20 }),
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
    if let Some(unknown) =
        (settings.dtypes.iter().flatten()).find(|t| !["bf16", "f32", "f16"].contains(&t.as_str()))
    {
        eprintln!("bench: --dtypes takes bf16, f32 and f16, not {unknown:?}");
        std::process::exit(2);
    }
    // `--grid-limit` must name a number; whether the number is allowed, the context says.
    let grid_limit: Option<usize> = value(&args, "--grid-limit");
    if grid_limit.is_none() && args.iter().any(|a| a == "--grid-limit") {
        eprintln!("bench: --grid-limit takes a number of blocks");
        std::process::exit(2);
    }
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("bench: no GPU ({e}); nothing to measure");
            return;
        }
    };
    let ctx = match grid_limit {
        None => ctx,
        Some(blocks) => {
            let ctx = ctx.with_grid_limit(blocks).unwrap_or_else(|e| {
                eprintln!("bench: --grid-limit {blocks}: {e}");
                std::process::exit(2);
            });
            println!("persistent grids capped at {blocks} blocks (--grid-limit)");
            ctx
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
    let floor = launch_floor(ctx.cuda(), &stream, 1000);
    if param_grads {
        println!("device: {name}; copy bandwidth {copy:.0} GB/s");
        print_floor(&floor);
        param_grads::run(&ctx, &stream, copy);
        return;
    }
    let mut results = Vec::new();
    if sweep {
        results.extend(norm::sweep(&ctx, &stream, &settings));
    } else if args.iter().any(|a| a == "--activations") {
        results.extend(activation::run(&ctx, &stream, &settings));
    } else {
        results.extend(norm::run(&ctx, &stream, &settings));
        if settings.shapes.is_none() {
            results.extend(activation::run(&ctx, &stream, &settings));
        }
    }
    println!();
    println!(
        "device: {name}, {} SMs, PTX sm_{}",
        ctx.sm_count(),
        ctx.ptx_arch()
    );
    println!("copy bandwidth (device-to-device, read + write): {copy:.0} GB/s");
    print_floor(&floor);
    println!(
        "device µs: CUDA events around each call, {}",
        if idle_timing() {
            "on an idle stream (NORMKERN_BENCH_IDLE=1: includes the call's host time and launch latency)"
        } else {
            "enqueued behind a 50 µs spin kernel (the call's device work alone)"
        }
    );
    println!(
        "host µs per call: back to back (calls queued behind the GPU) / each on an idle stream"
    );
    println!("| op | rows×d | dtype | µs | GB/s | % of copy | host µs per call |");
    println!("|---|---|---|---:|---:|---:|---:|");
    for m in &results {
        println!(
            "| {} | {}×{} | {} | {:.1} | {:.0} | {:.1} | {:.1} / {:.1} |",
            m.op,
            m.rows,
            m.d,
            m.dtype,
            m.timing.device_us,
            m.gbs(),
            m.pct_of(copy),
            m.timing.host_us,
            m.timing.host_idle_us
        );
    }
    if let Some(path) = csv {
        match std::fs::write(&path, to_csv(&results, copy)) {
            Ok(()) => println!("wrote {path}"),
            Err(e) => println!("bench: cannot write {path}: {e}"),
        }
    }
}

/// The results as CSV, one line per row of the table.
fn to_csv(results: &[Measurement], copy: f64) -> String {
    // Quoted where a field holds a comma ("bf16, f32 residual").
    let field = |s: &str| {
        if s.contains([',', '"']) {
            format!("\"{}\"", s.replace('"', "\"\""))
        } else {
            s.to_string()
        }
    };
    let mut csv = String::from(
        "op,direction,dtype,rows,d,us,gbs,pct_of_copy,copy_gbs,host_us,host_idle_us\n",
    );
    for m in results {
        let (op, direction) = m.op_and_direction();
        csv += &format!(
            "{},{direction},{},{},{},{:.2},{:.1},{:.2},{copy:.1},{:.2},{:.2}\n",
            field(&op),
            field(m.dtype),
            m.rows,
            m.d,
            m.timing.device_us,
            m.gbs(),
            m.pct_of(copy),
            m.timing.host_us,
            m.timing.host_idle_us
        );
    }
    csv
}

/// The launch floors, on one line: what an empty kernel's launch costs the host, by launch kind.
fn print_floor(floor: &LaunchFloor) {
    let host = |t: Option<HostTime>| {
        t.map_or("refused".to_owned(), |t| {
            format!("{:.1} / {:.1}", t.back_to_back_us, t.idle_us)
        })
    };
    println!(
        "launch floor, host µs per launch of an empty kernel (median of 1000 back to back / of \
         1000 each on an idle stream): cudarc {}; cuLaunchKernelEx {}, cooperative {}, \
         clusters of 2 {}",
        host(Some(floor.plain)),
        host(Some(floor.ex)),
        host(floor.cooperative),
        host(floor.cluster)
    );
}
