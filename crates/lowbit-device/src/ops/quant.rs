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
fn check_overlap_sorted(what: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
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

/// 2D NVFP4 primary weights computed shard by shard (see `lowbit_formats::nvfp4::sharded`).
impl Device {
    /// Folds the magnitudes of `src` — elements `start ..` of a row-major matrix with `cols`
    /// columns — into the per-16x16-tile amaxes `tiles` (f32, in place, NaN ignored).
    pub fn nvfp4_fold_tile_amax_2d(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
    ) -> Result<()> {
        self.fold_tiles(
            "nvfp4_fold_tile_amax_2d",
            (src, start, cols, tiles, nvfp4::BLOCK),
            nvfp4::sharded::tile_count,
            nvfp4::sharded::fold_tile_amax_2d,
        )
    }

    /// Writes the packed codes of `src` (elements `start ..`, even start and length) into the
    /// u8 view `out` (`src.len() / 2` bytes), with the MAX-reduced tile amaxes `tiles`.
    pub fn nvfp4_quantize_2d_range(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
        out: View,
    ) -> Result<()> {
        self.count_call(crate::CountedOp::Nvfp4Quantize2dRange);
        self.quantize_range(
            "nvfp4_quantize_2d_range",
            (src, start, cols, tiles, out),
            nvfp4::sharded::tile_count,
            #[cfg(feature = "cuda")]
            crate::cuda::Range2d::Nvfp4,
            |v, t, b| nvfp4::sharded::quantize_2d_range(v, start, cols, t, b),
        )
    }

    /// Completes gathered 2D NVFP4 weights: from the rowwise bytes `out.rowwise.0` (already in
    /// place) and the reduced tile amaxes, writes the rowwise scales and the whole columnwise
    /// copy, and returns the global amax.
    pub fn nvfp4_finish_2d(
        &mut self,
        rows: usize,
        cols: usize,
        tiles: View,
        out: &Nvfp4Views,
    ) -> Result<f32> {
        const WHAT: &str = "nvfp4_finish_2d";
        self.count_call(crate::CountedOp::Nvfp4Finish2d);
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return Err(invalid(WHAT, "both copies are needed"));
        };
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && let Some(amax) = g.nvfp4_finish_2d_kernel(rows, cols, tiles, [rd, rs, cd, cs])?
        {
            return Ok(amax);
        }
        let t: Vec<f32> = self.download(tiles)?;
        let rowwise = self.read_bytes(rd)?;
        self.note_fallback(WHAT);
        let tensor = nvfp4::sharded::from_rowwise_2d(rows, cols, rowwise, &t)?;
        let (Some(r), Some(c)) = (&tensor.rowwise, &tensor.columnwise) else {
            unreachable!("from_rowwise_2d builds both copies");
        };
        check_len(WHAT, rs.len(), r.scales.len())?;
        check_len(WHAT, cd.len(), c.data.len())?;
        check_len(WHAT, cs.len(), c.scales.len())?;
        self.write_bytes(rs, &r.scales)?;
        self.write_bytes(cd, &c.data)?;
        self.write_bytes(cs, &c.scales)?;
        Ok(tensor.amax_rowwise)
    }

    /// [`Device::nvfp4_finish_2d`] of every `(rows, cols, tiles, out)` of `items`, returning
    /// their global amaxes in order: the same bytes and amaxes as one call per item. On a GPU
    /// every item that the single op would complete with its kernel is done together (the
    /// amaxes in one launch, the matrices in two more per shape, one host read for all of them) instead
    /// of a launch sequence and a host round trip per item. When any item would fail alone or
    /// fall back to the host, the items run one by one through the single op (so its errors,
    /// in item order); when all are valid but one's output overlaps another item's views, the
    /// result would depend on the order: [`crate::DeviceError::Overlap`], nothing written.
    pub fn nvfp4_finish_2d_many(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
    ) -> Result<Vec<f32>> {
        let pending = self.finish_2d_many(items, false)?;
        self.read_amaxes(pending)
    }

    /// [`Device::nvfp4_finish_2d_many`] without reading the amaxes back yet: on a GPU they stay
    /// on the device until [`Device::read_amaxes`] (a copy and a stream synchronization), so a
    /// caller that completes several groups in a row synchronizes once for all of them instead
    /// of once per call, and the host keeps queueing work meanwhile. The same bytes and amaxes.
    pub fn nvfp4_finish_2d_many_deferred(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
    ) -> Result<PendingAmaxes> {
        self.finish_2d_many(items, true)
    }

    /// The amaxes of an [`Device::nvfp4_finish_2d_many_deferred`] call, in item order.
    ///
    /// # Errors
    /// [`crate::DeviceError::Unsupported`] for amaxes pending on another kind of device (a
    /// GPU's, read on the CPU backend); the device's own errors.
    pub fn read_amaxes(&mut self, pending: PendingAmaxes) -> Result<Vec<f32>> {
        let mut all = self.read_amaxes_many(vec![pending])?;
        Ok(all.pop().unwrap_or_default())
    }

    /// The amaxes of several [`Device::nvfp4_finish_2d_many_deferred`] calls, each in item
    /// order, the calls in the order given: on a GPU every copy is queued first and the stream
    /// synchronized once (one wait for all the groups `sync_params` completed, where reading
    /// them one by one waits once per group).
    ///
    /// # Errors
    /// As [`Device::read_amaxes`]; nothing is returned for any call when one fails.
    pub fn read_amaxes_many(&mut self, pending: Vec<PendingAmaxes>) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Option<Vec<f32>>> = Vec::with_capacity(pending.len());
        #[cfg(feature = "cuda")]
        let mut on_device = Vec::new();
        for p in pending {
            match p.0 {
                Pending::Values(v) => out.push(Some(v)),
                #[cfg(feature = "cuda")]
                Pending::Device(words) => {
                    on_device.push(words);
                    out.push(None);
                }
            }
        }
        #[cfg(feature = "cuda")]
        if !on_device.is_empty() {
            let Some(g) = self.cuda_mut() else {
                return Err(crate::DeviceError::Unsupported(
                    "read_amaxes: the amaxes are on a CUDA device, this one is not".into(),
                ));
            };
            let mut read = g.read_pending_many(on_device)?.into_iter();
            for slot in out.iter_mut().filter(|s| s.is_none()) {
                *slot = read.next();
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// [`Device::nvfp4_finish_2d_many`]; with `defer`, a GPU leaves the amaxes on the device.
    fn finish_2d_many(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
        defer: bool,
    ) -> Result<PendingAmaxes> {
        const WHAT: &str = "nvfp4_finish_2d";
        #[cfg(not(feature = "cuda"))]
        let _ = defer;
        let mut checked = Vec::with_capacity(items.len());
        for (rows, cols, tiles, out) in items {
            match self.finish_2d_views(*rows, *cols, *tiles, out) {
                Some(v) => checked.push(([*rows, *cols], *tiles, v)),
                None => break,
            }
        }
        if checked.len() == items.len() {
            let ins: Vec<View> = checked.iter().flat_map(|(_, t, v)| [*t, v[0]]).collect();
            let outs: Vec<View> = checked
                .iter()
                .flat_map(|(_, _, v)| [v[1], v[2], v[3]])
                .collect();
            check_overlap_sorted(WHAT, &ins, &outs)?;
            #[cfg(feature = "cuda")]
            if let Some(g) = self.cuda_mut()
                && g.nvfp4_finish_version() != 1
                && let Some(done) = g.nvfp4_finish_2d_many(&checked, defer)?
            {
                for _ in items {
                    self.count_call(crate::CountedOp::Nvfp4Finish2d);
                }
                return Ok(PendingAmaxes(match done {
                    crate::cuda::Finished::Values(v) => Pending::Values(v),
                    crate::cuda::Finished::Pending(w) => Pending::Device(w),
                }));
            }
        }
        let values = items
            .iter()
            .map(|(rows, cols, tiles, out)| self.nvfp4_finish_2d(*rows, *cols, *tiles, out))
            .collect::<Result<Vec<f32>>>()?;
        Ok(PendingAmaxes(Pending::Values(values)))
    }

    /// The views `[rowwise data, rowwise scales, columnwise data, columnwise scales]` of a
    /// [`Device::nvfp4_finish_2d`] that its kernel takes and that cannot fail (both copies, u8
    /// views of the exact lengths, f32 tiles of the matrix's tile count, cols even and
    /// non-zero, rows non-zero, live views with disjoint outputs), else `None`.
    fn finish_2d_views(
        &self,
        rows: usize,
        cols: usize,
        tiles: View,
        out: &Nvfp4Views,
    ) -> Option<[View; 4]> {
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return None;
        };
        let (tr, tc) = (rows.div_ceil(16), cols.div_ceil(16));
        let len = |a: usize, b: usize| a.checked_mul(b);
        let ok = rows > 0
            && cols > 0
            && cols.is_multiple_of(2)
            && tiles.dtype() == DType::F32
            && Some(tiles.len()) == len(tr, tc)
            && [rd, rs, cd, cs].iter().all(|v| v.dtype() == DType::U8)
            && rd.len().checked_mul(2) == len(rows, cols)
            && Some(rs.len()) == len(rows, tc)
            && Some(cd.len()) == len(cols, rows.div_ceil(2))
            && Some(cs.len()) == len(cols, tr)
            && self
                .check_views("nvfp4_finish_2d", &[tiles, rd], &[rs, cd, cs])
                .is_ok();
        ok.then_some([rd, rs, cd, cs])
    }
}

/// 2D MXFP8 primary weights computed shard by shard (see `lowbit_formats::mxfp8::sharded`).
impl Device {
    /// Folds the magnitudes of `src` (elements `start ..` of a row-major matrix with `cols`
    /// columns) into the per-32x32-tile amaxes `tiles` (f32, in place, NaN ignored).
    pub fn mxfp8_fold_tile_amax_2d(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
    ) -> Result<()> {
        self.fold_tiles(
            "mxfp8_fold_tile_amax_2d",
            (src, start, cols, tiles, mxfp8::BLOCK),
            mxfp8::sharded::tile_count,
            mxfp8::sharded::fold_tile_amax_2d,
        )
    }

    /// Writes the fp8 codes of `src` (elements `start ..`) into the u8 view `out` (one byte
    /// each), with the MAX-reduced tile amaxes `tiles`.
    pub fn mxfp8_quantize_2d_range(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: View,
        out: View,
    ) -> Result<()> {
        self.count_call(crate::CountedOp::Mxfp8Quantize2dRange);
        self.quantize_range(
            "mxfp8_quantize_2d_range",
            (src, start, cols, tiles, out),
            mxfp8::sharded::tile_count,
            #[cfg(feature = "cuda")]
            crate::cuda::Range2d::Mxfp8(kind),
            |v, t, b| mxfp8::sharded::quantize_2d_range(v, start, cols, kind, t, b),
        )
    }

    /// Writes the rowwise and columnwise E8M0 scales of a 2D-quantized `rows × cols` matrix from
    /// its reduced tile amaxes.
    pub fn mxfp8_scales_2d(
        &mut self,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: View,
        row_scales: View,
        col_scales: View,
    ) -> Result<()> {
        const WHAT: &str = "mxfp8_scales_2d";
        self.count_call(crate::CountedOp::Mxfp8Scales2d);
        check_scales_2d(rows, cols, tiles, row_scales, col_scales)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.mxfp8_scales_2d([rows, cols], kind, tiles, [row_scales, col_scales])?
        {
            return Ok(());
        }
        // The tile count and both scale lengths were checked above (`check_scales_2d`).
        let t: Vec<f32> = self.download(tiles)?;
        self.note_fallback(WHAT);
        let (r, c) = mxfp8::sharded::scales_2d(rows, cols, kind, &t)?;
        self.write_bytes(row_scales, &r)?;
        self.write_bytes(col_scales, &c)
    }
}

/// The element counts of a `rows × cols` 2D MXFP8 matrix's tile amaxes, rowwise scales
/// (`[rows, ceil(cols/32)]`) and columnwise scales (`[ceil(rows/32), cols]`); `None` where one
/// passes `usize`.
pub(crate) fn scales_2d_lens(rows: usize, cols: usize) -> Option<[usize; 3]> {
    let (tr, tc) = (rows.div_ceil(32), cols.div_ceil(32));
    Some([
        tr.checked_mul(tc)?,
        rows.checked_mul(tc)?,
        tr.checked_mul(cols)?,
    ])
}

/// The lengths [`Device::mxfp8_scales_2d`] needs of a `rows × cols` matrix's views (tile
/// amaxes, rowwise and columnwise scales; their dtypes are the kernels' and the host copy's
/// concern), with shapes whose sizes pass `usize` named rather than wrapped.
fn check_scales_2d(rows: usize, cols: usize, tiles: View, rs: View, cs: View) -> Result<()> {
    const WHAT: &str = "mxfp8_scales_2d";
    let Some([nt, nr, nc]) = scales_2d_lens(rows, cols) else {
        return Err(invalid(
            WHAT,
            format!("a {rows}x{cols} matrix's scales exceed the address space"),
        ));
    };
    if tiles.len() != nt {
        return Err(invalid(
            WHAT,
            format!("{} tiles for {rows}x{cols}", tiles.len()),
        ));
    }
    check_len(WHAT, rs.len(), nr)?;
    check_len(WHAT, cs.len(), nc)
}

/// A format's sharded tile-amax fold (`lowbit_formats::{mxfp8,nvfp4}::sharded::fold_tile_amax_2d`).
type FoldTiles = fn(&[f32], usize, usize, &mut [f32]) -> Result<(), lowbit_formats::FormatError>;

/// Checks that `tiles` covers the flat range `start .. start + len` of a matrix with `cols`
/// columns (and that `cols > 0`), even an empty one: the formats' rule
/// ([`lowbit_formats::check_tile_cover`]), as this op's [`crate::DeviceError::Invalid`].
fn check_tiles_cover(
    what: &'static str,
    cover: (usize, usize, usize),
    tiles: View,
    tile_count: fn(usize, usize) -> usize,
) -> Result<()> {
    lowbit_formats::check_tile_cover(what, cover, tiles.len(), tile_count).map_err(|e| match e {
        lowbit_formats::FormatError::Unsupported { reason, .. } => invalid(what, reason),
        other => other.into(),
    })
}

/// The shared bodies of the sharded 2D ops: view checks, host round trip, the format's function.
impl Device {
    fn fold_tiles(
        &mut self,
        what: &'static str,
        (src, start, cols, tiles, tile): (View, usize, usize, View, usize),
        tile_count: fn(usize, usize) -> usize,
        fold: FoldTiles,
    ) -> Result<()> {
        check_float(what, src)?;
        check_dtype(what, tiles, DType::F32)?;
        self.check_views(what, &[src], &[tiles])?;
        check_tiles_cover(what, (start, src.len(), cols), tiles, tile_count)?;
        on_cuda!(self, g => g.fold_tile_amax((src, start, cols, tiles, tile)));
        #[cfg(not(feature = "cuda"))]
        let _ = tile;
        let values = self.read_f32(src)?;
        self.note_fallback(what);
        let mut t: Vec<f32> = self.download(tiles)?;
        fold(&values, start, cols, &mut t)?;
        self.upload(tiles, &t)
    }

    fn quantize_range(
        &mut self,
        what: &'static str,
        (src, start, cols, tiles, out): (View, usize, usize, View, View),
        tile_count: fn(usize, usize) -> usize,
        #[cfg(feature = "cuda")] format: crate::cuda::Range2d,
        quantize: impl FnOnce(&[f32], &[f32], &mut [u8]) -> Result<(), lowbit_formats::FormatError>,
    ) -> Result<()> {
        check_float(what, src)?;
        check_dtype(what, tiles, DType::F32)?;
        check_dtype(what, out, DType::U8)?;
        self.check_views(what, &[src, tiles], &[out])?;
        // The library indexes the tiles of every element (and divides by `cols`): a range they do
        // not cover is an error here, not a panic there.
        if !src.is_empty() {
            check_tiles_cover(what, (start, src.len(), cols), tiles, tile_count)?;
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.quantize_2d_range(format, (src, start, cols, tiles, out))?
        {
            return Ok(());
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (start, cols);
        let values = self.read_f32(src)?;
        self.note_fallback(what);
        let t: Vec<f32> = self.download(tiles)?;
        let mut bytes = vec![0u8; out.len()];
        quantize(&values, &t, &mut bytes)?;
        self.write_bytes(out, &bytes)
    }
}

/// The element format of a piece of a 2D-quantized matrix (see [`Piece2d`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format2d {
    /// 2D MXFP8: 32x32 tiles, one code byte per element of this kind.
    Mxfp8(Fp8Kind),
    /// 2D NVFP4: 16x16 tiles, two codes per byte.
    Nvfp4,
}

impl Format2d {
    fn tile_count(self) -> fn(usize, usize) -> usize {
        match self {
            Format2d::Mxfp8(_) => mxfp8::sharded::tile_count,
            Format2d::Nvfp4 => nvfp4::sharded::tile_count,
        }
    }
}

/// One piece of a batched 2D staging op: elements `start .. start + src.len()` of a row-major
/// matrix with `cols` columns, whose values are `bf16(src)` (`src` f32, bf16 or f16, rounded to
/// bf16 exactly as [`Device::cast`] rounds), and the f32 tile amaxes `tiles` of that matrix (an
/// NVFP4 expert's own run of tiles when `start` is within that expert).
#[derive(Clone, Copy, Debug)]
pub struct Piece2d {
    /// The format (tile size, codes).
    pub format: Format2d,
    /// The values (rounded to bf16 first).
    pub src: View,
    /// The piece's first element within the matrix.
    pub start: usize,
    /// The matrix's columns.
    pub cols: usize,
    /// The matrix's tile amaxes.
    pub tiles: View,
}

/// `bf16(x)` of every value, as [`Device::cast`] rounds f32 to bf16 (`half`'s `from_f32`).
fn round_bf16(dtype: DType, values: &mut [f32]) {
    if dtype != DType::Bf16 {
        for v in values {
            *v = bf16::from_f32(*v).to_f32();
        }
    }
}

/// Batched 2D staging: the fold and the quantization of many pieces of `bf16(master)`, one
/// launch each on a GPU, instead of a cast, a fold and a quantization per piece.
impl Device {
    /// For every piece in order, the format's tile-amax fold ([`Device::mxfp8_fold_tile_amax_2d`]
    /// or [`Device::nvfp4_fold_tile_amax_2d`]) of `bf16(src)`: the same tiles as those calls on
    /// a bf16 copy of each source. Every piece is validated as the single op validates it
    /// before anything is written; a source sharing a byte with any piece's tiles is
    /// [`crate::DeviceError::Overlap`] (pieces may share their tiles view: the fold is a max,
    /// so the order does not matter; tiles views that overlap without being equal are refused
    /// as overlapping outputs).
    pub fn fold_tile_amax_2d_bf16_many(&mut self, pieces: &[Piece2d]) -> Result<()> {
        const WHAT: &str = "fold_tile_amax_2d_bf16_many";
        for p in pieces {
            check_float(WHAT, p.src)?;
            check_dtype(WHAT, p.tiles, DType::F32)?;
            self.check_views(WHAT, &[p.src], &[p.tiles])?;
            let cover = (p.start, p.src.len(), p.cols);
            check_tiles_cover(WHAT, cover, p.tiles, p.format.tile_count())?;
        }
        let srcs: Vec<View> = pieces.iter().map(|p| p.src).collect();
        let mut tiles: Vec<View> = pieces.iter().map(|p| p.tiles).collect();
        tiles.sort_by_key(|t| (t.buffer(), t.byte_offset(), t.byte_len()));
        tiles.dedup_by_key(|t| (t.buffer(), t.byte_offset(), t.byte_len()));
        check_overlap_sorted(WHAT, &srcs, &tiles)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.stage2d_fold_many(pieces)?
        {
            return Ok(());
        }
        for p in pieces {
            let mut values = self.read_f32(p.src)?;
            round_bf16(p.src.dtype(), &mut values);
            self.note_fallback(WHAT);
            let mut t: Vec<f32> = self.download(p.tiles)?;
            match p.format {
                Format2d::Mxfp8(_) => {
                    mxfp8::sharded::fold_tile_amax_2d(&values, p.start, p.cols, &mut t)
                }
                Format2d::Nvfp4 => {
                    nvfp4::sharded::fold_tile_amax_2d(&values, p.start, p.cols, &mut t)
                }
            }?;
            self.upload(p.tiles, &t)?;
        }
        Ok(())
    }

    /// For every `(piece, out)` in order, the format's range quantization
    /// ([`Device::mxfp8_quantize_2d_range`] or [`Device::nvfp4_quantize_2d_range`]) of
    /// `bf16(src)` with the reduced tiles into the u8 view `out`: the same bytes as those calls
    /// on a bf16 copy of each source (an NVFP4 piece's global amax is the max of its tiles
    /// view, as there). Every item is validated first (as the single op, plus `out`'s length:
    /// one byte per element, or for NVFP4 an even start and length and a byte per two
    /// elements), then the items together (no output may share a byte with another output or
    /// any item's source or tiles: [`crate::DeviceError::Overlap`]); nothing is written on an
    /// error.
    pub fn quantize_2d_range_bf16_many(&mut self, items: &[(Piece2d, View)]) -> Result<()> {
        const WHAT: &str = "quantize_2d_range_bf16_many";
        for (p, out) in items {
            check_float(WHAT, p.src)?;
            check_dtype(WHAT, p.tiles, DType::F32)?;
            check_dtype(WHAT, *out, DType::U8)?;
            self.check_views(WHAT, &[p.src, p.tiles], &[*out])?;
            let n = p.src.len();
            if n != 0 {
                let cover = (p.start, n, p.cols);
                check_tiles_cover(WHAT, cover, p.tiles, p.format.tile_count())?;
            }
            let ok = match p.format {
                Format2d::Mxfp8(_) => out.len() == n,
                Format2d::Nvfp4 => {
                    p.start.is_multiple_of(2) && n.is_multiple_of(2) && out.len() * 2 == n
                }
            };
            if !ok {
                return Err(invalid(
                    WHAT,
                    format!(
                        "{} output bytes for {n} elements from {} ({:?})",
                        out.len(),
                        p.start,
                        p.format
                    ),
                ));
            }
        }
        let ins: Vec<View> = items.iter().flat_map(|(p, _)| [p.src, p.tiles]).collect();
        let outs: Vec<View> = items.iter().map(|(_, o)| *o).collect();
        check_overlap_sorted(WHAT, &ins, &outs)?;
        for (p, _) in items {
            self.count_call(match p.format {
                Format2d::Mxfp8(_) => crate::CountedOp::Mxfp8Quantize2dRange,
                Format2d::Nvfp4 => crate::CountedOp::Nvfp4Quantize2dRange,
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.stage2d_quantize_many(items)?
        {
            return Ok(());
        }
        for (p, out) in items {
            let mut values = self.read_f32(p.src)?;
            round_bf16(p.src.dtype(), &mut values);
            self.note_fallback(WHAT);
            let t: Vec<f32> = self.download(p.tiles)?;
            let mut bytes = vec![0u8; out.len()];
            let (start, cols) = (p.start, p.cols);
            match p.format {
                Format2d::Mxfp8(kind) => {
                    mxfp8::sharded::quantize_2d_range(&values, start, cols, kind, &t, &mut bytes)
                }
                Format2d::Nvfp4 => {
                    nvfp4::sharded::quantize_2d_range(&values, start, cols, &t, &mut bytes)
                }
            }?;
            self.write_bytes(*out, &bytes)?;
        }
        Ok(())
    }

    /// [`Device::mxfp8_scales_2d`] of every `(rows, cols, kind, tiles, row_scales, col_scales)`
    /// of `items`: on a GPU, every item its kernel takes in one launch. The same bytes as one
    /// call per item when no item's scales share a byte with another item's views (else
    /// [`crate::DeviceError::Overlap`], nothing written); an item the kernel does not take runs
    /// through the single op.
    ///
    /// On a GPU, calls that repeat (the step's bucket groups, every step) are prepared: the
    /// second call with exactly the items of an earlier one that the kernel took whole makes
    /// a CUDA graph of each of its launches (the table in the node's parameters), and later
    /// calls with those items launch the graphs after checking only that the buffers they
    /// point into are still allocated: the other checks are functions of the items, which
    /// passed them then. The same bytes as a fresh call.
    pub fn mxfp8_scales_2d_many(
        &mut self,
        items: &[(usize, usize, Fp8Kind, View, View, View)],
    ) -> Result<()> {
        const WHAT: &str = "mxfp8_scales_2d";
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.mxfp8_scales_2d_prepared(items)?
        {
            for _ in items {
                self.count_call(crate::CountedOp::Mxfp8Scales2d);
            }
            return Ok(());
        }
        // Every item's shape before anything is written: a bad item fails the call whole.
        for &(rows, cols, _, tiles, rs, cs) in items {
            check_scales_2d(rows, cols, tiles, rs, cs)?;
        }
        let ins: Vec<View> = items.iter().map(|i| i.3).collect();
        let outs: Vec<View> = items.iter().flat_map(|i| [i.4, i.5]).collect();
        check_overlap_sorted(WHAT, &ins, &outs)?;
        #[cfg(feature = "cuda")]
        let rest: Vec<usize> = match self.cuda_mut() {
            Some(g) => g.mxfp8_scales_2d_many(items)?,
            None => (0..items.len()).collect(),
        };
        #[cfg(not(feature = "cuda"))]
        let rest: Vec<usize> = (0..items.len()).collect();
        let taken = items.len() - rest.len();
        for _ in 0..taken {
            self.count_call(crate::CountedOp::Mxfp8Scales2d);
        }
        for i in rest {
            let (rows, cols, kind, tiles, rs, cs) = items[i];
            self.mxfp8_scales_2d(rows, cols, kind, tiles, rs, cs)?;
        }
        Ok(())
    }
}

/// One matrix of [`Device::mxfp8_scales_2d_many`]: `(rows, cols, kind, tiles, row_scales,
/// col_scales)` (the key of its prepared calls on a GPU).
#[cfg(feature = "cuda")]
pub(crate) type Scales2dItem = (usize, usize, Fp8Kind, View, View, View);

/// The global amaxes of a [`Device::nvfp4_finish_2d_many_deferred`] call, possibly still on
/// the device: [`Device::read_amaxes`] returns them. Dropping it drops the values (device
/// memory is freed in stream order).
#[derive(Debug)]
pub struct PendingAmaxes(Pending);

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
enum Pending {
    /// Already on the host (the CPU backend, the host fallback, or no items).
    Values(Vec<f32>),
    /// One word per matrix on a CUDA device.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::PendingWords),
}
