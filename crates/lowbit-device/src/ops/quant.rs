//! MXFP8 and NVFP4 quantization and dequantization over views, delegating the arithmetic to
//! `lowbit-formats` so that the bytes are by construction the library's.

use lowbit_formats::mxfp8::{self, Mxfp8Config, Mxfp8Tensor};
use lowbit_formats::nvfp4::{self, Nvfp4Config, Nvfp4Tensor};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::ops::Range;

use lowbit_formats::{Copies, Fp8Kind, Matrix, NanPolicy, QuantPlane, Source};

use super::{Mxfp8Views, Nvfp4Amax, Nvfp4Views, invalid, shape_len};
use crate::{
    BufferId, DType, Device, HostElem, Result, View, bf16, check_dtype, check_float, check_len, f16,
};

/// The tensor name `lowbit-formats` errors carry for device views.
const TENSOR_NAME: &str = "device view";

/// A float view's elements on the host, in their own type (the quantizers read f32, bf16 and
/// f16 natively).
enum HostValues {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostValues {
    /// Reads `v` (a host fallback of `what` on a GPU).
    fn read(dev: &mut Device, what: &'static str, v: View) -> Result<Self> {
        dev.host_read(what, v, |bytes| match v.dtype() {
            DType::Bf16 => HostValues::Bf16(bf16::from_bytes(bytes)),
            DType::F16 => HostValues::F16(f16::from_bytes(bytes)),
            _ => HostValues::F32(f32::from_bytes(bytes)),
        })
    }

    fn source(&self) -> Source<'_> {
        match self {
            HostValues::F32(x) => Source::F32(x),
            HostValues::Bf16(x) => Source::Bf16(x),
            HostValues::F16(x) => Source::F16(x),
        }
    }
}

