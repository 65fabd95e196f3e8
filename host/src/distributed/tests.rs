//! The ranks of a split batch as threads running the emulator, meeting through shared memory the
//! way NCCL's broadcasts and all-reduce meet: exact mode must give the bits of the whole batch
//! on one device, on every rank, for even, uneven and empty shares.

use std::sync::{Arc, Barrier, Mutex};

use super::*;
use crate::activation::{self, Activation};
use crate::norm::NormBackward;
use crate::plan::ParamGradients;
use crate::{Emulator, Rows};
use normkern_gpu::column_sum::{GROUP_SUMS_SYNC_WORDS, group_layout};
use normkern_gpu::norm::Norm;

/// A 16-byte aligned f32 buffer of `n` elements (the emulator plans 16-byte packs where the
/// device would: equal alignment keeps the tiles, and so the bits, equal).
fn aligned(values: impl IntoIterator<Item = f32>, n: usize) -> Vec<[f32; 4]> {
    let mut buf = vec![[f32::NAN; 4]; n.div_ceil(4)];
    for (slot, v) in buf.as_flattened_mut().iter_mut().zip(values) {
        *slot = v;
    }
    buf
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

/// What the ranks share: one buffer the size of the whole batch's partials, and a barrier.
struct Network {
    blocks: Mutex<Vec<f32>>,
    vectors: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

struct EmulatedMeet {
    rank: usize,
    of: GradientsOf,
    split: BatchSplit,
    network: Arc<Network>,
}

impl Meet for EmulatedMeet {
    fn gather(&mut self, partials: u64, groups: usize, sums: usize) -> Result<()> {
        let d = self.split.d();
        let len = sums * groups * d;
        // SAFETY: the backward validated `len` f32 of workspace at `partials` (a host address in
        // the emulator), which nothing else touches during this call.
        let mine = unsafe { std::slice::from_raw_parts_mut(partials as *mut f32, len) };
        assert_eq!(groups, self.split.layout_of(self.of).1);
        let groups_of_rank = self.split.rank_groups(self.rank, self.of)?;
        {
            let mut blocks = self.network.blocks.lock().unwrap();
            blocks.resize(len, f32::NAN);
            for sum in 0..sums {
                let block = (sum * groups + groups_of_rank.start) * d
                    ..(sum * groups + groups_of_rank.end) * d;
                blocks[block.clone()].copy_from_slice(&mine[block]);
            }
        }
        self.network.barrier.wait();
        mine.copy_from_slice(&self.network.blocks.lock().unwrap());
        self.network.barrier.wait();
        Ok(())
    }

    fn all_reduce(&mut self, sums: u64, count: usize) -> Result<()> {
        // SAFETY: as in `gather`: `count` f32 of the validated workspace.
        let mine = unsafe { std::slice::from_raw_parts_mut(sums as *mut f32, count) };
        self.network.vectors.lock().unwrap()[self.rank] = mine.to_vec();
        self.network.barrier.wait();
        let vectors = self.network.vectors.lock().unwrap().clone();
        for (j, out) in mine.iter_mut().enumerate() {
            *out = vectors.iter().map(|v| v[j]).fold(0.0, |a, b| a + b);
        }
        self.network.barrier.wait();
        Ok(())
    }
}

/// The op under test on `rows × d` of `x`/`dy`: dx and the parameter gradients (dγ, dβ or dbias,
/// concatenated), on one device (`across` = None) or as a rank.
#[derive(Clone, Copy, Debug)]
enum Op {
    Norm(Norm),
    Dbias(Activation),
}

impl Op {
    fn sums(self) -> usize {
        match self {
            Op::Norm(norm) => crate::norm::backward::sums(norm),
            Op::Dbias(_) => 1,
        }
    }

    fn of(self) -> GradientsOf {
        match self {
            Op::Norm(_) => GradientsOf::Norm,
            Op::Dbias(_) => GradientsOf::Activation,
        }
    }

    fn run(
        self,
        x: &[f32],
        dy: &[f32],
        (rows, d): (usize, usize),
        workspace: usize,
        across: Option<Across<'_>>,
    ) -> (Vec<f32>, Vec<f32>) {
        let emu = Emulator::new();
        let x = aligned(x.iter().copied(), rows * d);
        let dy = aligned(dy.iter().copied(), rows * d);
        let (x, dy) = (
            &x.as_flattened()[..rows * d],
            &dy.as_flattened()[..rows * d],
        );
        let weight = aligned(random(7, d).into_iter().map(|w| 1.0 + w / 4.0), d);
        let mut dx = aligned([], rows * d);
        let mut grads = aligned([], 2 * d);
        // Zero in the single launch's barrier words (as allocated), NaN past them.
        let mut ws = aligned([0.0; GROUP_SUMS_SYNC_WORDS], workspace);
        let (dx_s, grads_s, ws_s) = (
            &mut dx.as_flattened_mut()[..rows * d],
            &mut grads.as_flattened_mut()[..2 * d],
            &mut ws.as_flattened_mut()[..workspace],
        );
        let (dweight, dbias) = grads_s.split_at_mut(d);
        match self {
            Op::Norm(norm) => {
                let mut args = NormBackward::new(
                    Rows::new(dy, rows, d).unwrap(),
                    Rows::new(x, rows, d).unwrap(),
                    &weight.as_flattened()[..d],
                    Rows::new(dx_s, rows, d).unwrap(),
                    dweight,
                    ws_s,
                );
                if norm == Norm::Layer {
                    args = args.dbias(dbias);
                }
                crate::norm::backward::run_across(norm, &emu, args, across).unwrap();
            }
            Op::Dbias(activation) => {
                let args = activation::Backward::new(
                    activation,
                    Rows::new(dy, rows, d).unwrap(),
                    Rows::new(x, rows, d).unwrap(),
                    Rows::new(dx_s, rows, d).unwrap(),
                )
                .dbias(dweight, ws_s);
                activation::backward_across(&emu, args, across).unwrap();
            }
        }
        let sums = self.sums() * d;
        (
            dx.as_flattened()[..rows * d].to_vec(),
            grads.as_flattened()[..sums].to_vec(),
        )
    }

    /// Runs every rank of `split` on its own thread; each rank's (dx, gradients).
    fn ranks(
        self,
        x: &[f32],
        dy: &[f32],
        split: &BatchSplit,
        mode: Mode,
    ) -> Vec<(Vec<f32>, Vec<f32>)> {
        let world = split.world();
        let network = Arc::new(Network {
            blocks: Mutex::new(Vec::new()),
            vectors: Mutex::new(vec![Vec::new(); world]),
            barrier: Barrier::new(world),
        });
        let d = split.d();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let network = network.clone();
                    scope.spawn(move || {
                        let rows = split.rank_rows(rank).unwrap();
                        let workspace = split
                            .workspace_len(rank, mode, self.of(), self.sums())
                            .unwrap();
                        let mut meet = EmulatedMeet {
                            rank,
                            of: self.of(),
                            split: split.clone(),
                            network,
                        };
                        let across = Across {
                            partials: split.partials(rank, mode, self.of()).unwrap(),
                            meet: &mut meet,
                        };
                        let (x, dy) = (
                            &x[rows.start * d..rows.end * d],
                            &dy[rows.start * d..rows.end * d],
                        );
                        self.run(x, dy, (rows.len(), d), workspace, Some(across))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Exact mode on every rank, and fast mode within fp32 rounding, against the whole batch.
fn check(op: Op, split: &BatchSplit) {
    let (rows, d) = (split.rows(), split.d());
    let (x, dy) = (random(1, rows * d), random(2, rows * d));
    let own = Partials::Own(ParamGradients::Auto);
    let workspace = gradient_workspace_len(op.of(), own, rows, d, op.sums()).unwrap();
    let (whole_dx, whole) = op.run(&x, &dy, (rows, d), workspace, None);
    for (rank, (dx, grads)) in op
        .ranks(&x, &dy, split, Mode::Exact)
        .into_iter()
        .enumerate()
    {
        let own = split.rank_rows(rank).unwrap();
        assert_eq!(
            bits(&dx),
            bits(&whole_dx[own.start * d..own.end * d]),
            "{op:?} dx, rank {rank}"
        );
        assert_eq!(
            bits(&grads),
            bits(&whole),
            "{op:?} exact, rank {rank} of {split:?}"
        );
    }
    let fast = op.ranks(&x, &dy, split, Mode::Fast);
    for (rank, (_, grads)) in fast.iter().enumerate() {
        assert_eq!(
            bits(grads),
            bits(&fast[0].1),
            "{op:?} fast: every rank the same bits"
        );
        for (g, w) in grads.iter().zip(&whole) {
            assert!(
                (g - w).abs() <= 1e-5 * (rows as f32) * w.abs().max(1.0),
                "{op:?} fast, rank {rank}: {g} vs {w}"
            );
        }
    }
}

const OPS: [Op; 3] = [
    Op::Norm(Norm::Rms),
    Op::Norm(Norm::Layer),
    Op::Dbias(Activation::GeluErf),
];

#[test]
fn exact_mode_gives_the_whole_batchs_bits_on_every_rank() {
    // 4200 rows of 8: groups of 16 rows, 263 groups.
    let (rows, d) = (4200, 8);
    assert_eq!(group_layout(rows, d), (16, 263));
    // A small batch: 200 rows of 64 in groups of one row.
    assert_eq!(group_layout(200, 64), (1, 200));
    for op in OPS {
        check(op, &BatchSplit::even(rows, d, 2).unwrap());
        // Uneven, on group boundaries.
        check(op, &BatchSplit::with_rows(&[1600, 800, 1800], d).unwrap());
        check(op, &BatchSplit::with_rows(&[48, 97, 55], 64).unwrap());
    }
}

/// Rows of 2048 in dγ groups of 16: dbias's groups are four of dγ's (wide work items), and a
/// split on dbias's boundaries gives both their bits.
#[test]
fn exact_mode_keeps_dbias_wide_groups() {
    let (rows, d) = (4100, 2048);
    assert_eq!(group_layout(rows, d), (16, 257));
    assert_eq!(GradientsOf::Activation.group_layout(rows, d), (64, 65));
    let split = BatchSplit::with_rows(&[1024, 2048, 1028], d).unwrap();
    check(Op::Dbias(Activation::Silu), &split);
    check(Op::Norm(Norm::Rms), &split);
    // dγ's boundary that is not dbias's is no split.
    assert!(matches!(
        BatchSplit::with_rows(&[1040, 3060], d),
        Err(Error::Argument { .. })
    ));
}

#[test]
fn ranks_without_rows_take_part() {
    // 2 rows: 2 groups of one row over 4 ranks: ranks 0 and 2 hold none.
    let split = BatchSplit::even(2, 48, 4).unwrap();
    let shares: Vec<_> = (0..4).map(|r| split.rank_rows(r).unwrap()).collect();
    assert_eq!(shares, [0..0, 0..1, 1..1, 1..2]);
    for op in OPS {
        check(op, &split);
    }
}

#[test]
fn splits_keep_to_group_boundaries() {
    for (rows, d, world) in [
        (16384, 4096, 2),
        (16384, 4096, 3),
        (1024, 65536, 2),
        (7, 128, 3),
        (0, 8, 2),
    ] {
        let split = BatchSplit::even(rows, d, world).unwrap();
        // The split's groups are dbias's, whole numbers of dγ's.
        let (per_group, groups) = GradientsOf::Activation.group_layout(rows, d);
        let norm_per_group = group_layout(rows, d).0;
        assert_eq!(per_group % norm_per_group, 0);
        assert_eq!(
            (split.rows(), split.world(), split.rows_per_group()),
            (rows, world, per_group)
        );
        assert_eq!(BatchSplit::group_rows(rows, d), Ok(per_group));
        let mut next = 0;
        for rank in 0..world {
            let own = split.rank_rows(rank).unwrap();
            assert_eq!(own.start, next);
            assert!(own.start % per_group == 0 || own.is_empty());
            let g = split.rank_groups(rank, GradientsOf::Activation).unwrap();
            assert!(
                g.len().abs_diff(groups / world) <= 1,
                "{rows}×{d} / {world}: {g:?}"
            );
            let norm_groups = split.rank_groups(rank, GradientsOf::Norm).unwrap();
            assert_eq!(norm_groups.start * norm_per_group, own.start);
            next = own.end;
        }
        assert_eq!(next, rows);
        assert_eq!(
            BatchSplit::with_rows(
                &(0..world)
                    .map(|r| split.rank_rows(r).unwrap().len())
                    .collect::<Vec<_>>(),
                d
            ),
            Ok(split)
        );
    }
    assert!(matches!(
        BatchSplit::with_rows(&[8010, 8374], 4096),
        Err(Error::Argument { .. })
    ));
    // A boundary of dγ's groups of 64 rows but not of dbias's of 128.
    assert!(matches!(
        BatchSplit::with_rows(&[8128, 8256], 4096),
        Err(Error::Argument { .. })
    ));
    assert!(matches!(
        BatchSplit::even(10, 8, 0),
        Err(Error::Argument { .. })
    ));
    assert!(matches!(
        BatchSplit::even(10, 0, 2),
        Err(Error::EmptyRow { .. })
    ));
    assert!(BatchSplit::even(10, 8, 2).unwrap().rank_rows(2).is_err());
    assert!(matches!(
        BatchSplit::even(64, 16, 2).unwrap().check_shape(0, 33, 16),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn workspaces_hold_the_batchs_partials_in_exact_mode_and_the_ranks_own_in_fast_mode() {
    const SYNC: usize = GROUP_SUMS_SYNC_WORDS;
    let split = BatchSplit::even(16384, 4096, 2).unwrap();
    assert_eq!(
        split.rms_norm_workspace_len(1, Mode::Exact),
        Ok(SYNC + 256 * 4096)
    );
    assert_eq!(
        split.layer_norm_workspace_len(0, Mode::Exact),
        Ok(SYNC + 2 * 256 * 4096)
    );
    // Exact: dbias's 128 groups of 128 rows. Fast: 8192 rows of 4096, dbias in 128 groups of
    // 64 rows (dγ's: 256 of 32), and one row of fp32 sums per gradient.
    assert_eq!(
        split.activation_workspace_len(1, Mode::Exact),
        Ok(SYNC + 128 * 4096)
    );
    assert_eq!(
        split.activation_workspace_len(0, Mode::Fast),
        Ok(SYNC + 129 * 4096)
    );
    assert_eq!(
        split.layer_norm_workspace_len(1, Mode::Fast),
        Ok(SYNC + 2 * 257 * 4096)
    );
}
