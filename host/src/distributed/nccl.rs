//! The NCCL side of [`crate::distributed`]: a communicator per rank and the backward calls that
//! meet over it, on the caller's stream.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaViewMut, DevicePtrMut};
use cudarc::nccl::{Id, result, sys};

use super::{Across, BatchSplit, Meet, Mode};
use crate::activation::{self, Backward};
use crate::context::Gpu;
use crate::error::{Error, Result};
use crate::norm::NormBackward;
use crate::plan::GradientsOf;
use crate::tensor::Dtype;
use normkern_gpu::norm::Norm;

/// One rank's NCCL communicator, on the device of a [`crate::Context`]. Made by every rank with
/// the same [`Id`] ([`Communicator::unique_id`] on one rank, shared out of band: over a socket,
/// a file, an MPI broadcast; threads of one process pass it by value). Destroyed on drop.
#[derive(Debug)]
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    cuda: Arc<CudaContext>,
}

// SAFETY: NCCL lets any thread use a communicator as long as no two calls on it run at once.
// `Communicator` is not `Sync`, so only its owner's thread ever calls it.
unsafe impl Send for Communicator {}

impl Communicator {
    /// A new unique id for a group of ranks.
    pub fn unique_id() -> Result<Id> {
        nccl_loadable()?;
        Id::new().map_err(Error::nccl("ncclGetUniqueId"))
    }