/// Expected element counts of one copy's views.
struct PlaneShape {
    /// Names for errors: the data view and the scales view.
    what: [&'static str; 2],
    wanted: bool,
    data_len: usize,
    scales_len: usize,
}

/// What a format's quantization writes, for checking the destination views: the names of each
/// copy's data and scales views (rowwise, then columnwise) and their lengths for a
/// `rows × cols` matrix.
struct Planes {
    names: [[&'static str; 2]; 2],
    lens: fn(usize, usize) -> [[usize; 2]; 2],
}

/// The views MXFP8 quantization writes (one byte per element, a scale per 32).
const MXFP8_PLANES: Planes = Planes {
    names: [
        [
            "quantize_mxfp8 rowwise data",
            "quantize_mxfp8 rowwise scales",
        ],
        [
            "quantize_mxfp8 columnwise data",
            "quantize_mxfp8 columnwise scales",
        ],
    ],
    lens: |rows, cols| {
        let n = rows * cols;
        [
            [n, rows * cols.div_ceil(mxfp8::BLOCK)],
            [n, rows.div_ceil(mxfp8::BLOCK) * cols],
        ]
    },
};

/// The views NVFP4 quantization writes (two codes per byte, a scale per 16; the columnwise copy
/// transposed).
const NVFP4_PLANES: Planes = Planes {
    names: [
        [
            "quantize_nvfp4 rowwise data",
            "quantize_nvfp4 rowwise scales",
        ],
        [
            "quantize_nvfp4 columnwise data",
            "quantize_nvfp4 columnwise scales",
        ],
    ],
    lens: |rows, cols| {
        [
            [rows * cols.div_ceil(2), rows * cols.div_ceil(nvfp4::BLOCK)],
            [cols * rows.div_ceil(2), cols * rows.div_ceil(nvfp4::BLOCK)],
        ]
    },
};

/// The op name of MXFP8 quantization's errors and host-fallback counts
/// ([`Device::quantize_mxfp8_many`] reports under it too).
const MXFP8_WHAT: &str = "quantize_mxfp8";

/// The verdict of `crate::cpu::check_overlap(what, ins, outs)` — an output sharing a byte with
/// another output or with an input ([`View::overlaps`], empty views included) is
/// [`crate::DeviceError::Overlap`] — by sorting the byte ranges of each buffer instead of
/// comparing every pair (a whole model's weights are hundreds of views).
pub(super) fn check_overlap_sorted(what: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
    let mut by_buffer: IdMap<Vec<(Range<usize>, bool)>> = HashMap::default();
    let tagged = ins.iter().map(|v| (v, false));
    for (v, out) in tagged.chain(outs.iter().map(|v| (v, true))) {
        by_buffer
            .entry(v.buffer())
            .or_default()
            .push((v.byte_range(), out));
    }
    for spans in by_buffer.values_mut() {
        spans.sort_unstable_by_key(|(r, _)| r.start);
        // The largest end of the spans that start before the current group, of all of them and
        // of the outputs: an earlier span overlaps one starting at `start` iff it ends past it.
        let (mut end_all, mut end_out) = (0usize, 0usize);
        for group in spans.chunk_by(|a, b| a.0.start == b.0.start) {
            let start = group[0].0.start;
            // Two spans with the same start overlap iff both are non-empty.
            let full = group.iter().filter(|(r, _)| !r.is_empty());
            let same_start = full.clone().any(|(_, out)| *out) && full.count() >= 2;
            let earlier = group
                .iter()
                .any(|(_, out)| start < if *out { end_all } else { end_out });
            if same_start || earlier {
                return Err(crate::DeviceError::Overlap(what));
            }
            for (r, out) in group {
                end_all = end_all.max(r.end);
                if *out {
                    end_out = end_out.max(r.end);
                }
            }
        }
    }
    Ok(())
}

/// A hasher for [`BufferId`]s (small integers from this process, not attacker-chosen keys): a
/// multiply per word where SipHash took ~20 ns a view, half of [`check_overlap_sorted`]'s time
/// for a whole model's views, on the host path of every batched call.
#[derive(Default)]
struct IdHasher(u64);

/// A map keyed by buffer, hashed by [`IdHasher`].
type IdMap<T> = HashMap<BufferId, T, BuildHasherDefault<IdHasher>>;

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// Checks one copy's destination views: present exactly when the copy is requested, u8, and of
/// the expected lengths.
fn check_plane_views(
    what: &'static str,
    which: &str,
    views: Option<(View, View)>,
    shape: &PlaneShape,
) -> Result<()> {
    match (views, shape.wanted) {
        (None, false) => Ok(()),
        (None, true) => Err(invalid(
            what,
            format!("the config requests the {which} copy but no {which} views were given"),
        )),
        (Some(_), false) => Err(invalid(
            what,
            format!("{which} views were given but the config does not request that copy"),
        )),
        (Some((data, scales)), true) => {
            check_dtype(shape.what[0], data, DType::U8)?;
            check_dtype(shape.what[1], scales, DType::U8)?;
            check_len(shape.what[0], data.len(), shape.data_len)?;
            check_len(shape.what[1], scales.len(), shape.scales_len)
        }
    }
}

/// A quantized copy's format, as its dequantization needs it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dequant {
    /// MXFP8 with elements of this kind.
    Mxfp8(Fp8Kind),
    /// NVFP4 with this global amax.
    Nvfp4 {
        /// The copy's global amax.
        amax: f32,
        /// Whether the copy holds Hadamard-transformed values (columnwise copies only).
        rht: bool,
    },
}

impl Device {
    /// Writes one quantized plane into its (already validated) views.
    fn write_plane(
        &mut self,
        views: Option<(View, View)>,
        plane: Option<&QuantPlane>,
    ) -> Result<()> {
        if let (Some((data, scales)), Some(p)) = (views, plane) {
            self.write_bytes(data, &p.data)?;
            self.write_bytes(scales, &p.scales)?;
        }
        Ok(())
    }

