//! Data- and sequence-parallel parameter gradients: dγ, dβ and dbias summed over ranks that each
//! hold some rows of one batch.
//!
//! Every backward sums its parameter gradients in two steps: each group of consecutive rows
//! writes one fp32 partial row, then a column sum adds the partial rows in a fixed order. The
//! groups are a function of the op and the batch's shape alone ([`crate::group_layout`] for dγ
//! and dβ; dbias's groups of wide rows are several of those). So a batch split over ranks *on
//! group boundaries of every op* ([`BatchSplit::rows_per_group`]) can be reduced two ways:
//!
//! - [`Mode::Exact`]: each rank writes the partial rows of its own groups at their place among
//!   the whole batch's, the ranks gather them (one NCCL broadcast per rank's block, grouped), and
//!   every rank runs the column sum over all of them: **the bits of one GPU over the whole
//!   batch**, on every rank, for any number of ranks. It moves `groups × d` f32 per gradient
//!   (the whole batch's partial rows) to every rank.
//! - [`Mode::Fast`]: each rank sums its own rows' gradient in fp32 and the ranks add those with
//!   one NCCL all-reduce: `d` f32 per gradient, but the bits depend on the number of ranks and
//!   on NCCL's algorithm choice (reproducible for a fixed world size and NCCL configuration
//!   only).
//!
//! [`BatchSplit`] is the split: which rows of the batch each rank holds. A rank's rows must be
//! the batch's rows `split.rank_rows(rank)`, in order; [`BatchSplit::even`] gives every rank a
//! run of whole groups, [`BatchSplit::with_rows`] checks a split of the caller's. One split
//! serves every backward of the batch. Only the parameter gradients meet; dx stays each rank's
//! own.
//!
//! The GPU side (a `Communicator` and the backward calls on it) needs the `nccl` feature;
//! the split is plain arithmetic, always there.

// Arithmetic on validated sizes: rows and d below 2³², world below 2³¹, at most 8192 groups, so
// sums × groups × d < 2⁴⁶ and no start or count overflows.
#![allow(clippy::arithmetic_side_effects)]

use std::ops::Range;

use crate::error::{Error, Result};
use crate::executor::{Executor, Launch};
use crate::plan::{GradientPlan, GradientsOf, Partials, gradient_workspace_len};

#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
pub use cudarc::nccl::Id;
#[cfg(feature = "nccl")]
pub use nccl::{
    Communicator, DataParallel, activation_backward, layer_norm_backward, rms_norm_backward,
};

/// How the ranks' parameter gradients are summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Gather every rank's group partials, then the fixed-order column sum on every rank: the
    /// bits of one GPU over the whole batch, on any number of ranks.
    Exact,
    /// Local fp32 sums, then one NCCL all-reduce: fewer bytes moved; the bits depend on the
    /// world size and NCCL's configuration.
    Fast,
}

/// Which rows of one batch (`rows × d`) each rank holds: rank `r` the consecutive rows
/// [`BatchSplit::rank_rows`]`(r)`, ranks in order. Every rank but the last holds a multiple of
/// [`BatchSplit::rows_per_group`] rows, so each rank's rows begin on a group boundary of every
/// backward's layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchSplit {
    d: usize,
    rows_per_group: usize,
    /// Row `starts[r]` is rank r's first; `starts[world]` = rows.
    starts: Vec<usize>,
}

impl BatchSplit {
    /// `rows × d` over `world` ranks, as evenly as whole groups allow (ranks differ by at most
    /// one group; with fewer groups than ranks, some ranks hold no rows).
    ///
    /// ```
    /// use normkern::distributed::BatchSplit;
    /// let split = BatchSplit::even(16384, 4096, 3)?;
    /// // 128 groups of 128 rows (dbias's; dγ's are 512 of 32): 42, 43 and 43 groups.
    /// assert_eq!(split.rows_per_group(), 128);
    /// assert_eq!((split.rank_rows(0)?, split.rank_rows(2)?), (0..5376, 10880..16384));
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn even(rows: usize, d: usize, world: usize) -> Result<Self> {
        let rows_per_group = Self::checked_group_rows(rows, d, world)?;
        let groups = rows.div_ceil(rows_per_group);
        // Rank r begins at group ⌊r·groups/world⌋ (world < 2³¹, groups ≤ 8192: no overflow).
        let starts = (0..=world)
            .map(|r| {
                let group = r * groups / world;
                (group * rows_per_group).min(rows)
            })
            .collect();
        Ok(BatchSplit {
            d,
            rows_per_group,
            starts,
        })
    }

