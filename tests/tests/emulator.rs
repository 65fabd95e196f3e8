//! The CPU emulator reports kernel misuse instead of hanging or corrupting memory: a barrier not
//! every thread reaches, a shuffle with missing lanes, shared memory out of bounds, a panic; and
//! its clusters behave as sm_90's do, and a cooperative launch's blocks meet at grid barriers.

use normkern_gpu::arch::{self, emu};
use normkern_gpu::column_sum::{self, COLUMN_SUM_THREADS, COLUMN_SUM_VECTOR, ColumnSumParams};
use normkern_gpu::kernel::Dtype;
use normkern_gpu::reduce;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::SeqCst;

fn expect_error(result: Result<(), emu::EmuError>, kernel: &str, needle: &str) {
    let err = result.expect_err("the misuse went unnoticed");
    assert_eq!(err.kernel, kernel);
    let text = err.to_string();
    assert!(
        text.contains(kernel) && text.contains(needle),
        "unexpected report: {text}"
    );
    eprintln!("reported: {text}");
}

#[test]
fn barrier_in_divergent_code_is_reported() {
    let r = emu::launch("half_barrier", (1, 64, 1), 0, false, &|| {
        if arch::thread_idx() < 32 {
            arch::sync_threads();
        }
    });
    expect_error(
        r,
        "half_barrier",
        "block barrier not reached by all 64 threads",
    );
}

#[test]
fn shuffle_with_missing_lanes_is_reported() {
    let r = emu::launch("half_warp_shuffle", (1, 32, 1), 0, false, &|| {
        if arch::thread_idx() < 16 {
            reduce::warp_sum(1.0);
        }
    });
    expect_error(r, "half_warp_shuffle", "warp shuffle not reached");
}

#[test]
fn shuffle_in_a_partial_warp_is_reported() {
    // 48 threads: the second warp has 16 lanes, a full-mask shuffle there is undefined on a GPU.
    let r = emu::launch("partial_warp", (1, 48, 1), 0, false, &|| {
        reduce::warp_sum(1.0);
    });
    expect_error(r, "partial_warp", "warp shuffle not reached");
}

#[test]
fn shared_memory_out_of_bounds_is_reported() {
    let r = emu::launch("shared_overflow", (2, 32, 1), 64, false, &|| unsafe {
        arch::shared_f32().store(16 + arch::thread_idx(), 1.0);
    });
    expect_error(r, "shared_overflow", "beyond the launch's 16 words");
}

/// An asynchronous copy lands in shared memory when its thread waits, not before: a body that
/// reads the words early sees what was there (as it may on the GPU), and only its own copies land.
#[test]
fn asynchronous_copies_land_when_their_thread_waits() {
    /// 16 bytes, aligned as a copy's source must be.
    #[repr(C, align(16))]
    struct Quad([f32; 4]);
    let source: Vec<Quad> = (0..32).map(|t| Quad([t as f32, 1.0, 2.0, 3.0])).collect();
    let before = AtomicU32::new(0);
    let after = AtomicU32::new(0);
    emu::launch("async_copy", (1, 32, 1), 32 * 16, false, &|| unsafe {
        let (t, shared) = (arch::thread_idx(), arch::shared_f32());
        shared.store4(4 * t, [-1.0; 4]);
        shared.copy16_async_from(4 * t, source[t].0.as_ptr() as u64);
        if shared.load4(4 * t) == [-1.0; 4] {
            before.fetch_add(1, SeqCst);
        }
        arch::wait_async_copies();
        if shared.load4(4 * t) == source[t].0 {
            after.fetch_add(1, SeqCst);
        }
    })
    .unwrap();
    assert_eq!(
        before.load(SeqCst),
        32,
        "a copy landed before its thread waited"
    );
    assert_eq!(after.load(SeqCst), 32, "a copy did not land at the wait");
}

/// An mbarrier made by one thread is another's only after a barrier: the staged block tile
/// once waited on its ring's before that, which only racecheck on the GPU caught.
#[test]
fn an_mbarrier_used_before_a_barrier_published_it_is_reported() {
    let wait_for_thread_0 = |publish: bool| unsafe {
        let shared = arch::shared_f32();
        if arch::thread_idx() == 0 {
            shared.mbarrier_init(0, 1);
        }
        if publish {
            arch::sync_threads();
        }
        if arch::thread_idx() == 0 {
            shared.mbarrier_arrive_expect_tx(0, 0);
        }
        shared.mbarrier_wait(0, 0);
    };
    let r = emu::launch("unpublished", (1, 64, 1), 64, false, &|| {
        wait_for_thread_0(false)
    });
    expect_error(
        r,
        "unpublished",
        "before a block or cluster barrier published it",
    );
    emu::launch("published", (1, 64, 1), 64, false, &|| {
        wait_for_thread_0(true)
    })
    .unwrap();
}

