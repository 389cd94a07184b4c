//! How a buffer's parameter region holds the primary weights. One type per storage kind, behind
//! one interface ([`Storage`]): allocate, the fused optimizer output, stage, after-gather,
//! initial quantization, the weights for compute, memory. Nothing outside this module asks
//! which kind a buffer is.
//!
//! | kind | parameter region | gathered | after the gather |
//! |---|---|---|---|
//! | [`StorageKind::Persistent`] | bf16/f16/f32 values | the values | nothing |
//! | [`StorageKind::Mxfp8Staged`] | bf16 staging view aliasing the gradients | `bf16(master)` | every rank re-quantizes (1x32, both copies), the group's staging view is zeroed |
//! | [`StorageKind::Mxfp8Direct`] | fp8 bytes (one per element) | the bytes | scales from the MAX-reduced 32x32 tile amaxes |
//! | [`StorageKind::Nvfp4Packed`] | packed E2M1 bytes (element offset / 2) | the bytes | scales and the columnwise copy from the MAX-reduced 16x16 tile amaxes |

mod mxfp8_rows;
mod mxfp8_staged;
mod nvfp4_rows;
mod persistent;

pub(crate) use mxfp8_rows::part_bytes;
pub(crate) use nvfp4_rows::unit_bytes as nvfp4_unit_bytes;

/// What a rank contributes to the gather of one matrix of a sharded low-precision unit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum UnitParts {
    /// MXFP8 rows: rowwise data and scales, columnwise data and scales of this rank's chunk.
    Mxfp8([View; 4]),
    /// NVFP4 rows: this rank's packed rowwise bytes; the reduced tile amaxes (every rank has
    /// them) from which the rest is derived after the gather.
    Nvfp4 {
        data: View,
        tiles: View,
        rows: usize,
        cols: usize,
        experts: usize,
    },
}

impl UnitParts {
    /// What this rank contributes to the gather of copy `copy` (0 rowwise, 1 columnwise):
    /// MXFP8 a copy's data and scales; NVFP4 its rowwise bytes (slot 0 holds everything).
    pub(crate) fn inputs(&self, copy: usize) -> Vec<View> {
        match *self {
            UnitParts::Mxfp8(v) => vec![v[2 * copy], v[2 * copy + 1]],
            UnitParts::Nvfp4 { data, .. } => vec![data],
        }
    }

    /// The bytes one matrix takes in the unit buffer of copy `copy` over `dp` ranks: the
    /// gathered inputs, and for NVFP4 what is derived from them after the gather.
    pub(crate) fn unit_bytes(&self, copy: usize, dp: usize) -> usize {
        match *self {
            UnitParts::Mxfp8(_) => self.inputs(copy).iter().map(|x| dp * x.len()).sum(),
            UnitParts::Nvfp4 { rows, cols, .. } => nvfp4_unit_bytes(rows, cols, dp).iter().sum(),
        }
    }
}

pub(crate) use nvfp4_rows::Nvfp4Rows;

/// The closed form of a row-sharded storage: `bytes(rows, cols, dp)` of every matrix.
fn per_matrix_bytes(
    plan: &BufferPlan,
    specs: &[&ParamSpec],
    bytes: impl Fn(usize, usize, usize) -> usize,
) -> StorageBytes {
    let dp = plan.layout.num_shards;
    StorageBytes {
        weights: specs
            .iter()
            .map(|s| {
                let (rows, cols) = matrix_dims(&s.shape);
                bytes(rows, cols, dp)
            })
            .sum(),
        staging: 0,
    }
}

mod tiled;

use tiled::{Mxfp8Tiles, Nvfp4Tiles, Tiled};

use std::fmt::Debug;
use std::ops::Range;

use lowbit_device::{
    DType, Device, Fp8Kind, Mxfp8Config, Mxfp8Views, Nvfp4Config, Nvfp4Views, PendingAmaxes,
    Piece2d, View,
};
use lowbit_layout::{BufferPlan, GradDType, ParamSpec, ParamStorage, QuantKind, expert_slices};

use crate::config::{Mxfp8Gather, Verify};
use crate::error::Result;

/// Which storage a buffer uses (for reports; behaviour lives in the storage types).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageKind {
    /// Persistent bf16/f16/f32 parameter storage, gathered as is.
    Persistent,
    /// MXFP8 weights outside the buffer; a bf16 staging view aliasing the gradients.
    Mxfp8Staged,
    /// 2D MXFP8 fp8 bytes in the buffer, gathered as bytes.
    Mxfp8Direct,
    /// 2D NVFP4 packed bytes in the buffer, gathered as bytes.
    Nvfp4Packed,
    /// MXFP8 sharded by rows (`optim_grads_params`): each rank keeps both copies of its rows;
    /// units gather the copies.
    Mxfp8Rows,
    /// NVFP4 sharded by rows (`optim_grads_params`): each rank keeps the packed rowwise bytes
    /// of its rows and the tile amaxes; units gather the bytes and derive the rest.
    Nvfp4Rows,
}