    /// The split that gives rank r `rank_rows[r]` rows, checked: every rank's first row must
    /// begin a group of the batch's layouts (every count but the last a multiple of
    /// [`Self::group_rows`]`(total, d)`).
    ///
    /// ```
    /// use normkern::distributed::BatchSplit;
    /// // 16384 rows of 4096 form groups of 128 rows: 6144 + 10240 splits, 8160 + 8224 does not.
    /// assert_eq!(BatchSplit::group_rows(16384, 4096)?, 128);
    /// assert!(BatchSplit::with_rows(&[6144, 10240], 4096).is_ok());
    /// assert!(BatchSplit::with_rows(&[8160, 8224], 4096).is_err());
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn with_rows(rank_rows: &[usize], d: usize) -> Result<Self> {
        let rows = rank_rows
            .iter()
            .try_fold(0usize, |sum, &r| sum.checked_add(r))
            .ok_or(Error::TooLarge {
                what: "rows of the batch",
                value: usize::MAX,
            })?;
        let rows_per_group = Self::checked_group_rows(rows, d, rank_rows.len())?;
        let mut starts = Vec::with_capacity(rank_rows.len() + 1);
        let mut start = 0usize;
        for (rank, &r) in rank_rows.iter().enumerate() {
            starts.push(start);
            start = start.saturating_add(r);
            if rank + 1 < rank_rows.len() && start % rows_per_group != 0 {
                return Err(Error::Argument {
                    what: "batch split",
                    problem: "a rank's rows must begin on a group boundary of the batch's layouts: \
                              every rank but the last must hold a multiple of \
                              BatchSplit::group_rows(rows, d) rows",
                });
            }
        }
        starts.push(start);
        Ok(BatchSplit {
            d,
            rows_per_group,
            starts,
        })
    }

    /// The rows every rank's share but the last must be a multiple of, for a batch of `rows × d`:
    /// the longest group of the backwards' layouts (dbias's, which is a whole number of dγ's).
    pub fn group_rows(rows: usize, d: usize) -> Result<usize> {
        Self::checked_group_rows(rows, d, 1)
    }