#[test]
fn a_panicking_thread_fails_the_launch_with_its_message() {
    let r = emu::launch("panics", (1, 64, 1), 0, false, &|| {
        let v = [0u8; 4];
        let i = arch::thread_idx();
        std::hint::black_box(v[i]);
    });
    expect_error(r, "panics", "index out of bounds");
}

#[test]
fn correct_block_reduction_runs_and_sums_in_order() {
    let sums = std::sync::Mutex::new(Vec::new());
    emu::launch(
        "block_sum",
        (3, 96, 1),
        reduce::ROW_REDUCER_SHARED_WORDS * 4,
        false,
        &|| {
            let mut reducer = unsafe { reduce::RowReducer::new(reduce::Team::new(false, 0)) };
            // Two successive reductions reuse the alternating slots.
            let a = unsafe { reducer.sum(arch::thread_idx() as f32) };
            let [b, c] = unsafe { reducer.sums([1.0, arch::block_idx() as f32]) };
            if arch::thread_idx() == 0 {
                sums.lock().unwrap().push((arch::block_idx(), a, b, c));
            }
        },
    )
    .unwrap();
    let mut sums = sums.into_inner().unwrap();
    sums.sort_by_key(|s| s.0);
    assert_eq!(
        sums,
        vec![
            (0, 4560.0, 96.0, 0.0),
            (1, 4560.0, 96.0, 96.0),
            (2, 4560.0, 96.0, 192.0)
        ]
    );
}

#[test]
fn segment_teams_sum_their_own_lanes_and_may_diverge() {
    // 2 blocks of 64 threads in teams of 8 lanes (16 teams): team t makes t % 3 + 1 reductions
    // of its lanes' indices, so the teams of one warp leave the loop at different times.
    let sums = std::sync::Mutex::new(Vec::new());
    emu::launch("segment_sum", (2, 64, 1), 0, false, &|| {
        let team = reduce::Team::new(false, 8);
        assert_eq!((team.threads, team.stride), (8, 16));
        let mut reducer = unsafe { reduce::RowReducer::new(team) };
        for call in 0..team.first % 3 + 1 {
            let [a, b] = unsafe { reducer.sums([team.tid as f32, call as f32]) };
            if team.tid == 0 {
                sums.lock().unwrap().push((team.first, call, a, b));
            }
        }
    })
    .unwrap();
    let mut sums = sums.into_inner().unwrap();
    sums.sort_by_key(|s| (s.0, s.1));
    let expected: Vec<_> = (0..16)
        .flat_map(|t| (0..t % 3 + 1).map(move |c| (t, c, 28.0, 8.0 * c as f32)))
        .collect();
    assert_eq!(sums, expected);
}

#[test]
fn cluster_reduction_gives_every_block_the_same_sums() {
    // 4 clusters of 3 blocks of 64 threads: each cluster sums over its 192 threads, in rank order.
    let sums = std::sync::Mutex::new(Vec::new());
    emu::launch(
        "cluster_sum",
        (12, 64, 3),
        reduce::ROW_REDUCER_SHARED_WORDS * 4,
        false,
        &|| {
            let mut reducer = unsafe { reduce::RowReducer::new(reduce::Team::new(true, 0)) };
            let rank = arch::cluster_rank();
            let tid = rank * arch::block_dim() + arch::thread_idx();
            // Three calls: the published words alternate between two slots, like the block's.
            let a = unsafe { reducer.sum(tid as f32) };
            let [b, c] = unsafe { reducer.sums([1.0, arch::cluster_idx() as f32]) };
            let e = unsafe { reducer.sum(rank as f32) };
            if arch::thread_idx() == 0 {
                let ids = (
                    arch::cluster_idx(),
                    arch::cluster_count(),
                    arch::block_idx(),
                );
                sums.lock()
                    .unwrap()
                    .push((ids, arch::cluster_size(), a, b, c, e));
            }
        },
    )
    .unwrap();
    let mut sums = sums.into_inner().unwrap();
    sums.sort_by_key(|s| s.0.2);
    let expected: Vec<_> = (0..12)
        .map(|block| {
            let cluster = block / 3;
            let ids = (cluster, 4, block);
            (ids, 3, 18336.0, 192.0, 192.0 * cluster as f32, 192.0)
        })
        .collect();
    assert_eq!(sums, expected);
}