impl StorageKind {
    /// The compute format low-precision storage fixes: the stored copies are what the forward
    /// dequantizes, so a policy naming another recipe (or "as stored") would silently compute
    /// with something else. `None` where the storage does not fix it: persistent storage, and
    /// NVFP4 rows (not checked against the policy).
    pub fn compute_format(self) -> Option<crate::ComputeFormat> {
        use crate::ComputeFormat;
        match self {
            StorageKind::Mxfp8Staged | StorageKind::Mxfp8Rows => {
                Some(ComputeFormat::Mxfp8 { two_d: false })
            }
            StorageKind::Mxfp8Direct => Some(ComputeFormat::Mxfp8 { two_d: true }),
            StorageKind::Nvfp4Packed => Some(ComputeFormat::Nvfp4),
            StorageKind::Persistent | StorageKind::Nvfp4Rows => None,
        }
    }
}

/// The MXFP8 storage of one parameter (both copies, compact scales).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mxfp8Weights {
    /// Rows (product of the leading dimensions).
    pub rows: usize,
    /// Columns (last dimension).
    pub cols: usize,
    /// Rowwise data and scales.
    pub rowwise: (View, View),
    /// Columnwise data and scales.
    pub columnwise: (View, View),
}

impl Mxfp8Weights {
    /// The device views of both copies.
    pub fn views(&self) -> Mxfp8Views {
        Mxfp8Views {
            rowwise: Some(self.rowwise),
            columnwise: Some(self.columnwise),
        }
    }
}

/// The 2D NVFP4 storage of one parameter: its rowwise data is its slice of the packed param
/// buffer; scales, the columnwise copy and the reduced tile amaxes live outside.
///
/// A grouped expert tensor (`[experts, out, in]`) holds its experts one after the other, each a
/// 2D NVFP4 matrix of its own with its own global amax (quantized alone, as a discrete expert
/// would be): the rowwise data and scales and the tile amaxes are the experts' in turn (a
/// row-major `[experts · out, in]` matrix; 16x16 tiles never straddle experts), and the
/// columnwise copy is each expert's transpose in turn. [`Nvfp4Weights::per_expert`] splits them.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Weights {
    /// Rows (product of the leading dimensions: every expert's), a multiple of 16 per expert.
    pub rows: usize,
    /// Columns (last dimension), a multiple of 16.
    pub cols: usize,
    /// Rowwise packed data and E4M3 scales.
    pub rowwise: (View, View),
    /// Columnwise (transposed, expert by expert) packed data and scales.
    pub columnwise: (View, View),
    /// MAX-reduced 16x16 tile amaxes (f32); an expert's global amax is the max of its tiles.
    pub tiles: View,
    /// Each expert's global amax (one for an ordinary matrix), as of the last gather.
    pub amaxes: Vec<f32>,
}

impl Nvfp4Weights {
    /// The device views of both copies (of every expert).
    pub fn views(&self) -> Nvfp4Views {
        Nvfp4Views {
            rowwise: Some(self.rowwise),
            columnwise: Some(self.columnwise),
        }
    }

    /// The global amax: the largest expert's (the amaxes are never negative or NaN).
    pub fn amax(&self) -> f32 {
        f32::from_bits(self.amaxes.iter().map(|a| a.to_bits()).max().unwrap_or(0))
    }

    /// Each expert as a matrix of its own (`rows / experts` rows, views into these copies, its
    /// own amax); the weights themselves for an ordinary matrix.
    ///
    /// # Errors
    /// [`lowbit_layout::LayoutError::ExpertSplit`] if the expert count (`amaxes.len()`) is zero
    /// or does not divide the rows and every view.
    pub fn per_expert(&self) -> Result<Vec<Nvfp4Weights>> {
        let n = self.amaxes.len();
        let split = |v: View| -> Result<Vec<View>> {
            expert_slices(0..v.len(), n)?
                .into_iter()
                .map(|r| Ok(v.slice(r)?))
                .collect()
        };
        let rows = expert_slices(0..self.rows, n)?;
        let (rd, rs) = (split(self.rowwise.0)?, split(self.rowwise.1)?);
        let (cd, cs) = (split(self.columnwise.0)?, split(self.columnwise.1)?);
        let tiles = split(self.tiles)?;
        Ok((0..n)
            .map(|e| Nvfp4Weights {
                rows: rows[e].len(),
                cols: self.cols,
                rowwise: (rd[e], rs[e]),
                columnwise: (cd[e], cs[e]),
                tiles: tiles[e],
                amaxes: vec![self.amaxes[e]],
            })
            .collect())
    }
}

