//! normkern's main job end to end: RMSNorm forward and backward on a realistic shape, sampled rows
//! and all of dγ checked against the f64 reference, and the timing. Without a GPU it says so and
//! runs the same kernels in the CPU emulator on a small shape instead.

use half::bf16;
use normkern::{Context, Emulator, NormBackward, NormForward, Rows, rms_norm};
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::bench::{copy_bandwidth, median_us};
use normkern_tests::reference::rms_norm as reference;
use normkern_tests::{Rng, TestDtype, to_f64};

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
            let (rows, d) = (48, 512);
            println!("Emulator: RMSNorm bf16 {rows}×{d}");
            let start = std::time::Instant::now();
            let host = Host(Emulator::new());
            let run = Run::new(&host, rows, d);
            run.forward();
            run.backward();
            println!(
                "forward + backward emulated in {:.2} s (CPU threads; no GPU timing)",
                start.elapsed().as_secs_f64()
            );
            run.check()
        }
    };
    std::process::exit(if ok { 0 } else { 1 });
}

/// One RMSNorm forward + backward problem on a backend: random inputs, poisoned outputs.
struct Run<'b, B: Backend> {
    backend: &'b B,
    rows: usize,
    d: usize,
    host: [Vec<bf16>; 3],
    x: B::Buf<bf16>,
    dy: B::Buf<bf16>,
    weight: B::Buf<bf16>,
    y: std::cell::RefCell<B::Buf<bf16>>,
    dx: std::cell::RefCell<B::Buf<bf16>>,
    dweight: std::cell::RefCell<B::Buf<bf16>>,
    rstd: std::cell::RefCell<B::Buf<f32>>,
    workspace: std::cell::RefCell<B::Buf<f32>>,
}

impl<'b, B: Backend> Run<'b, B> {
    fn new(backend: &'b B, rows: usize, d: usize) -> Self {
        let mut rng = Rng::fresh("demo");
        let host = [
            rng.vec::<bf16>(rows * d, -2.0, 2.0),
            rng.vec::<bf16>(rows * d, -1.0, 1.0),
            rng.vec::<bf16>(d, 0.5, 1.5),
        ];
        let poison = |n| backend.upload(&vec![bf16::poison(); n]);
        let ws_len = rms_norm::workspace_len(rows, d).expect("workspace length");
        Run {
            backend,
            rows,
            d,
            x: backend.upload(&host[0]),
            dy: backend.upload(&host[1]),
            weight: backend.upload(&host[2]),
            y: poison(rows * d).into(),
            dx: poison(rows * d).into(),
            dweight: poison(d).into(),
            rstd: backend.upload(&vec![f32::NAN; rows]).into(),
            workspace: backend
                .upload(&normkern_tests::poisoned_workspace(ws_len))
                .into(),
            host,
        }
    }

    fn forward(&self) {
        let (rows, d) = (self.rows, self.d);
        let (mut y, mut rstd) = (self.y.borrow_mut(), self.rstd.borrow_mut());
        let x = Rows::new(B::input(&self.x, 0), rows, d).unwrap();
        let y = Rows::new(B::output(&mut y, 0), rows, d).unwrap();
        let args = NormForward::new(x, B::input(&self.weight, 0), y).eps(EPS);
        rms_norm::forward(self.backend.exec(), args.rstd(B::output(&mut rstd, 0))).unwrap();
    }

    fn backward(&self) {
        let (rows, d) = (self.rows, self.d);
        let (mut dx, mut dweight) = (self.dx.borrow_mut(), self.dweight.borrow_mut());
        let (rstd, mut workspace) = (self.rstd.borrow(), self.workspace.borrow_mut());
        let dy = Rows::new(B::input(&self.dy, 0), rows, d).unwrap();
        let x = Rows::new(B::input(&self.x, 0), rows, d).unwrap();
        let dx = Rows::new(B::output(&mut dx, 0), rows, d).unwrap();
        let (weight, dweight) = (B::input(&self.weight, 0), B::output(&mut dweight, 0));
        let args = NormBackward::new(dy, x, weight, dx, dweight, B::output(&mut workspace, 0));
        let args = args.eps(EPS).rstd(B::input(&rstd, 0));
        rms_norm::backward(self.backend.exec(), args).unwrap();
    }

    /// Compares the outputs with the f64 reference and prints the verdict.
    fn check(&self) -> bool {
        let [x, dy, weight] = &self.host;
        let b = self.backend;
        let outputs = [
            b.download(&self.y.borrow()),
            b.download(&self.dx.borrow()),
            b.download(&self.dweight.borrow()),
        ];
        let [y, dx, dweight] = &outputs;
        report(&check([x, dy, weight], [y, dx, dweight], self.rows, self.d))
    }
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
    let device = Device::new(ctx, &stream);
    let run = Run::new(&device, rows, d);
    let fwd_us = median_us(ctx.cuda(), &stream, 5, 50, |_| run.forward());
    let bwd_us = median_us(ctx.cuda(), &stream, 5, 50, |_| run.backward());
    let ok = run.check();
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
