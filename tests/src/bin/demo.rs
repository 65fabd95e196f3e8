//! normkern's main job end to end: RMSNorm forward and backward on a realistic shape, sampled rows
//! and all of dγ checked against the f64 reference, and the timing. Without a GPU it says so and
//! runs the same kernels in the CPU emulator on a small shape instead.

use half::bf16;
use normkern::{Context, Emulator, NormConfig, Rows, rms_norm};
use normkern_tests::bench::{copy_bandwidth, median_us};
use normkern_tests::reference::rms_norm as reference;
use normkern_tests::{Rng, TestDtype, aligned_f32, floats_mut, to_f64};

const EPS: f32 = 1e-6;

/// Largest error of the sampled rows and of dγ, relative to each tensor's largest reference value.
struct Check {
    y: f64,
    dx: f64,
    dgamma: f64,
}

fn max_rel(got: &[f64], reference: &[f64]) -> f64 {
    let scale = reference
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    got.iter()
        .zip(reference)
        .fold(0.0f64, |m, (g, r)| m.max((g - r).abs() / scale))
}

/// `[x, dy, gamma]` and `[y, dx, dgamma]` of one run.
fn check(
    [x, dy, gamma]: [&[bf16]; 3],
    [y, dx, dgamma]: [&[bf16]; 3],
    rows: usize,
    d: usize,
) -> Check {
    let gamma64 = to_f64(gamma);
    let (dx_all, dgamma_ref) =
        reference::backward(&to_f64(dy), &to_f64(x), &gamma64, rows, d, EPS as f64);
    let sample: Vec<usize> = (0..8).map(|i| i * (rows - 1) / 7).collect();
    let (mut y_err, mut dx_err) = (0.0f64, 0.0f64);
    for &r in &sample {
        let row = r * d..(r + 1) * d;
        let (y_ref, _) = reference::forward(&to_f64(&x[row.clone()]), &gamma64, 1, d, EPS as f64);
        y_err = y_err.max(max_rel(&to_f64(&y[row.clone()]), &y_ref));
        dx_err = dx_err.max(max_rel(&to_f64(&dx[row.clone()]), &dx_all[row]));
    }
    Check {
        y: y_err,
        dx: dx_err,
        dgamma: max_rel(&to_f64(dgamma), &dgamma_ref),
    }
}

fn report(c: &Check) -> bool {
    // bf16 stores round to 2^-8 relative; anything near that is right, anything far is a bug.
    let ok = c.y < 1e-2 && c.dx < 1e-2 && c.dgamma < 1e-2;
    println!(
        "check vs f64 reference (8 sampled rows of y and dx, all of dγ): max error y {:.1e}, dx {:.1e}, dγ {:.1e} -> {}",
        c.y,
        c.dx,
        c.dgamma,
        if ok { "OK" } else { "MISMATCH" }
    );
    ok
}