/// Completes gathered 2D NVFP4 weights — every expert of every matrix of `ws` — with one
/// [`Device::nvfp4_finish_2d_many`] call (on a GPU: two launches and one host read for all of
/// them, not a host round trip per matrix), and stores each expert's global amax.
pub(crate) fn finish_nvfp4(dev: &mut Device, ws: &mut [&mut Nvfp4Weights]) -> Result<()> {
    let pending = start_nvfp4_finish(dev, ws.iter().map(|w| &**w))?;
    let amaxes = dev.read_amaxes(pending)?;
    store_nvfp4_amaxes(ws.iter_mut().map(|w| &mut **w), amaxes);
    Ok(())
}

/// [`finish_nvfp4`] without the read: one [`Device::nvfp4_finish_2d_many_deferred`] call for
/// every expert of every matrix of `ws`, in order.
pub(crate) fn start_nvfp4_finish<'a>(
    dev: &mut Device,
    ws: impl Iterator<Item = &'a Nvfp4Weights>,
) -> Result<PendingAmaxes> {
    let mut items = Vec::new();
    for w in ws {
        for x in w.per_expert()? {
            items.push((x.rows, x.cols, x.tiles, x.views()));
        }
    }
    Ok(dev.nvfp4_finish_2d_many_deferred(&items)?)
}

/// Stores the amaxes of a [`start_nvfp4_finish`] of the same weights, in the same order.
pub(crate) fn store_nvfp4_amaxes<'a>(
    ws: impl Iterator<Item = &'a mut Nvfp4Weights>,
    amaxes: Vec<f32>,
) {
    let mut amaxes = amaxes.into_iter();
    for w in ws {
        // `per_expert` gave one item per entry of `amaxes`, in this order.
        for (a, new) in w.amaxes.iter_mut().zip(amaxes.by_ref()) {
            *a = new;
        }
    }
}

/// A parameter's low-precision primary weights, as compute reads them.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub enum LowPrecisionWeights {
    /// MXFP8 (1D blocks, or 2D with the direct gather).
    Mxfp8(Mxfp8Weights),
    /// 2D NVFP4 and its global amax after the last gather.
    Nvfp4 {
        /// The copies (and each expert's amax).
        weights: Nvfp4Weights,
        /// The global amax the tensor scale derives from (of a grouped tensor: the largest
        /// expert's; each expert is scaled by its own, [`Nvfp4Weights::amaxes`]).
        amax: f32,
    },
}

/// The 2D NVFP4 recipe of primary weights (TE's weight recipe: 16x16 tiles, no RHT, no SR).
pub fn nvfp4_weight_config() -> Nvfp4Config {
    Nvfp4Config {
        two_d: true,
        ..Default::default()
    }
}

/// The MXFP8 recipe of primary weights: E4M3, both copies, 1x32 blocks, TE's NaN policy.
pub fn mxfp8_weight_config() -> Mxfp8Config {
    Mxfp8Config {
        kind: Fp8Kind::E4M3,
        ..Mxfp8Config::default()
    }
}

pub use lowbit_layout::matrix_dims;

/// Experts of a parameter: a grouped expert tensor `[experts, out, in]` (the layout's
/// convention) has `experts`, anything else one. NVFP4 storage keeps one global amax per expert.
pub(crate) fn experts_of(shape: &[usize]) -> usize {
    match *shape {
        [experts, _, _] => experts,
        _ => 1,
    }
}

/// Bytes of one buffer's weights on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StorageBytes {
    /// Allocated weight bytes (parameter region unless aliased, copies, scales, tile amaxes).
    pub weights: usize,
    /// Bytes of a staging view that aliases the gradients (not allocated).
    pub staging: usize,
}

/// What a storage type does; see the module table.
pub(crate) trait Storage: Debug + Send {
    /// The kind, for reports.
    fn kind(&self) -> StorageKind;

    /// The parameter region: what the gather moves and parameter views slice.
    fn region(&self) -> View;

    /// Whether the weights are low precision (rebuilt from staged masters, with a weight state).
    fn is_low_precision(&self) -> bool {
        true
    }

    /// Whether the parameter region aliases the gradients, so zeroing the gradients destroys
    /// staged values.
    fn aliases_grads(&self) -> bool {
        false
    }