#[test]
fn overlapped_cluster_reductions_come_back_in_order() {
    // 2 clusters of 4 blocks of 32 threads; each starts the next call before finishing the last
    // (the most lead the reducer allows), for many more calls than there are mailbox slots (so
    // every slot and its mbarrier are reused, at both phase parities), with 1 or 2 values per call.
    assert_eq!(reduce::MAX_LEAD, 1);
    let calls = 21;
    let results = std::sync::Mutex::new(Vec::new());
    emu::launch(
        "overlapped_sums",
        (8, 32, 4),
        reduce::ROW_REDUCER_SHARED_WORDS * 4,
        false,
        &|| {
            let mut reducer = unsafe { reduce::RowReducer::new(reduce::Team::new(true, 0)) };
            let tid = arch::cluster_rank() * arch::block_dim() + arch::thread_idx();
            let value = |call: usize| (tid * (call + 1)) as f32;
            // Even calls reduce one value, odd calls two (the second is 1 per thread).
            let start = |reducer: &mut reduce::RowReducer, call: usize| unsafe {
                if call.is_multiple_of(2) {
                    reducer.start([value(call)])
                } else {
                    reducer.start([value(call), 1.0])
                }
            };
            let finish = |reducer: &mut reduce::RowReducer, call: usize, pending| unsafe {
                if call.is_multiple_of(2) {
                    reducer.finish::<1>(pending)[0]
                } else {
                    let [a, b] = reducer.finish::<2>(pending);
                    assert_eq!(b, 128.0);
                    a
                }
            };
            let mut pending = start(&mut reducer, 0);
            let mut sums = Vec::new();
            for call in 1..calls {
                let next = start(&mut reducer, call);
                sums.push(finish(&mut reducer, call - 1, pending));
                pending = next;
            }
            sums.push(finish(&mut reducer, calls - 1, pending));
            if arch::thread_idx() == 0 {
                results.lock().unwrap().push(sums);
            }
        },
    )
    .unwrap();
    let results = results.into_inner().unwrap();
    assert_eq!(results.len(), 8);
    // Σ_{tid < 128} tid · (call + 1) = 8128 · (call + 1).
    let expected: Vec<f32> = (0..calls).map(|c| 8128.0 * (c + 1) as f32).collect();
    for sums in results {
        assert_eq!(sums, expected);
    }
}

#[test]
fn cluster_barrier_in_divergent_code_is_reported() {
    let r = emu::launch("half_cluster", (4, 32, 2), 0, false, &|| {
        if arch::cluster_rank() == 0 {
            arch::sync_cluster();
        }
    });
    expect_error(
        r,
        "half_cluster",
        "cluster barrier not reached by all 64 threads",
    );
}

#[test]
fn a_grid_that_is_not_whole_clusters_is_refused() {
    let r = emu::launch("ragged", (5, 32, 2), 0, false, &|| {});
    expect_error(r, "ragged", "invalid launch shape");
}

