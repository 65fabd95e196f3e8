//! Times the data-parallel reduction of dγ (and dβ) on two GPUs, one thread per rank: a rank's
//! backward alone (its own dγ), in exact mode (gather the batch's partial rows, column sum over
//! all) and in fast mode (local sums, one all-reduce). The reduction's cost is the difference.
//! Prints one table row per shape and op; bf16 activations, f32 gradients.
//!
//! Run: `distributed` (needs two GPUs and libnccl.so on the loader's path).

use half::bf16;
use normkern::cudarc::driver::CudaSlice;
use normkern::distributed::{self, BatchSplit, Communicator, DataParallel, Mode};
use normkern::{Context, NormBackward, Rows, layer_norm, rms_norm};
use normkern_tests::bench::time;

const WORLD: usize = 2;

fn main() {
    let shapes = [(16384usize, 4096usize), (1024, 65536)];
    let id = Communicator::unique_id().expect("NCCL");
    let rows: Vec<Vec<String>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                scope.spawn(move || {
                    let ctx = Context::new(rank).unwrap();
                    let stream = ctx.cuda().new_stream().unwrap();
                    let gpu = ctx.on(&stream).unwrap();
                    let comm = Communicator::from_rank(&ctx, rank, WORLD, &id).unwrap();
                    let mut lines = Vec::new();
                    for (rows, d) in shapes {
                        let split = BatchSplit::even(rows, d, WORLD).unwrap();
                        let mine = split.rank_rows(rank).unwrap().len();
                        let x: CudaSlice<bf16> = stream.clone_htod(&vec![bf16::from_f32(0.7); mine * d]).unwrap();
                        let dy: CudaSlice<bf16> = stream.clone_htod(&vec![bf16::from_f32(0.3); mine * d]).unwrap();
                        let weight: CudaSlice<bf16> = stream.clone_htod(&vec![bf16::ONE; d]).unwrap();
                        let mut dx: CudaSlice<bf16> = stream.alloc_zeros(mine * d).unwrap();
                        let mut grads: CudaSlice<f32> = stream.alloc_zeros(2 * d).unwrap();
                        let most = split.layer_norm_workspace_len(rank, Mode::Exact).unwrap()
                            .max(split.layer_norm_workspace_len(rank, Mode::Fast).unwrap());
                        let mut workspace: CudaSlice<f32> = stream.alloc_zeros(most).unwrap();
                        for layer in [false, true] {
                            let mut call = |mode: Option<Mode>| {
                                let (dweight, dbias) = grads.split_at_mut(d);
                                let mut args = NormBackward::new(
                                    Rows::new(dy.as_view(), mine, d).unwrap(),
                                    Rows::new(x.as_view(), mine, d).unwrap(),
                                    weight.as_view(),
                                    Rows::new(dx.as_view_mut(), mine, d).unwrap(),
                                    dweight,
                                    workspace.as_view_mut(),
                                );
                                if layer {
                                    args = args.dbias(dbias);
                                }
                                match (layer, mode) {
                                    (false, None) => rms_norm::backward(&gpu, args),
                                    (true, None) => layer_norm::backward(&gpu, args),
                                    (false, Some(mode)) => distributed::rms_norm_backward(&gpu, DataParallel { comm: &comm, split: &split, mode }, args),
                                    (true, Some(mode)) => distributed::layer_norm_backward(&gpu, DataParallel { comm: &comm, split: &split, mode }, args),
                                }
                                .unwrap()
                            };
                            let mut us = |mode| time(ctx.cuda(), &stream, 10, 50, |_| call(mode)).device_us;
                            let (alone, exact, fast) = (us(None), us(Some(Mode::Exact)), us(Some(Mode::Fast)));
                            let sums = 1 + layer as usize;
                            let groups = normkern::group_layout(rows, d).0;
                            let all_groups = rows.div_ceil(groups);
                            let own_groups = mine.div_ceil(groups);
                            let exact_bytes = (all_groups - own_groups) * d * 4 * sums;
                            let fast_bytes = d * 4 * sums;
                            lines.push(format!(
                                "| {rows}×{d} | {} | {mine} | {alone:.1} | {exact:.1} | {:.1} | {} | {fast:.1} | {:.1} | {} |",
                                if layer { "LayerNorm" } else { "RMSNorm" },
                                exact - alone,
                                exact_bytes,
                                fast - alone,
                                fast_bytes,
                            ));
                        }
                    }
                    lines
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    });
    println!(
        "| batch | op | rows on rank 0 | rank's backward µs | exact µs | exact − alone µs | exact bytes received per rank | fast µs | fast − alone µs | fast all-reduce bytes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for line in &rows[0] {
        println!("{line}");
    }
}