fn main() {
    let ok = match Context::new(0) {
        Ok(ctx) => on_gpu(&ctx),
        Err(e) => {
            println!("No GPU found ({e}).");
            println!("Running the same kernels in the CPU emulator on a small shape instead.");
            on_emulator()
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}

fn on_gpu(ctx: &Context) -> bool {
    let (rows, d) = (16384, 4096);
    let stream = ctx.cuda().new_stream().expect("stream");
    println!(
        "GPU: {} ({} SMs, PTX sm_{}); RMSNorm bf16 {rows}×{d}",
        ctx.cuda().name().unwrap_or_default(),
        ctx.sm_count(),
        ctx.ptx_arch()
    );
    let mut rng = Rng::fresh("demo");
    let (x, dy, gamma) = (
        rng.vec::<bf16>(rows * d, -2.0, 2.0),
        rng.vec::<bf16>(rows * d, -1.0, 1.0),
        rng.vec::<bf16>(d, 0.5, 1.5),
    );
    let xd = stream.clone_htod(&x).unwrap();
    let dyd = stream.clone_htod(&dy).unwrap();
    let gd = stream.clone_htod(&gamma).unwrap();
    let mut yd = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
    let mut dxd = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
    let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
    let mut dgamma = stream.alloc_zeros::<bf16>(d).unwrap();
    let mut ws = rms_norm::alloc_workspace(&stream, rows, d).unwrap();
    let cfg = NormConfig::new(EPS);
    let xv = Rows::new(xd.as_view(), rows, d).unwrap();
    let dyv = Rows::new(dyd.as_view(), rows, d).unwrap();
    let mut forward = || {
        let mut y = Rows::new(yd.as_view_mut(), rows, d).unwrap();
        rms_norm::forward(
            ctx,
            &stream,
            &cfg,
            &xv,
            &gd.as_view(),
            &mut y,
            Some(&mut rstd.as_view_mut()),
        )
        .unwrap();
    };
    let fwd_us = median_us(ctx.cuda(), &stream, 5, 50, |_| forward());
    let mut backward = || {
        let mut dx = Rows::new(dxd.as_view_mut(), rows, d).unwrap();
        rms_norm::backward(
            ctx,
            &stream,
            &cfg,
            &dyv,
            &xv,
            &gd.as_view(),
            Some(&rstd.as_view()),
            &mut dx,
            &mut dgamma.as_view_mut(),
            &mut ws.as_view_mut(),
        )
        .unwrap();
    };
    let bwd_us = median_us(ctx.cuda(), &stream, 5, 50, |_| backward());
    stream.synchronize().unwrap();
    let (y, dx, dg) = (
        stream.clone_dtoh(&yd).unwrap(),
        stream.clone_dtoh(&dxd).unwrap(),
        stream.clone_dtoh(&dgamma).unwrap(),
    );
    let ok = report(&check([&x, &dy, &gamma], [&y, &dx, &dg], rows, d));
    let copy = copy_bandwidth(ctx.cuda(), &stream, 20);
    let n = (rows * d * 2) as f64;
    let (fwd_gbs, bwd_gbs) = (2.0 * n / fwd_us / 1e3, 3.0 * n / bwd_us / 1e3);
    println!(
        "forward  {fwd_us:7.1} µs  {fwd_gbs:5.0} GB/s  ({:.0}% of the {copy:.0} GB/s copy bandwidth)",
        100.0 * fwd_gbs / copy
    );
    println!(
        "backward {bwd_us:7.1} µs  {bwd_gbs:5.0} GB/s  ({:.0}% of copy)",
        100.0 * bwd_gbs / copy
    );
    ok
}

fn on_emulator() -> bool {
    let (rows, d) = (48, 512);
    println!("Emulator: RMSNorm bf16 {rows}×{d}");
    let mut rng = Rng::fresh("demo");
    let (x, dy, gamma) = (
        rng.vec::<bf16>(rows * d, -2.0, 2.0),
        rng.vec::<bf16>(rows * d, -1.0, 1.0),
        rng.vec::<bf16>(d, 0.5, 1.5),
    );
    let mut y = vec![bf16::poison(); rows * d];
    let mut dx = vec![bf16::poison(); rows * d];
    let mut rstd = vec![0.0f32; rows];
    let mut dgamma = vec![bf16::poison(); d];
    let ws_len = rms_norm::workspace_len(rows, d);
    let mut ws = aligned_f32(ws_len);
    let emu = Emulator::new();
    let start = std::time::Instant::now();
    let xv = Rows::new(&x[..], rows, d).unwrap();
    emu.rms_norm_forward(
        &NormConfig::new(EPS),
        &xv,
        &gamma,
        &mut Rows::new(&mut y[..], rows, d).unwrap(),
        Some(&mut rstd),
    )
    .unwrap();
    emu.rms_norm_backward(
        &NormConfig::new(EPS),
        &Rows::new(&dy[..], rows, d).unwrap(),
        &xv,
        &gamma,
        Some(&rstd),
        &mut Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dgamma,
        floats_mut(&mut ws, ws_len),
    )
    .unwrap();
    println!(
        "forward + backward emulated in {:.2} s (CPU threads; no GPU timing)",
        start.elapsed().as_secs_f64()
    );
    report(&check([&x, &dy, &gamma], [&y, &dx, &dgamma], rows, d))
}