    /// Where the optimizer writes the rounded new values of an owned piece (`range` in buffer
    /// elements) fused into its update, if the storage takes them that way.
    fn fused_output(&self, range: Range<usize>) -> Result<Option<View>> {
        let _ = range;
        Ok(None)
    }

    /// Where `bf16(master)` of an owned piece (`range` in buffer elements) goes, if this storage
    /// stages by a plain cast into its region (no collective needed): the staging casts of
    /// consecutive pieces then run as one launch.
    fn staging_view(&self, range: Range<usize>) -> Result<Option<View>> {
        let _ = range;
        Ok(None)
    }

    /// Stages an owned piece from its master by this storage's own means (no collective), if
    /// it stages that way and not by [`Storage::staging_view`]. Returns whether it did.
    fn stage_cast(&self, dev: &mut Device, range: Range<usize>, master: View) -> Result<bool> {
        let _ = (dev, range, master);
        Ok(false)
    }

    /// The tile-scaled interface, for storages quantized shard by shard after a MAX-reduction
    /// of tile amaxes.
    fn tile_scaled(&self) -> Option<&dyn TileScaled> {
        None
    }

    /// Completes the gather of one bucket group (nothing to do for persistent storage).
    fn after_gather(&mut self, dev: &mut Device, group: Gathered<'_>) -> Result<AfterGather> {
        let _ = (dev, group);
        Ok(AfterGather::Ok)
    }

    /// Stores host values that `after_gather` left on the device (NVFP4's global amaxes): one
    /// read for every completion since the last call. The protocol calls it before any weight
    /// of a completed group can be read.
    fn settle(&mut self, dev: &mut Device) -> Result<()> {
        let _ = dev;
        Ok(())
    }

    /// Writes the initial weights of layout index `index` from `values`, its f32 values:
    /// rounded to the storage dtype, or `Q(bf16(values))` (every rank writes every parameter;
    /// no gather needed at iteration 0).
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()>;

    /// Sharded low-precision units: what this rank contributes to the gather of layout index
    /// `index`.
    fn unit_parts(&self, index: usize) -> Option<UnitParts> {
        let _ = index;
        None
    }

    /// The low-precision weights of layout index `index`.
    fn weights(&self, index: usize) -> Option<LowPrecisionWeights> {
        let _ = index;
        None
    }

    /// Bytes held (allocations counted once; an aliased staging view reported apart).
    fn memory(&self) -> StorageBytes;
}

/// Runs `f` on a bf16 copy of the f32 `values` (low-precision weights are `Q(bf16(values))`).
fn with_bf16(
    dev: &mut Device,
    values: View,
    f: impl FnOnce(&mut Device, View) -> Result<()>,
) -> Result<()> {
    let tmp = dev.alloc(DType::Bf16, values.len());
    let r = dev
        .cast(values, tmp)
        .map_err(Into::into)
        .and_then(|()| f(dev, tmp));
    dev.free(tmp)?;
    r
}

/// The bucket group whose gather [`Storage::after_gather`] completes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gathered<'a> {
    /// The buffer's plan.
    pub plan: &'a BufferPlan,
    /// The group's parameters, as layout indices.
    pub indices: &'a [usize],
    /// The group's buckets.
    pub buckets: &'a [usize],
    /// How much to verify.
    pub verify: Verify,
}

/// What [`Storage::after_gather`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterGather {
    /// Done.
    Ok,
    /// The staging view of a bucket was not zero after the copy-back ([`Verify::Full`]).
    StagingNotZero,
}