    /// Joins the group `id` names as rank `rank` of `world`, on `ctx`'s device. Blocks until
    /// all `world` ranks have joined: call it from one thread (or process) per rank.
    pub fn from_rank(ctx: &crate::Context, rank: usize, world: usize, id: &Id) -> Result<Self> {
        nccl_loadable()?;
        if world == 0 || world > i32::MAX as usize || rank >= world {
            return Err(Error::Argument {
                what: "rank",
                problem: "needs rank < world ≤ 2³¹ − 1",
            });
        }
        let cuda = ctx.cuda().clone();
        cuda.bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        let id = sys::ncclUniqueId {
            internal: *id.internal(),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` receives the new communicator; world and rank were checked to fit i32.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
            .map_err(Error::nccl("ncclCommInitRank"))?;
        Ok(Communicator {
            // SAFETY: ncclCommInitRank succeeded, so it wrote the communicator.
            comm: unsafe { comm.assume_init() },
            rank,
            world,
            cuda,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Sums `buffer` over the ranks, in place, on `gpu`'s stream (a convenience for the other
    /// gradients of a data-parallel step; NCCL's own algorithm order).
    pub fn all_reduce_sum(&self, gpu: &Gpu<'_>, buffer: &mut CudaViewMut<'_, f32>) -> Result<()> {
        self.check_gpu(gpu)?;
        let count = buffer.len();
        let (address, _guard) = buffer.device_ptr_mut(gpu.stream());
        self.all_reduce_f32(gpu, address, count)
    }

    fn check_gpu(&self, gpu: &Gpu<'_>) -> Result<()> {
        if gpu.context().cuda().cu_ctx() != self.cuda.cu_ctx() {
            return Err(Error::WrongContext {
                what: "the communicator",
            });
        }
        Ok(())
    }

    fn all_reduce_f32(&self, gpu: &Gpu<'_>, address: u64, count: usize) -> Result<()> {
        let at = address as *mut std::ffi::c_void;
        // SAFETY: `count` f32 at `address` on this communicator's device, ordered on the stream.
        unsafe {
            result::all_reduce(
                at,
                at,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                gpu.stream().cu_stream() as _,
            )
        }
        .map_err(Error::nccl("ncclAllReduce"))?;
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is this value's own and used no more. An error here has no
        // one to go to.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

/// libnccl must be loadable before cudarc's first NCCL call (which would panic without it).
fn nccl_loadable() -> Result<()> {
    #[cfg(not(feature = "dynamic-linking"))]
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoNccl);
    }
    Ok(())
}

/// A rank of a data- (or sequence-) parallel backward: its communicator, the batch's split and
/// how the gradients are summed.
#[derive(Clone, Copy, Debug)]
pub struct DataParallel<'a> {
    /// This rank's communicator: its rank is the split's rank.
    pub comm: &'a Communicator,
    /// The batch's rows over the ranks.
    pub split: &'a BatchSplit,
    /// Exact (the bits of one GPU) or fast (one all-reduce).
    pub mode: Mode,
}

/// The NCCL calls of one backward on one stream.
struct NcclMeet<'a, 'g> {
    dp: DataParallel<'a>,
    /// Whose partial rows meet: their layout decides each rank's block.
    of: GradientsOf,
    gpu: &'a Gpu<'g>,
}

impl Meet for NcclMeet<'_, '_> {
    fn gather(&mut self, partials: u64, groups: usize, sums: usize) -> Result<()> {
        let d = self.dp.split.d;
        if groups != self.dp.split.layout_of(self.of).1 {
            return Err(Error::Internal("gathered groups differ from the split's"));
        }
        let stream = self.gpu.stream().cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(Error::nccl("ncclGroupStart"))?;
        let mut broadcasts = Ok(());
        // Each rank broadcasts its block of each sum's partial rows, in place: one grouped
        // all-gather of uneven blocks.
        'ranks: for root in 0..self.dp.comm.world {
            let mine = self.dp.split.rank_groups(root, self.of)?;
            if mine.is_empty() {
                continue;
            }
            for sum in 0..sums {
                let row = (sum * groups + mine.start) * d;
                let at = (partials + 4 * row as u64) as *mut std::ffi::c_void;
                let count = mine.len() * d;
                // SAFETY: the block lies in the workspace the backward validated ([sums × groups,
                // d] f32 on this device); root < world fits i32.
                broadcasts = unsafe {
                    result::broadcast(
                        at,
                        at,
                        count,
                        sys::ncclDataType_t::ncclFloat32,
                        root as i32,
                        self.dp.comm.comm,
                        stream,
                    )
                }
                .map(|_| ())
                .map_err(Error::nccl("ncclBroadcast"));
                if broadcasts.is_err() {
                    break 'ranks;
                }
            }
        }
        // The group is closed whatever happened inside it.
        let end = result::group_end().map_err(Error::nccl("ncclGroupEnd"));
        broadcasts.and(end.map(|_| ()))
    }

    fn all_reduce(&mut self, sums: u64, count: usize) -> Result<()> {
        self.dp.comm.all_reduce_f32(self.gpu, sums, count)
    }
}

impl DataParallel<'_> {
    /// Checks the ranks against the call: the communicator's device is the stream's, its group
    /// is the split's, and the call's rows are this rank's share.
    fn check(&self, gpu: &Gpu<'_>, rows: usize, d: usize) -> Result<()> {
        self.comm.check_gpu(gpu)?;
        if self.comm.world != self.split.world() {
            return Err(Error::Argument {
                what: "batch split",
                problem: "its world size is not the communicator's",
            });
        }
        self.split.check_shape(self.comm.rank, rows, d)
    }

    /// Runs `backward` (of `of`'s gradients) as this rank, its partials and meetings as the mode
    /// says.
    fn run(
        self,
        gpu: &Gpu<'_>,
        (rows, d): (usize, usize),
        of: GradientsOf,
        backward: impl FnOnce(Across<'_>) -> Result<()>,
    ) -> Result<()> {
        self.check(gpu, rows, d)?;
        let partials = self.split.partials(self.comm.rank, self.mode, of)?;
        let mut meet = NcclMeet { dp: self, of, gpu };
        backward(Across {
            partials,
            meet: &mut meet,
        })
    }
}

/// RMSNorm backward as one rank of `dp`: dx of this rank's rows, and dγ of the whole batch on
/// every rank (in [`Mode::Exact`], the bits of [`crate::rms_norm::backward`] over the whole
/// batch on one GPU). The workspace is [`BatchSplit::rms_norm_workspace_len`] long. Enqueued on
/// `gpu`'s stream with the NCCL calls between the launches: graph-capturable, no allocation.
pub fn rms_norm_backward<'s, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
    gpu: &Gpu<'s>,
    dp: DataParallel<'_>,
    args: NormBackward<'_, Gpu<'s>, T, H, W, G>,
) -> Result<()> {
    norm_backward(Norm::Rms, gpu, dp, args)
}

/// LayerNorm backward as one rank of `dp`: as [`rms_norm_backward`], with dβ next to dγ; the
/// workspace is [`BatchSplit::layer_norm_workspace_len`] long.
pub fn layer_norm_backward<'s, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
    gpu: &Gpu<'s>,
    dp: DataParallel<'_>,
    args: NormBackward<'_, Gpu<'s>, T, H, W, G>,
) -> Result<()> {
    norm_backward(Norm::Layer, gpu, dp, args)
}

fn norm_backward<'s, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
    norm: Norm,
    gpu: &Gpu<'s>,
    dp: DataParallel<'_>,
    args: NormBackward<'_, Gpu<'s>, T, H, W, G>,
) -> Result<()> {
    let shape = (args.x.rows(), args.x.d());
    dp.run(gpu, shape, GradientsOf::Norm, |across| {
        crate::norm::backward::run_across(norm, gpu, args, Some(across))
    })
}

/// Activation backward with dbias as one rank of `dp`: dx of this rank's rows, dbias of the
/// whole batch; the workspace (given with [`Backward::dbias`]) is
/// [`BatchSplit::activation_workspace_len`] long.
pub fn activation_backward<'s, T: Dtype>(
    gpu: &Gpu<'s>,
    dp: DataParallel<'_>,
    args: Backward<'_, Gpu<'s>, T>,
) -> Result<()> {
    if args.dbias.is_none() {
        return Err(Error::Argument {
            what: "dbias",
            problem: "a backward across ranks sums dbias: give it (activation::backward has none to sum)",
        });
    }
    let shape = (args.preact.rows(), args.preact.d());
    dp.run(gpu, shape, GradientsOf::Activation, |across| {
        activation::backward_across(gpu, args, Some(across))
    })
}