#[test]
fn column_sums_by_one_or_four_columns_or_chained_give_the_same_bits() {
    // 37 groups (five slices get three, the rest two), 1000 columns: slabs of 32, of 128 and of
    // 8, the last of each partial; a grid of 3 blocks walks them, for two sums in one launch (dγ,
    // dβ). 600 groups take two rounds of loads per slice (one chained wave, two parts idle), 4700
    // three waves of four rounds, the last wave ending inside a round; 1 group is one load.
    for (groups, d) in [(37, 1000), (600, 20), (4700, 12), (1, 9)] {
        let mut rng = normkern_tests::Rng::fresh("column_sums");
        let mut partials = || -> Vec<f32> {
            (0..groups * d)
                .map(|_| rng.uniform(-4.0, 4.0) as f32)
                .collect()
        };
        let inputs = [partials(), partials()];
        let kernel = column_sum::KERNELS.find(&Dtype::F32).unwrap();
        let sum = |columns: usize, chained: bool| {
            let outs = [vec![f32::NAN; d], vec![f32::NAN; d]];
            let p = ColumnSumParams {
                partials: inputs[0].as_ptr() as u64,
                out: outs[0].as_ptr() as u64,
                partials2: inputs[1].as_ptr() as u64,
                out2: outs[1].as_ptr() as u64,
                groups: groups as u32,
                d: d as u32,
                columns: columns as u32,
                chained: chained as u32,
            };
            // Exactly the words this width uses, so a store past them is reported; the host
            // launches with the table's size, which must cover the widest.
            let shared_bytes = COLUMN_SUM_THREADS * 4 * columns;
            assert!(shared_bytes <= (kernel.shared_bytes)(COLUMN_SUM_THREADS));
            let body = kernel.body;
            emu::launch(
                kernel.name,
                (3, COLUMN_SUM_THREADS, 1),
                shared_bytes,
                false,
                &|| unsafe { body(&p) },
            )
            .unwrap();
            outs
        };
        let (one, chained) = (sum(1, false), sum(1, true));
        let four = (d % COLUMN_SUM_VECTOR == 0).then(|| sum(COLUMN_SUM_VECTOR, false));
        for (i, partials) in inputs.iter().enumerate() {
            for j in 0..d {
                let exact: f64 = (0..groups).map(|g| partials[g * d + j] as f64).sum();
                let got = one[i][j];
                assert!(
                    (got as f64 - exact).abs() < 1e-3,
                    "{groups} groups, sum {i} column {j}: {got} vs {exact}"
                );
                let bits = got.to_bits();
                assert_eq!(
                    bits,
                    chained[i][j].to_bits(),
                    "{groups} groups, sum {i} column {j}"
                );
                if let Some(four) = &four {
                    assert_eq!(
                        bits,
                        four[i][j].to_bits(),
                        "{groups} groups, sum {i} column {j}"
                    );
                }
            }
        }
    }
}

/// Every block of a cooperative launch writes its word, meets the others at a grid barrier, and
/// reads all words; twice, so the barrier's words are reused. The counter is left zero.
#[test]
fn cooperative_blocks_meet_at_grid_barriers() {
    let blocks = 7;
    let sync = [AtomicU32::new(0), AtomicU32::new(0)];
    let words: Vec<AtomicU32> = (0..blocks).map(|_| AtomicU32::new(0)).collect();
    let seen: Vec<AtomicU32> = (0..blocks).map(|_| AtomicU32::new(0)).collect();
    emu::launch("grid_barrier", (blocks, 64, 1), 0, true, &|| {
        let b = arch::block_idx();
        for round in 1..=2u32 {
            if arch::thread_idx() == 0 {
                words[b].store(round * 100 + b as u32, SeqCst);
            }
            unsafe { arch::grid_barrier(sync.as_ptr() as u64) };
            if arch::thread_idx() == 0 {
                let all = (0..blocks).all(|o| words[o].load(SeqCst) == round * 100 + o as u32);
                seen[b].fetch_add(all as u32, SeqCst);
            }
            unsafe { arch::grid_barrier(sync.as_ptr() as u64) };
        }
    })
    .unwrap();
    assert!(seen.iter().all(|s| s.load(SeqCst) == 2));
    // Arrivals back at zero; four barriers advanced the generation four times.
    assert_eq!(sync.map(|w| w.into_inner()), [0, 4]);
}

/// A grid barrier in a launch that is not cooperative (blocks run one after another) is
/// reported, not hung; so is a barrier whose counter was not zero.
#[test]
fn grid_barriers_outside_cooperative_launches_or_on_dirty_words_are_reported() {
    let sync = [AtomicU32::new(0), AtomicU32::new(0)];
    let r = emu::launch("not_cooperative", (2, 32, 1), 0, false, &|| unsafe {
        arch::grid_barrier(sync.as_ptr() as u64)
    });
    expect_error(
        r,
        "not_cooperative",
        "grid barrier that not all 2 blocks reach",
    );
    let dirty = [AtomicU32::new(0x7fc0_0000), AtomicU32::new(0)];
    let r = emu::launch("dirty_barrier", (2, 32, 1), 0, true, &|| unsafe {
        arch::grid_barrier(dirty.as_ptr() as u64)
    });
    expect_error(r, "dirty_barrier", "its words were not zero");
}