    /// Validates a quantization before anything is written: `src` is a float view of
    /// `rows·cols` elements; each copy's views (`[rowwise, columnwise]`) are given exactly when
    /// `copies` asks for that copy, u8, of the lengths `planes` gives; nothing overlaps.
    fn check_quantize(
        &self,
        what: &'static str,
        src: View,
        [rows, cols]: [usize; 2],
        copies: Copies,
        out: [Option<(View, View)>; 2],
        planes: &Planes,
    ) -> Result<()> {
        check_float(what, src)?;
        let n = shape_len(what, rows, cols)?;
        check_len(what, src.len(), n)?;
        let lens = (planes.lens)(rows, cols);
        let wanted = [copies.rowwise(), copies.columnwise()];
        for (i, which) in ["rowwise", "columnwise"].into_iter().enumerate() {
            let shape = PlaneShape {
                what: planes.names[i],
                wanted: wanted[i],
                data_len: lens[i][0],
                scales_len: lens[i][1],
            };
            check_plane_views(what, which, out[i], &shape)?;
        }
        let outs: Vec<View> = out
            .into_iter()
            .flatten()
            .flat_map(|(d, s)| [d, s])
            .collect();
        self.check_views(what, &[src], &outs)
    }

    /// Quantizes the row-major `rows × cols` float view `src` to MXFP8 with
    /// `lowbit_formats::quantize_mxfp8` and writes the copies `cfg.copies` asks for into `out`
    /// (compact scale layout): rowwise data `rows·cols` and scales `rows·ceil(cols/32)`,
    /// columnwise data `rows·cols` and scales `ceil(rows/32)·cols`, all u8 views that overlap
    /// neither each other nor `src`. A requested copy without views, or views for a copy not
    /// requested, is [`crate::DeviceError::Invalid`]. Format errors (e.g. a non-finite input
    /// under `NanPolicy::Error`) are reported before anything is written.
    pub fn quantize_mxfp8(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Mxfp8Config,
        out: &Mxfp8Views,
    ) -> Result<()> {
        self.count_call(crate::CountedOp::QuantizeMxfp8);
        self.check_quantize_mxfp8(src, [rows, cols], cfg, out)?;
        self.quantize_mxfp8_checked(src, [rows, cols], cfg, out)
    }