/// Storages quantized shard by shard: each rank folds its pieces' values into partial tile
/// amaxes, the amaxes are MAX-reduced across ranks, then each rank quantizes its pieces.
pub(crate) trait TileScaled {
    /// The tile-amax view of layout index `index`.
    fn tiles(&self, index: usize) -> View;
    /// The fold of a piece's values `bf16(values)` (starting at element `offset` of parameter
    /// `index`) into its tiles, for [`Device::fold_tile_amax_2d_bf16_many`].
    fn fold_piece(&self, index: usize, values: View, offset: usize) -> Piece2d;
    /// The quantizations of the values `bf16(v)` of a piece (`range` of parameter `i`'s
    /// elements) with the reduced tiles into the region, for
    /// [`Device::quantize_2d_range_bf16_many`] (one per expert the piece touches).
    fn quantize_pieces(
        &self,
        i: usize,
        v: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>>;
}

/// Allocates the storage of one buffer. `specs` are the buffer's parameters in layout order;
/// `grads` is the memory a staging view aliases (the gradient buffer, or a bf16 buffer of its
/// own where gradients are sharded); `rank` is this rank (read where parameters are sharded).
pub(crate) fn allocate(
    dev: &mut Device,
    plan: &BufferPlan,
    specs: &[&ParamSpec],
    grads: View,
    gather: Mxfp8Gather,
    rank: usize,
) -> Result<Box<dyn Storage>> {
    check(plan, specs)?;
    if plan.strategy.shards_params() {
        match plan.key.param_storage {
            ParamStorage::Quantized(QuantKind::Mxfp8) => {
                let s = mxfp8_rows::Mxfp8Rows::allocate(dev, plan, specs, rank)?;
                return Ok(Box::new(s));
            }
            ParamStorage::Quantized(_) => {
                return Ok(Box::new(Nvfp4Rows::allocate(dev, plan, specs, rank)?));
            }
            _ => {}
        }
    }
    Ok(match (plan.key.param_storage, gather) {
        (ParamStorage::Quantized(QuantKind::Mxfp8), Mxfp8Gather::Direct2d) => {
            Box::new(Tiled::<Mxfp8Tiles>::allocate(dev, plan, specs)?)
        }
        (ParamStorage::Quantized(QuantKind::Mxfp8), _) => Box::new(
            mxfp8_staged::Mxfp8Staged::allocate(dev, plan, specs, grads)?,
        ),
        (ParamStorage::Quantized(QuantKind::Nvfp4), _) => {
            Box::new(Tiled::<Nvfp4Tiles>::allocate(dev, plan, specs)?)
        }
        (s, _) => Box::new(persistent::Persistent::allocate(
            dev,
            plan,
            storage_dtype(s),
            plan.strategy.shards_params().then_some(rank),
        )?),
    })
}

/// Whether the storage of `plan` stages `bf16(master)` in a view over the gradient memory.
pub(crate) fn stages_through_grads(plan: &BufferPlan, gather: Mxfp8Gather) -> bool {
    plan.key.param_storage == ParamStorage::Quantized(QuantKind::Mxfp8)
        && gather == Mxfp8Gather::Bf16Staging
}

/// Refuses the parameters of a buffer that its storage cannot hold, as [`allocate`] does (no
/// allocation).
pub(crate) fn check(plan: &BufferPlan, specs: &[&ParamSpec]) -> Result<()> {
    match plan.key.param_storage {
        ParamStorage::Quantized(QuantKind::Nvfp4) => Tiled::<Nvfp4Tiles>::check(specs),
        _ => Ok(()),
    }
}

/// The bytes [`allocate`] would hold, in closed form (no allocation).
pub(crate) fn closed_form(
    plan: &BufferPlan,
    specs: &[&ParamSpec],
    gather: Mxfp8Gather,
) -> StorageBytes {
    let dims = || specs.iter().map(|s| matrix_dims(&s.shape));
    if plan.strategy.shards_params() {
        match plan.key.param_storage {
            ParamStorage::Quantized(QuantKind::Mxfp8) => {
                return mxfp8_rows::Mxfp8Rows::closed_form(plan, specs);
            }
            ParamStorage::Quantized(_) => return Nvfp4Rows::closed_form(plan, specs),
            _ => {}
        }
    }
    match (plan.key.param_storage, gather) {
        (ParamStorage::Quantized(QuantKind::Mxfp8), Mxfp8Gather::Direct2d) => {
            Tiled::<Mxfp8Tiles>::closed_form(plan.layout.numel, dims())
        }
        (ParamStorage::Quantized(QuantKind::Mxfp8), _) => {
            mxfp8_staged::Mxfp8Staged::closed_form(plan.layout.numel, dims())
        }
        (ParamStorage::Quantized(QuantKind::Nvfp4), _) => {
            Tiled::<Nvfp4Tiles>::closed_form(plan.layout.numel, dims())
        }
        (s, _) => StorageBytes {
            weights: if plan.strategy.shards_params() {
                plan.shard_numel()
            } else {
                plan.layout.numel
            } * storage_dtype(s).size(),
            staging: 0,
        },
    }
}

/// The dtype of persistent storage.
pub(crate) fn storage_dtype(s: ParamStorage) -> DType {
    match s {
        ParamStorage::F16 => DType::F16,
        ParamStorage::F32 => DType::F32,
        _ => DType::Bf16,
    }
}

/// The dtype of a gradient buffer.
pub(crate) fn grad_dtype(g: GradDType) -> DType {
    match g {
        GradDType::F32 => DType::F32,
        GradDType::Bf16 => DType::Bf16,
    }
}