    fn checked_group_rows(rows: usize, d: usize, world: usize) -> Result<usize> {
        if world == 0 || world > i32::MAX as usize {
            return Err(Error::Argument {
                what: "batch split",
                problem: "needs from 1 to 2³¹ − 1 ranks (NCCL's ranks are i32)",
            });
        }
        if d == 0 {
            return Err(Error::EmptyRow {
                what: "batch split",
            });
        }
        for (what, value) in [("rows", rows), ("d", d)] {
            if value > u32::MAX as usize {
                return Err(Error::TooLarge { what, value });
            }
        }
        // Every boundary of dbias's layout is one of dγ's (`GradientsOf::group_layout`).
        Ok(GradientsOf::Activation.group_layout(rows, d).0)
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Rows of the whole batch.
    pub fn rows(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Elements per row.
    pub fn d(&self) -> usize {
        self.d
    }

    /// Rows per group of the split ([`Self::group_rows`]): every rank's rows begin at a multiple
    /// of it, a group boundary of every backward's layout.
    pub fn rows_per_group(&self) -> usize {
        self.rows_per_group
    }

    /// The batch's rows rank `rank` holds.
    pub fn rank_rows(&self, rank: usize) -> Result<Range<usize>> {
        match (
            self.starts.get(rank),
            self.starts.get(rank.saturating_add(1)),
        ) {
            (Some(&start), Some(&end)) => Ok(start..end),
            _ => Err(Error::Argument {
                what: "rank",
                problem: "not below the split's world size",
            }),
        }
    }

    /// `(rows_per_group, groups)` of `of`'s layout over the whole batch.
    pub(crate) fn layout_of(&self, of: GradientsOf) -> (usize, usize) {
        of.group_layout(self.rows(), self.d)
    }

    /// The batch's groups of `of`'s layout rank `rank` computes the partial rows of.
    pub(crate) fn rank_groups(&self, rank: usize, of: GradientsOf) -> Result<Range<usize>> {
        let rows = self.rank_rows(rank)?;
        let (rows_per_group, _) = self.layout_of(of);
        // Starts are multiples of every layout's rows per group (≥ 1), the last rank ends at the
        // batch's end.
        let first = rows.start / rows_per_group;
        if rows.is_empty() {
            return Ok(first..first);
        }
        Ok(first..rows.end.div_ceil(rows_per_group))
    }

    /// f32 elements of workspace rank `rank` passes to a backward of `of` in `mode` with `sums`
    /// parameter gradients (1: dγ or dbias; 2: dγ and dβ).
    fn workspace_len(
        &self,
        rank: usize,
        mode: Mode,
        of: GradientsOf,
        sums: usize,
    ) -> Result<usize> {
        let rows = self.rank_rows(rank)?.len();
        gradient_workspace_len(of, self.partials(rank, mode, of)?, rows, self.d, sums)
    }

    /// Workspace (f32 elements) of rank `rank`'s RMSNorm backward in `mode`.
    pub fn rms_norm_workspace_len(&self, rank: usize, mode: Mode) -> Result<usize> {
        self.workspace_len(rank, mode, GradientsOf::Norm, 1)
    }

    /// Workspace (f32 elements) of rank `rank`'s LayerNorm backward in `mode` (dγ and dβ).
    pub fn layer_norm_workspace_len(&self, rank: usize, mode: Mode) -> Result<usize> {
        self.workspace_len(rank, mode, GradientsOf::Norm, 2)
    }

    /// Workspace (f32 elements) of rank `rank`'s activation backward with dbias in `mode`.
    pub fn activation_workspace_len(&self, rank: usize, mode: Mode) -> Result<usize> {
        self.workspace_len(rank, mode, GradientsOf::Activation, 1)
    }

    /// Where rank `rank`'s partials of `of` go in `mode`.
    pub(crate) fn partials(&self, rank: usize, mode: Mode, of: GradientsOf) -> Result<Partials> {
        Ok(match mode {
            Mode::Exact => {
                let (rows_per_group, groups) = self.layout_of(of);
                Partials::Shard {
                    rows_per_group,
                    first_group: self.rank_groups(rank, of)?.start,
                    groups,
                }
            }
            Mode::Fast => Partials::OwnSummedAcross,
        })
    }

    /// Checks that a backward's rows are rank `rank`'s share of this split.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn check_shape(&self, rank: usize, rows: usize, d: usize) -> Result<()> {
        let expected = self.rank_rows(rank)?.len();
        if (rows, d) != (expected, self.d) {
            return Err(Error::Shape {
                what: "this rank's rows (the batch split)",
                rows: expected,
                d: self.d,
                actual_rows: rows,
                actual_d: d,
            });
        }
        Ok(())
    }
}

/// How the ranks of a backward meet between its launches: gather the batch's partial rows
/// (exact mode) or sum fp32 vectors (fast mode), on the backward's stream.
pub(crate) trait Meet {
    /// Fills in the other ranks' blocks of the `sums` (1 or 2) `[groups, d]` f32 partial rows
    /// at `partials`, one after the other.
    fn gather(&mut self, partials: u64, groups: usize, sums: usize) -> Result<()>;
    /// Sums `count` f32 at `sums` over the ranks, in place.
    fn all_reduce(&mut self, sums: u64, count: usize) -> Result<()>;
}

/// One rank's part in a backward: where its partials go, and how it meets the others.
pub(crate) struct Across<'m> {
    pub partials: Partials,
    pub meet: &'m mut dyn Meet,
}

/// Enqueues a backward: its row kernel (writing dx and the partial rows), then the parameter
/// gradients as `gradients` plans them, meeting the other ranks where `across` says.
pub(crate) fn launch_backward<E: Executor, K: Sync, P: Copy + Sync>(
    exec: &E,
    rows: Option<&Launch<K, P>>,
    gradients: &GradientPlan,
    mut across: Option<Across<'_>>,
) -> Result<()> {
    if let Some((address, words)) = gradients.zero {
        exec.zero(address, words)?;
    }
    if let Some(launch) = rows {
        exec.launch(launch)?;
    }
    let mut meet = across.as_mut().map(|a| &mut *a.meet);
    let no_meet = Error::Internal("a backward across ranks without its ranks");
    if let Some((partials, groups, sums)) = gradients.gather {
        meet.as_mut()
            .ok_or(no_meet.clone())?
            .gather(partials, groups, sums)?;
    }
    if let Some(sums) = &gradients.sums {
        exec.launch(sums)?;
    }
    if let Some((sums, count, cast)) = &gradients.cast {
        meet.ok_or(no_meet)?.all_reduce(*sums, *count)?;
        exec.launch(cast)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