    /// [`Device::quantize_mxfp8`] of every `(src, rows, cols, out)` of `items` with one `cfg`:
    /// the bytes of one `quantize_mxfp8` call per item in order, and counted as those calls
    /// are (one [`crate::CountedOp::QuantizeMxfp8`] per item). Every item is validated as
    /// `quantize_mxfp8` validates it, with its errors (the first invalid item's), before
    /// anything is written; the items are then checked together as one op's views: no item's
    /// outputs may overlap another item's source or outputs ([`crate::DeviceError::Overlap`];
    /// sources may overlap each other), so the items are independent and their order does not
    /// change the bytes. A format error (a non-finite input under `NanPolicy::Error`) is also
    /// raised, for the first failing item, before anything is written.
    ///
    /// On CUDA, the items that `quantize_mxfp8` would quantize with the default both-copies
    /// kernel (bf16 → E4M3, both copies, 1D scales, TE NaN policy, kernel version 4) run
    /// together when there are at least two of them: one launch per shape
    /// (`mxfp8_both_e4m3_bf16_v4_same`) where those launches average at least four matrices,
    /// else one launch for all (`mxfp8_both_e4m3_bf16_v4_many`), 64 matrices at most per launch
    /// (variant `mxfp8_many`); every other item takes `quantize_mxfp8`'s own path. The CPU
    /// backend quantizes the items in order.
    pub fn quantize_mxfp8_many(
        &mut self,
        items: &[(View, usize, usize, Mxfp8Views)],
        cfg: &Mxfp8Config,
    ) -> Result<()> {
        for _ in items {
            self.count_call(crate::CountedOp::QuantizeMxfp8);
        }
        for (src, rows, cols, out) in items {
            self.check_quantize_mxfp8(*src, [*rows, *cols], cfg, out)?;
        }
        let ins: Vec<View> = items.iter().map(|item| item.0).collect();
        let outs: Vec<View> = items
            .iter()
            .flat_map(|(_, _, _, out)| [out.rowwise, out.columnwise])
            .flatten()
            .flat_map(|(d, s)| [d, s])
            .collect();
        check_overlap_sorted(MXFP8_WHAT, &ins, &outs)?;
        if cfg.nan_policy != NanPolicy::Te {
            // Only this policy raises format errors, and only on the host path that
            // `quantize_mxfp8` takes for it on every backend: quantize every item before
            // writing any.
            let mut tensors = Vec::with_capacity(items.len());
            for &(src, rows, cols, _) in items {
                let host = HostValues::read(self, MXFP8_WHAT, src)?;
                let m = Matrix::new(TENSOR_NAME, rows, cols, host.source())?;
                tensors.push(lowbit_formats::quantize_mxfp8(&m, cfg)?);
            }
            for (t, (_, _, _, out)) in tensors.iter().zip(items) {
                self.write_plane(out.rowwise, t.rowwise.as_ref())?;
                self.write_plane(out.columnwise, t.columnwise.as_ref())?;
            }
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        let rest = match self.cuda_mut() {
            Some(g) => {
                let qs: Vec<_> = items
                    .iter()
                    .map(|(src, rows, cols, out)| crate::cuda::Quantize {
                        src: *src,
                        shape: [*rows, *cols],
                        cfg,
                        out,
                    })
                    .collect();
                g.quantize_mxfp8_many(&qs)?
            }
            None => (0..items.len()).collect(),
        };
        #[cfg(not(feature = "cuda"))]
        let rest = 0..items.len();
        for i in rest {
            let (src, rows, cols, out) = &items[i];
            self.quantize_mxfp8_checked(*src, [*rows, *cols], cfg, out)?;
        }
        Ok(())
    }

    /// The checks of [`Device::quantize_mxfp8`] (views, dtypes, lengths, overlap).
    fn check_quantize_mxfp8(
        &self,
        src: View,
        shape: [usize; 2],
        cfg: &Mxfp8Config,
        out: &Mxfp8Views,
    ) -> Result<()> {
        let copies = [out.rowwise, out.columnwise];
        self.check_quantize(MXFP8_WHAT, src, shape, cfg.copies, copies, &MXFP8_PLANES)
    }

    /// The work of [`Device::quantize_mxfp8`] after its checks: a kernel, else the host path.
    fn quantize_mxfp8_checked(
        &mut self,
        src: View,
        [rows, cols]: [usize; 2],
        cfg: &Mxfp8Config,
        out: &Mxfp8Views,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut() {
            let q = crate::cuda::Quantize {
                src,
                shape: [rows, cols],
                cfg,
                out,
            };
            if g.quantize_mxfp8(&q)? || g.mxfp8x_quantize(&q)? {
                return Ok(());
            }
        }
        let host = HostValues::read(self, MXFP8_WHAT, src)?;
        let t = lowbit_formats::quantize_mxfp8(
            &Matrix::new(TENSOR_NAME, rows, cols, host.source())?,
            cfg,
        )?;
        self.write_plane(out.rowwise, t.rowwise.as_ref())?;
        self.write_plane(out.columnwise, t.columnwise.as_ref())
    }

    /// Dequantizes an MXFP8 rowwise copy (u8 `data` `rows·cols`, E8M0 `scales`
    /// `rows·ceil(cols/32)`) into the float view `dst` (`rows·cols`): the values of
    /// `Mxfp8Tensor::dequantize_rowwise` (exact in f32), rounded to `dst`'s dtype.
    pub fn dequantize_mxfp8_rowwise(
        &mut self,
        data: View,
        scales: View,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        dst: View,
    ) -> Result<()> {
        let format = Dequant::Mxfp8(kind);
        let what = "dequantize_mxfp8_rowwise";
        self.dequantize_copy(what, format, [data, scales, dst], [rows, cols], false)
    }

    /// Dequantizes an MXFP8 columnwise copy (u8 `data` `rows·cols`, E8M0 `scales`
    /// `ceil(rows/32)·cols`) into the float view `dst` (`rows·cols`, original order), rounded to
    /// `dst`'s dtype.
    pub fn dequantize_mxfp8_columnwise(
        &mut self,
        data: View,
        scales: View,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        dst: View,
    ) -> Result<()> {
        let format = Dequant::Mxfp8(kind);
        let what = "dequantize_mxfp8_columnwise";
        self.dequantize_copy(what, format, [data, scales, dst], [rows, cols], true)
    }

    /// Quantizes the row-major `rows × cols` float view `src` to NVFP4 with
    /// `lowbit_formats::quantize_nvfp4` (TE's two-level recipe, including the optional Hadamard
    /// transform and stochastic rounding of `cfg`) and writes the requested copies into `out`:
    /// rowwise packed data `rows·ceil(cols/2)` and scales `rows·ceil(cols/16)`, columnwise
    /// (transposed) packed data `cols·ceil(rows/2)` and scales `cols·ceil(rows/16)`. Returns the
    /// global amaxes the tensor scales came from (dequantization needs them). View rules as
    /// [`Device::quantize_mxfp8`].
    pub fn quantize_nvfp4(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Nvfp4Config,
        out: &Nvfp4Views,
    ) -> Result<Nvfp4Amax> {
        let pending = self.quantize_nvfp4_inner("quantize_nvfp4", src, [rows, cols], cfg, out)?;
        Ok(self
            .read_nvfp4_amaxes(vec![pending])?
            .pop()
            .unwrap_or_default())
    }

    /// [`Device::quantize_nvfp4`] without waiting for the amaxes: on a GPU whose kernels take
    /// the configuration (1D, round to nearest, no Hadamard transform) the launches are queued
    /// and the global amax stays on the device until [`Device::read_nvfp4_amaxes`] (a copy and
    /// one stream synchronization for every pending call), so a caller that quantizes several
    /// matrices in a row waits once, and the host queues the next call while the GPU runs this
    /// one. Elsewhere the call completes as [`Device::quantize_nvfp4`] does. The same bytes and
    /// amaxes; the outputs are written in stream order (read them on this device's stream, or
    /// after [`Device::read_nvfp4_amaxes`] or [`Device::synchronize`]).
    pub fn quantize_nvfp4_deferred(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Nvfp4Config,
        out: &Nvfp4Views,
    ) -> Result<PendingNvfp4Amax> {
        const WHAT: &str = "quantize_nvfp4_deferred";
        self.quantize_nvfp4_inner(WHAT, src, [rows, cols], cfg, out)
    }

    /// The amaxes of [`Device::quantize_nvfp4_deferred`] calls, in the order given: every copy
    /// queued first, then one stream synchronization.
    ///
    /// # Errors
    /// [`crate::DeviceError::Unsupported`] for amaxes pending on another kind of device (a
    /// GPU's, read on the CPU backend) or on another GPU; the device's own errors. Nothing is
    /// returned for any call when one fails.
    pub fn read_nvfp4_amaxes(&mut self, pending: Vec<PendingNvfp4Amax>) -> Result<Vec<Nvfp4Amax>> {
        // One word per call on the device (both copies share the amax there).
        let words = pending
            .into_iter()
            .map(|p| match p.0 {
                PendingNvfp4::Values(a) => {
                    PendingAmaxes(Pending::Values(vec![a.rowwise, a.columnwise]))
                }
                #[cfg(feature = "cuda")]
                PendingNvfp4::Device(w) => PendingAmaxes(Pending::Device(w)),
            })
            .collect();
        Ok(self
            .read_amaxes_many(words)?
            .into_iter()
            .map(|v| Nvfp4Amax {
                rowwise: v.first().copied().unwrap_or(0.0),
                columnwise: v.last().copied().unwrap_or(0.0),
            })
            .collect())
    }

    /// [`Device::quantize_nvfp4`] and [`Device::quantize_nvfp4_deferred`] (`what` names the op
    /// in the host fallback and the view checks that name one; the planes' length errors keep
    /// `quantize_nvfp4`'s names).
    fn quantize_nvfp4_inner(
        &mut self,
        what: &'static str,
        src: View,
        [rows, cols]: [usize; 2],
        cfg: &Nvfp4Config,
        out: &Nvfp4Views,
    ) -> Result<PendingNvfp4Amax> {
        self.count_call(crate::CountedOp::QuantizeNvfp4);
        let copies = [out.rowwise, out.columnwise];
        self.check_quantize(what, src, [rows, cols], cfg.copies, copies, &NVFP4_PLANES)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut() {
            let q = crate::cuda::Quantize {
                src,
                shape: [rows, cols],
                cfg,
                out,
            };
            if let Some(words) = g.quantize_nvfp4(&q)? {
                return Ok(PendingNvfp4Amax(PendingNvfp4::Device(words)));
            }
            if let Some(amax) = g.nvfp4_quantize_variants(&q)? {
                return Ok(PendingNvfp4Amax(PendingNvfp4::Values(amax)));
            }
        }
        let host = HostValues::read(self, what, src)?;
        let t = lowbit_formats::quantize_nvfp4(
            &Matrix::new(TENSOR_NAME, rows, cols, host.source())?,
            cfg,
        )?;
        self.write_plane(out.rowwise, t.rowwise.as_ref())?;
        self.write_plane(out.columnwise, t.columnwise.as_ref())?;
        Ok(PendingNvfp4Amax(PendingNvfp4::Values(Nvfp4Amax {
            rowwise: t.amax_rowwise,
            columnwise: t.amax_columnwise,
        })))
    }

    /// Dequantizes an NVFP4 rowwise copy (packed `data` `rows·ceil(cols/2)`, E4M3 `scales`
    /// `rows·ceil(cols/16)`, global `amax`) into the float view `dst` (`rows·cols`): the values
    /// of `Nvfp4Tensor::dequantize_rowwise` (TE's order), rounded to `dst`'s dtype.
    pub fn dequantize_nvfp4_rowwise(
        &mut self,
        data: View,
        scales: View,
        amax: f32,
        rows: usize,
        cols: usize,
        dst: View,
    ) -> Result<()> {
        let format = Dequant::Nvfp4 { amax, rht: false };
        let what = "dequantize_nvfp4_rowwise";
        self.dequantize_copy(what, format, [data, scales, dst], [rows, cols], false)
    }

    /// Dequantizes an NVFP4 columnwise copy (packed `data` `cols·ceil(rows/2)`, scales
    /// `cols·ceil(rows/16)`, its `amax`, and whether it holds Hadamard-transformed values) into
    /// the float view `dst` (`rows·cols`, original order; the transform is undone in f32).
    #[allow(clippy::too_many_arguments)]
    pub fn dequantize_nvfp4_columnwise(
        &mut self,
        data: View,
        scales: View,
        amax: f32,
        rht: bool,
        rows: usize,
        cols: usize,
        dst: View,
    ) -> Result<()> {
        let format = Dequant::Nvfp4 { amax, rht };
        let what = "dequantize_nvfp4_columnwise";
        self.dequantize_copy(what, format, [data, scales, dst], [rows, cols], true)
    }

    /// The body of the dequantizations: the rowwise or (`columnwise`) the columnwise copy
    /// `[data, scales]` of a `rows × cols` matrix in `format`, into the float view `dst`.
    fn dequantize_copy(
        &mut self,
        what: &'static str,
        format: Dequant,
        views: [View; 3],
        [rows, cols]: [usize; 2],
        columnwise: bool,
    ) -> Result<()> {
        let [data, scales, dst] = views;
        let (data_shape, scales_shape) = match (format, columnwise) {
            (Dequant::Mxfp8(_), false) => ([rows, cols], [rows, cols.div_ceil(mxfp8::BLOCK)]),
            (Dequant::Mxfp8(_), true) => ([rows, cols], [rows.div_ceil(mxfp8::BLOCK), cols]),
            (Dequant::Nvfp4 { .. }, false) => (
                [rows, cols.div_ceil(2)],
                [rows, cols.div_ceil(nvfp4::BLOCK)],
            ),
            (Dequant::Nvfp4 { .. }, true) => (
                [cols, rows.div_ceil(2)],
                [cols, rows.div_ceil(nvfp4::BLOCK)],
            ),
        };
        self.check_plane(what, views, [[rows, cols], data_shape], scales_shape)?;
        if let Dequant::Nvfp4 { rht: true, .. } = format
            && !rows.is_multiple_of(nvfp4::BLOCK)
        {
            return Err(invalid(
                what,
                format!("a Hadamard-transformed copy needs rows % 16 == 0, got {rows}"),
            ));
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.dequantize(format, views, [rows, cols], columnwise)?
        {
            return Ok(());
        }
        let plane = self.read_plane(what, [data, scales], data_shape, scales_shape)?;
        let (rowwise, col) = if columnwise {
            (None, Some(plane))
        } else {
            (Some(plane), None)
        };
        let vals = match format {
            Dequant::Mxfp8(kind) => {
                let t =
                    Mxfp8Tensor::from_parts(TENSOR_NAME, rows, cols, kind, false, rowwise, col)?;
                if columnwise {
                    t.dequantize_columnwise()
                } else {
                    t.dequantize_rowwise()
                }
            }
            Dequant::Nvfp4 { amax, rht } => {
                let t = Nvfp4Tensor::from_parts(
                    TENSOR_NAME,
                    rows,
                    cols,
                    false,
                    rht,
                    amax,
                    amax,
                    rowwise,
                    col,
                )?;
                if columnwise {
                    t.dequantize_columnwise()
                } else {
                    t.dequantize_rowwise()
                }
            }
        };
        self.write_f32(dst, &vals.unwrap_or_default())
    }

    /// Validates the views of a dequantization: u8 `data` and `scales` and a float `dst` of the
    /// given shapes (`[dst, data]` and `scale_shape`), `dst` overlapping neither.
    fn check_plane(
        &self,
        what: &'static str,
        [data, scales, dst]: [View; 3],
        [dst_shape, data_shape]: [[usize; 2]; 2],
        scale_shape: [usize; 2],
    ) -> Result<()> {
        check_dtype(what, data, DType::U8)?;
        check_dtype(what, scales, DType::U8)?;
        check_float(what, dst)?;
        let [dst_len, data_len, scales_len] =
            [dst_shape, data_shape, scale_shape].map(|[r, c]| shape_len(what, r, c));
        check_len(what, dst.len(), dst_len?)?;
        check_len(what, data.len(), data_len?)?;
        check_len(what, scales.len(), scales_len?)?;
        self.check_views(what, &[data, scales], &[dst])
    }

    /// Reads a validated plane to the host (a host fallback of `what` on a GPU).
    fn read_plane(
        &mut self,
        what: &'static str,
        [data, scales]: [View; 2],
        data_shape: [usize; 2],
        scale_shape: [usize; 2],
    ) -> Result<QuantPlane> {
        self.note_fallback(what);
        Ok(QuantPlane {
            data: self.read_bytes(data)?,
            data_shape,
            scales: self.read_bytes(scales)?,
            scale_shape,
        })
    }
}

/// The global amaxes of a [`Device::nvfp4_finish_2d_many_deferred`] call, possibly still on
/// the device: [`Device::read_amaxes`] returns them. Dropping it drops the values (device
/// memory is freed in stream order).
#[derive(Debug)]
pub struct PendingAmaxes(pub(super) Pending);

/// The global amaxes of a [`Device::quantize_nvfp4_deferred`] call, possibly still on the
/// device: [`Device::read_nvfp4_amaxes`] returns them. Dropping it drops the values (device
/// memory is freed in stream order).
#[derive(Debug)]
pub struct PendingNvfp4Amax(PendingNvfp4);

#[derive(Debug)]
enum PendingNvfp4 {
    /// Already on the host (the CPU backend, the host fallback, the kernels of the variants).
    Values(Nvfp4Amax),
    /// One amax word on a CUDA device, both copies'.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::PendingWords),
}

#[derive(Debug)]
pub(super) enum Pending {
    /// Already on the host (the CPU backend, the host fallback, or no items).
    Values(Vec<f32>),
    /// One word per matrix on a CUDA device.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::PendingWords),
}
