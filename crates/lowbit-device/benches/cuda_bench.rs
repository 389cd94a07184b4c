//! GPU timings of the hot CUDA kernels against a device-to-device copy measured in the same run
//! (`cargo bench -p lowbit-device --features cuda --bench cuda_bench -- [SECTION...]`;
//! sections `launch`, `mxfp8`, `nvfp4`, `optim`, all by default).
//!
//! - `launch`: the host's time to enqueue a one-kernel op with scalar parameters and one with a
//!   parameter table (`mxfp8_scales_2d_many`, 1 to 64 tiny matrices), and the whole round trip
//!   of two synchronous calls on tiny inputs (`max_abs`, `quantize_nvfp4`).
//! - MXFP8 rowwise and rowwise + columnwise (one pass) of a 16384x16384 bf16 matrix: bytes moved
//!   (read 2, write 1 + 1/32 per element per copy) over time, as a fraction of the copy
//!   bandwidth (a copy of the same bf16 matrix: read + write).
//! - `mxfp8x.cu`'s bf16 -> E4M3 2D both copies and columnwise-only, per kernel version, against
//!   the same bound.
//! - The same both-copies quantization of the weight matrices of one and of all 16 layers of
//!   Llama-3.2-1B (the re-quantization after a parameter all-gather), one call per matrix and
//!   one `quantize_mxfp8_many`, against the same bound.
//! - The 2D MXFP8 re-quantization (`mxfp8_scales_2d_many`) of those 112 matrices, in one call and
//!   in calls of 28 (a 250M-element bucket group of the step).
//! - NVFP4 (the bf16 amax pass alone, then rowwise and both copies with it), per kernel version;
//!   the completion of gathered 2D NVFP4 weights (`nvfp4_finish_2d_many`) for 1B's 112 matrices
//!   and one 32768² matrix per version, deferred (the amax read outside the timing), and in
//!   deferred groups of 28 with one read (as the step's `sync_params`).
//! - The blocked f64 sum of squares of a 1 GiB f32 gradient (the grad norm), and of the same
//!   bytes read as bf16.
//! - Fused AdamW over 256M parameters (f32 master, f32 moments, f32 or bf16 grad, bf16 output:
//!   30 or 28 bytes per parameter) against the same bound, per kernel version.
//!
//! Times are medians of CUDA-event timings on the device's stream after warm-up, each of one call
//! from an idle GPU ("lone call": what a single synchronous call costs); rows marked "steady
//! state" time calls back to back (deferred amaxes read once at the end) against a copy timed
//! the same way, what the calls cost where a step issues them in a row. Prints one line per
//! measurement and `JSON {...}` lines for machines.

use lowbit_device::{AdamW, DType, Device, Mxfp8Config, Mxfp8Views, Nvfp4Config, Nvfp4Views, bf16};
use lowbit_formats::Copies;

/// Seconds between events recorded on the device's stream before and after `f` (waits for the
/// second).
fn event_span(dev: &mut Device, f: impl FnOnce(&mut Device)) -> f64 {
    use lowbit_device::cudarc::driver::sys::CUevent_flags;
    let stream = dev.cuda_stream().expect("a CUDA device").clone();
    let a = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    f(dev);
    let b = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    b.synchronize().expect("event sync");
    f64::from(a.elapsed_ms(&b).expect("elapsed")) * 1e-3
}

/// Median seconds of `reps` runs of `f`, timed with events on the device's stream.
fn timed(dev: &mut Device, reps: usize, mut f: impl FnMut(&mut Device)) -> f64 {
    for _ in 0..3 {
        f(dev);
    }
    dev.synchronize().expect("warm-up");
    let mut times: Vec<f64> = (0..reps).map(|_| event_span(dev, &mut f)).collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Seconds per call in steady state: `calls` calls of `f` back to back with no wait between
/// them (the host queues the next call while the GPU runs this one, as a training step issues
/// them), then `finish` with what they returned (one read of deferred results), timed with
/// events from before the first call to after `finish`; the median of five such runs. `f` must
/// not wait for the device itself.
fn timed_steady<T>(
    dev: &mut Device,
    calls: usize,
    mut f: impl FnMut(&mut Device) -> T,
    mut finish: impl FnMut(&mut Device, Vec<T>),
) -> f64 {
    let warm: Vec<T> = (0..3).map(|_| f(dev)).collect();
    finish(dev, warm);
    dev.synchronize().expect("warm-up");
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let span = event_span(dev, |d| {
                let out: Vec<T> = (0..calls).map(|_| f(d)).collect();
                finish(d, out);
            });
            span / calls as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[2]
}

/// Elements `at .. at + len` of `b`.
fn piece(b: lowbit_device::View, at: usize, len: usize) -> lowbit_device::View {
    b.slice(at..at + len).expect("slice")
}

fn report(name: &str, secs: f64, bytes: f64, copy_bw: f64) {
    let bw = bytes / secs;
    println!(
        "{name}: {:.1} us, {:.0} GB/s = {:.2}x copy",
        secs * 1e6,
        bw / 1e9,
        bw / copy_bw
    );
    println!(
        "JSON {{\"name\":\"{name}\",\"us\":{:.1},\"gbps\":{:.1},\"x_copy\":{:.3}}}",
        secs * 1e6,
        bw / 1e9,
        bw / copy_bw
    );
}

/// Fresh output buffers for `copies` of an MXFP8 quantization of `elems` elements whose
/// dimensions are multiples of 32 (codes, and one scale byte per 32 elements, per copy).
fn alloc_views(dev: &mut Device, copies: Copies, elems: usize) -> Mxfp8Views {
    let mut copy = || {
        (
            dev.alloc(DType::U8, elems),
            dev.alloc(DType::U8, elems / 32),
        )
    };
    Mxfp8Views {
        rowwise: copies.rowwise().then(&mut copy),
        columnwise: copies.columnwise().then(&mut copy),
    }
}

/// Frees the buffers of [`alloc_views`].
fn free_views(dev: &mut Device, out: Mxfp8Views) {
    for (a, b) in [out.rowwise, out.columnwise].into_iter().flatten() {
        dev.free(a).expect("free");
        dev.free(b).expect("free");
    }
}

/// The weight matrices (rows, cols) of one Llama-3.2-1B layer: q, k, v, o, gate, up, down.
const LLAMA_1B_LAYER: [(usize, usize); 7] = [
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (8192, 2048),
    (8192, 2048),
    (2048, 8192),
];

/// Times the MXFP8 both-copies re-quantization of `layers` Llama-3.2-1B layers, one
/// `quantize_mxfp8` per matrix and one `quantize_mxfp8_many`, against the copy bandwidth: the
/// sources are consecutive views of one bf16 buffer (filled from `x`), the outputs consecutive
/// views of one buffer per data and scale copy, as a staged storage lays them out.
fn llama_requantize(dev: &mut Device, x: lowbit_device::View, layers: usize, copy_bw: f64) {
    let shapes: Vec<(usize, usize)> = (0..layers).flat_map(|_| LLAMA_1B_LAYER).collect();
    let elems: usize = shapes.iter().map(|(r, c)| r * c).sum();
    let src = dev.alloc(DType::Bf16, elems);
    let mut at = 0;
    while at < elems {
        let n = x.len().min(elems - at);
        let part = src.slice(at..at + n).expect("slice");
        dev.copy(x.slice(0..n).expect("slice"), part).expect("copy");
        at += n;
    }
    // Every shape has rows and cols multiples of 32, so the scales are elems / 32 per copy.
    let bufs = [elems, elems / 32, elems, elems / 32].map(|n| dev.alloc(DType::U8, n));
    let (mut e, mut k) = (0, 0);
    let items: Vec<(lowbit_device::View, usize, usize, Mxfp8Views)> = shapes
        .iter()
        .map(|&(rows, cols)| {
            let n = rows * cols;
            let out = Mxfp8Views {
                rowwise: Some((piece(bufs[0], e, n), piece(bufs[1], k, n / 32))),
                columnwise: Some((piece(bufs[2], e, n), piece(bufs[3], k, n / 32))),
            };
            let item = (src.slice(e..e + n).expect("slice"), rows, cols, out);
            (e, k) = (e + n, k + n / 32);
            item
        })
        .collect();
    let cfg = Mxfp8Config::default();
    let bytes = elems as f64 * (2.0 + 2.0 * (1.0 + 1.0 / 32.0));
    let what = format!(
        "mxfp8 rowwise+columnwise Llama-3.2-1B x{layers} layers ({} matrices",
        items.len()
    );
    let reps = if layers > 1 { 20 } else { 50 };
    let t = timed(dev, reps, |d| {
        for (s, rows, cols, out) in &items {
            d.quantize_mxfp8(*s, *rows, *cols, &cfg, out)
                .expect("quantize");
        }
    });
    report(&format!("{what}, one call each)"), t, bytes, copy_bw);
    for many in [1, 2] {
        dev.set_cuda_kernel_variant("mxfp8_many", many)
            .expect("variant");
        let t = timed(dev, reps, |d| {
            d.quantize_mxfp8_many(&items, &cfg).expect("quantize many")
        });
        report(
            &format!("{what}, quantize_mxfp8_many v{many})"),
            t,
            bytes,
            copy_bw,
        );
    }
    dev.free(src).expect("free");
    for b in bufs {
        dev.free(b).expect("free");
    }
}

/// Times the 2D MXFP8 re-quantization after a gather (`mxfp8_scales_2d_many`: both scale copies
/// of every matrix from its 32x32 tile amaxes) for 16 Llama-3.2-1B layers (112 matrices), in
/// one call and in groups of 28 (four layers, as the step's 250M-element bucket groups), against
/// the copy bandwidth: reads the tile amaxes (4 bytes per 1024 elements), writes one scale byte
/// per 32 elements per copy.
fn llama_mxfp8_scales_2d(dev: &mut Device, copy_bw: f64, steady_bw: f64) {
    let shapes: Vec<(usize, usize)> = (0..16).flat_map(|_| LLAMA_1B_LAYER).collect();
    let elems: usize = shapes.iter().map(|(r, c)| r * c).sum();
    let tiles = dev.alloc(DType::F32, elems / 1024);
    dev.fill(tiles, 0.75).expect("fill");
    let scales = [elems / 32, elems / 32].map(|n| dev.alloc(DType::U8, n));
    let (mut e, mut t) = (0, 0);
    let items: Vec<_> = shapes
        .iter()
        .map(|&(rows, cols)| {
            let n = rows * cols;
            let item = (
                rows,
                cols,
                lowbit_device::Fp8Kind::E4M3,
                piece(tiles, t, n / 1024),
                piece(scales[0], e / 32, n / 32),
                piece(scales[1], e / 32, n / 32),
            );
            (e, t) = (e + n, t + n / 1024);
            item
        })
        .collect();
    let bytes = elems as f64 * (2.0 / 32.0 + 4.0 / 1024.0);
    // Fresh calls (every call checks its items and passes its table as parameters), then
    // prepared ones (the same items again: the graph of the first call's launch).
    for (prepared, how) in [(0, "fresh"), (1, "prepared")] {
        dev.set_cuda_kernel_variant("prepared", prepared)
            .expect("variant");
        for group in [112, 28] {
            let t = timed(dev, 20, |d| {
                for g in items.chunks(group) {
                    d.mxfp8_scales_2d_many(g).expect("scales");
                }
            });
            report(
                &format!(
                    "mxfp8 2D scales, Llama-3.2-1B x16 layers (112 matrices, calls of {group}, mxfp8_scales_2d_many, {how})"
                ),
                t,
                bytes,
                copy_bw,
            );
            // Steady state: 20 such rounds back to back (the host's checks of one round beside
            // the kernels of the one before).
            let t = timed_steady(
                dev,
                20,
                |d| {
                    for g in items.chunks(group) {
                        d.mxfp8_scales_2d_many(g).expect("scales");
                    }
                },
                |_, _| {},
            );
            report(
                &format!(
                    "mxfp8 2D scales, Llama-3.2-1B x16 layers (112 matrices, calls of {group}, mxfp8_scales_2d_many, {how}, steady state)"
                ),
                t,
                bytes,
                steady_bw,
            );
            // The host's share: the calls' checks, tables and launches, timed on the host from an
            // idle GPU (which stays idle until the first launch: in the times above, that part
            // runs beside no kernel).
            let mut host: Vec<f64> = (0..20)
                .map(|_| {
                    dev.synchronize().expect("sync");
                    let t0 = std::time::Instant::now();
                    for g in items.chunks(group) {
                        dev.mxfp8_scales_2d_many(g).expect("scales");
                    }
                    t0.elapsed().as_secs_f64()
                })
                .collect();
            host.sort_by(f64::total_cmp);
            println!(
                "mxfp8 2D scales, calls of {group}, {how}: host time to enqueue {:.1} us",
                host[host.len() / 2] * 1e6
            );
        }
    }
    dev.free(tiles).expect("free");
    for b in scales {
        dev.free(b).expect("free");
    }
}

/// Times the completion of gathered 2D NVFP4 weights for 16 Llama-3.2-1B layers (112
/// matrices, one `nvfp4_finish_2d_many` per version: 5 one launch per shape over 512x512
/// blocks, 4 over 256x256 tiles, 3 two (codes, then scales)) and for one 32768x32768 matrix, against the copy
/// bandwidth: reads the rowwise codes (n/2 bytes) and the tile amaxes (n/64), writes the
/// columnwise codes (n/2) and both scale copies (n/16 each).
fn llama_nvfp4_finish(dev: &mut Device, copy_bw: f64, steady_bw: f64) {
    let shapes: Vec<(usize, usize)> = (0..16).flat_map(|_| LLAMA_1B_LAYER).collect();
    nvfp4_finish(
        dev,
        [copy_bw, steady_bw],
        &shapes,
        "Llama-3.2-1B x16 layers (112 matrices",
    );
    // One large square matrix (1.2 GB moved, so the call's fixed costs weigh little): whether
    // the gap to the bound is the kernel's or the shapes'.
    nvfp4_finish(
        dev,
        [copy_bw, steady_bw],
        &[(32768, 32768)],
        "32768x32768 (one matrix",
    );
}

/// Times `nvfp4_finish_2d_many` over matrices of `shapes` (every version) against the copy
/// bandwidth (`[lone call, steady state]`); `what` names them in the report.
fn nvfp4_finish(
    dev: &mut Device,
    [copy_bw, steady_bw]: [f64; 2],
    shapes: &[(usize, usize)],
    what: &str,
) {
    let elems: usize = shapes.iter().map(|(r, c)| r * c).sum();
    let packed = dev.alloc(DType::U8, elems / 2);
    dev.zero(packed).expect("zero");
    let tiles = dev.alloc(DType::F32, elems / 256);
    dev.fill(tiles, 0.75).expect("fill");
    let bufs = [elems / 16, elems / 2, elems / 16].map(|n| dev.alloc(DType::U8, n));
    let (mut e, mut t) = (0, 0);
    let items: Vec<(usize, usize, lowbit_device::View, Nvfp4Views)> = shapes
        .iter()
        .map(|&(rows, cols)| {
            let n = rows * cols;
            let out = Nvfp4Views {
                rowwise: Some((piece(packed, e / 2, n / 2), piece(bufs[0], e / 16, n / 16))),
                columnwise: Some((piece(bufs[1], e / 2, n / 2), piece(bufs[2], e / 16, n / 16))),
            };
            let item = (rows, cols, piece(tiles, t, n / 256), out);
            (e, t) = (e + n, t + n / 256);
            item
        })
        .collect();
    let bytes = elems as f64 * (0.5 + 1.0 / 64.0 + 0.5 + 2.0 / 16.0);
    for version in [7, 5, 4, 3] {
        dev.set_cuda_kernel_variant("nvfp4_finish_2d", version)
            .expect("variant");
        let t = timed(dev, 20, |d| {
            d.nvfp4_finish_2d_many(&items).expect("finish");
        });
        report(
            &format!("nvfp4 2D completion {what}, nvfp4_finish_2d_many v{version})"),
            t,
            bytes,
            copy_bw,
        );
    }
    // The same call deferred, its amaxes read after the timed span: the launches alone, without
    // the read's copy and stream synchronization (the step reads once per `sync_params`).
    {
        dev.set_cuda_kernel_variant("nvfp4_finish_2d", 7)
            .expect("variant");
        let mut pending = Vec::new();
        let t = timed(dev, 20, |d| {
            pending.push(d.nvfp4_finish_2d_many_deferred(&items).expect("finish"));
        });
        for p in pending {
            dev.read_amaxes(p).expect("amaxes");
        }
        report(
            &format!(
                "nvfp4 2D completion {what}, deferred: the read outside the timing, nvfp4_finish_2d_many v7)"
            ),
            t,
            bytes,
            copy_bw,
        );
    }
    // Steady state: 10 deferred calls back to back, one read of all their amaxes.
    {
        dev.set_cuda_kernel_variant("nvfp4_finish_2d", 7)
            .expect("variant");
        let t = timed_steady(
            dev,
            10,
            |d| d.nvfp4_finish_2d_many_deferred(&items).expect("finish"),
            |d, pending| {
                d.read_amaxes_many(pending).expect("amaxes");
            },
        );
        report(
            &format!(
                "nvfp4 2D completion {what}, deferred, steady state, nvfp4_finish_2d_many v7)"
            ),
            t,
            bytes,
            steady_bw,
        );
    }
    // As the step's gather completes bucket groups: one deferred call per group of 28 matrices
    // (four 1B layers, a 250M-element bucket), one read of every group's amaxes at the end.
    for version in [7, 5].into_iter().filter(|_| items.len() > 28) {
        dev.set_cuda_kernel_variant("nvfp4_finish_2d", version)
            .expect("variant");
        let t = timed(dev, 20, |d| {
            let pending: Vec<_> = items
                .chunks(28)
                .map(|g| d.nvfp4_finish_2d_many_deferred(g).expect("finish"))
                .collect();
            d.read_amaxes_many(pending).expect("amaxes");
        });
        report(
            &format!(
                "nvfp4 2D completion {what}, groups of 28 deferred, one read, nvfp4_finish_2d_many v{version})"
            ),
            t,
            bytes,
            copy_bw,
        );
    }
    dev.free(packed).expect("free");
    dev.free(tiles).expect("free");
    for b in bufs {
        dev.free(b).expect("free");
    }
}

/// Host time to enqueue one call (the mean of 200, the GPU idle before): a one-kernel op with
/// a few scalar parameters (`fill`) against `mxfp8_scales_2d_many` (2.1 KB of parameters up to
/// 32 matrices, else 8.2 KB) with 1, 28 and 64 tiny matrices: what a launch with a parameter table costs the host beside its
/// checks.
fn launch_costs(dev: &mut Device) {
    let v = dev.alloc(DType::F32, 1024);
    let tiles = dev.alloc(DType::F32, 64);
    let scales = [
        dev.alloc(DType::U8, 64 * 1024),
        dev.alloc(DType::U8, 64 * 1024),
    ];
    let items: Vec<_> = (0..64)
        .map(|k| {
            (
                32,
                32,
                lowbit_device::Fp8Kind::E4M3,
                piece(tiles, k, 1),
                piece(scales[0], 32 * k, 32),
                piece(scales[1], 32 * k, 32),
            )
        })
        .collect();
    // A tiny NVFP4 input for the synchronous calls below.
    let xb = dev.alloc(DType::Bf16, 64 * 64);
    dev.fill(xb, 0.5).expect("fill");
    let planes = [0; 4].map(|_| dev.alloc(DType::U8, 64 * 32));
    let nv = Nvfp4Views {
        rowwise: Some((planes[0], piece(planes[1], 0, 64 * 4))),
        columnwise: Some((planes[2], piece(planes[3], 0, 64 * 4))),
    };
    let cfg = Nvfp4Config::default();
    let per_call = |dev: &mut Device, name: &str, f: &mut dyn FnMut(&mut Device)| {
        dev.synchronize().expect("sync");
        let t0 = std::time::Instant::now();
        for _ in 0..200 {
            f(dev);
        }
        let us = t0.elapsed().as_secs_f64() / 200.0 * 1e6;
        dev.synchronize().expect("sync");
        println!("host time to enqueue {name}: {us:.2} us per call");
    };
    per_call(dev, "fill (one launch, 3 scalar parameters)", &mut |d| {
        d.fill(v, 1.0).expect("fill")
    });
    for n in [1, 28, 64] {
        dev.set_cuda_kernel_variant("prepared", 0).expect("variant");
        per_call(
            dev,
            &format!(
                "mxfp8_scales_2d_many of {n} 32x32 matrices (one launch, {} KB parameters)",
                if n <= 32 { "2.1" } else { "8.2" }
            ),
            &mut |d| d.mxfp8_scales_2d_many(&items[..n]).expect("scales"),
        );
        dev.set_cuda_kernel_variant("prepared", 1).expect("variant");
        per_call(
            dev,
            &format!("mxfp8_scales_2d_many of {n} 32x32 matrices (prepared: its graph)"),
            &mut |d| d.mxfp8_scales_2d_many(&items[..n]).expect("scales"),
        );
    }
    // Synchronous calls that return a value: the whole round trip per call (the host's checks
    // and enqueue, the kernels on a tiny input, the copy back and the wait), so what a call costs
    // beyond its kernels.
    per_call(
        dev,
        "max_abs of 1024 f32 (synchronous: one launch, one word back)",
        &mut |d| {
            d.max_abs(v).expect("max_abs");
        },
    );
    per_call(
        dev,
        "quantize_nvfp4 both copies of 64x64 bf16 (synchronous: four launches, the amax back)",
        &mut |d| {
            d.quantize_nvfp4(xb, 64, 64, &cfg, &nv).expect("nvfp4");
        },
    );
    for b in [v, tiles, scales[0], scales[1], xb]
        .into_iter()
        .chain(planes)
    {
        dev.free(b).expect("free");
    }
}

fn main() {
    // Sections to run (`launch`, `mxfp8`, `nvfp4`, `optim`: the sums of squares and AdamW); all
    // if none.
    // (`--bench` is what `cargo bench` passes to every bench target.)
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let want = |s: &str| only.is_empty() || only.iter().any(|o| o == s);
    let mut dev = Device::cuda(0).unwrap_or_else(|e| {
        eprintln!("cuda_bench: needs a CUDA GPU: {e}");
        std::process::exit(2)
    });
    let n = 16384usize;
    let elems = n * n;
    // Random-ish bf16 input (a cheap generator; the values only need a spread of exponents).
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let host: Vec<bf16> = (0..elems)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((s % 16) as i32 - 8),
            )
        })
        .collect();
    let x = dev.alloc(DType::Bf16, elems);
    dev.upload(x, &host).expect("upload");
    drop(host);
    let copy_dst = dev.alloc(DType::Bf16, elems);
    let t_copy = timed(&mut dev, 50, |d| d.copy(x, copy_dst).expect("copy"));
    let copy_bw = (2 * elems * 2) as f64 / t_copy;
    println!(
        "copy bf16 {n}x{n}: {:.1} us, {:.0} GB/s (read + write)",
        t_copy * 1e6,
        copy_bw / 1e9
    );
    println!(
        "JSON {{\"name\":\"copy\",\"us\":{:.1},\"gbps\":{:.1},\"x_copy\":1.0}}",
        t_copy * 1e6,
        copy_bw / 1e9
    );
    // The same copy in steady state (20 back to back): the bound of the steady-state rows.
    let t_copy_steady = timed_steady(
        &mut dev,
        20,
        |d| d.copy(x, copy_dst).expect("copy"),
        |_, _| {},
    );
    let steady_bw = (2 * elems * 2) as f64 / t_copy_steady;
    println!(
        "copy bf16 {n}x{n}, steady state: {:.1} us, {:.0} GB/s (read + write)",
        t_copy_steady * 1e6,
        steady_bw / 1e9
    );
    dev.free(copy_dst).expect("free");

    if want("launch") {
        launch_costs(&mut dev);
    }
    if want("mxfp8") {
        for (copies, version) in [
            (Copies::Rowwise, 4),
            (Copies::Both, 1),
            (Copies::Both, 4),
            (Copies::Both, 5),
        ] {
            dev.set_cuda_kernel_variant("mxfp8_both", version)
                .expect("variant");
            let out = alloc_views(&mut dev, copies, elems);
            let cfg = Mxfp8Config {
                copies,
                ..Mxfp8Config::default()
            };
            let t = timed(&mut dev, 50, |d| {
                d.quantize_mxfp8(x, n, n, &cfg, &out).expect("quantize")
            });
            let per_copy = 1.0 + 1.0 / 32.0;
            let copies_n = if copies == Copies::Both { 2.0 } else { 1.0 };
            let bytes = elems as f64 * (2.0 + copies_n * per_copy);
            report(
                &if copies == Copies::Both {
                    format!("mxfp8 rowwise+columnwise 16384x16384 (kernel v{version})")
                } else {
                    "mxfp8 rowwise 16384x16384".to_string()
                },
                t,
                bytes,
                copy_bw,
            );
            if copies == Copies::Both && version == 4 {
                let t = timed_steady(
                    &mut dev,
                    20,
                    |d| d.quantize_mxfp8(x, n, n, &cfg, &out).expect("quantize"),
                    |_, _| {},
                );
                report(
                    "mxfp8 rowwise+columnwise 16384x16384 (kernel v4, steady state)",
                    t,
                    bytes,
                    steady_bw,
                );
            }
            free_views(&mut dev, out);
        }
        // The same both-copies kernel (v4) on matrices of 128M elements and the widths of the
        // Llama weights (2048 and 8192 columns) against 16384: whether the re-quantization's lower
        // rate (many 1B matrices) comes from their shapes rather than from the many-matrix launch.
        dev.set_cuda_kernel_variant("mxfp8_both", 4)
            .expect("variant");
        for (rows, cols) in [(65536, 2048), (16384, 8192), (8192, 16384)] {
            let m = rows * cols;
            let src = x.slice(0..m).expect("slice");
            let out = alloc_views(&mut dev, Copies::Both, m);
            let cfg = Mxfp8Config::default();
            let t = timed(&mut dev, 50, |d| {
                d.quantize_mxfp8(src, rows, cols, &cfg, &out)
                    .expect("quantize")
            });
            let bytes = m as f64 * (2.0 + 2.0 * (1.0 + 1.0 / 32.0));
            report(
                &format!("mxfp8 rowwise+columnwise {rows}x{cols} (kernel v4)"),
                t,
                bytes,
                copy_bw,
            );
            free_views(&mut dev, out);
        }
        // The many-matrix kernel on two such matrices (64M elements each): the same large shapes
        // as above through `quantize_mxfp8_many`, to tell its code from the small matrices' cost.
        {
            let shapes = [(32768, 2048), (8192, 8192)];
            let mut items = Vec::new();
            let mut at = 0;
            for (rows, cols) in shapes {
                let m = rows * cols;
                let out = alloc_views(&mut dev, Copies::Both, m);
                items.push((x.slice(at..at + m).expect("slice"), rows, cols, out));
                at += m;
            }
            let cfg = Mxfp8Config::default();
            let bytes = at as f64 * (2.0 + 2.0 * (1.0 + 1.0 / 32.0));
            for many in [1, 2] {
                dev.set_cuda_kernel_variant("mxfp8_many", many)
                    .expect("variant");
                let t = timed(&mut dev, 50, |d| {
                    d.quantize_mxfp8_many(&items, &cfg).expect("quantize many")
                });
                report(
                    &format!(
                        "mxfp8 rowwise+columnwise 32768x2048 + 8192x8192 (quantize_mxfp8_many v{many})"
                    ),
                    t,
                    bytes,
                    copy_bw,
                );
            }
            for (_, _, _, out) in items {
                free_views(&mut dev, out);
            }
        }
        // mxfp8x.cu bf16 -> E4M3 2D (32x32 tile scales) rowwise + columnwise and 1D columnwise-only,
        // per kernel version (2: generic tile, 3: mxfp8.cu v4's technique, the default; same bytes),
        // against the same bound: read 2, write 1 + 1/32 per element per copy.
        for (copies, two_d, version) in [
            (Copies::Both, true, 2),
            (Copies::Both, true, 3),
            (Copies::Columnwise, false, 2),
            (Copies::Columnwise, false, 3),
        ] {
            dev.set_cuda_kernel_variant("mxfp8x", version)
                .expect("variant");
            let out = alloc_views(&mut dev, copies, elems);
            let cfg = Mxfp8Config {
                copies,
                two_d,
                ..Mxfp8Config::default()
            };
            let t = timed(&mut dev, 50, |d| {
                d.quantize_mxfp8(x, n, n, &cfg, &out).expect("quantize")
            });
            let copies_n = if copies == Copies::Both { 2.0 } else { 1.0 };
            let bytes = elems as f64 * (2.0 + copies_n * (1.0 + 1.0 / 32.0));
            let what = if two_d {
                "2D rowwise+columnwise"
            } else {
                "columnwise"
            };
            report(
                &format!("mxfp8x bf16 {what} 16384x16384 (kernel v{version})"),
                t,
                bytes,
                copy_bw,
            );
            free_views(&mut dev, out);
        }
        dev.set_cuda_kernel_variant("mxfp8x", 3).expect("variant");
        // The re-quantization after a parameter all-gather: every weight matrix of Llama-3.2-1B's
        // layers (q, k, v, o, gate, up, down), bf16 views of one staging buffer into views of four
        // output buffers, rowwise + columnwise E4M3 (kernel v4), one `quantize_mxfp8` per matrix
        // against one `quantize_mxfp8_many` for all, for one layer and for all 16.
        dev.set_cuda_kernel_variant("mxfp8_both", 4)
            .expect("variant");
        for layers in [1, 16] {
            llama_requantize(&mut dev, x, layers, copy_bw);
        }
        llama_mxfp8_scales_2d(&mut dev, copy_bw, steady_bw);
    }
    if want("nvfp4") {
        llama_nvfp4_finish(&mut dev, copy_bw, steady_bw);
        // NVFP4 rowwise (global amax pass, host sync for the tensor scale, quantization) and both
        // copies. Byte bound: the amax pass reads X (2 B/element), the quantization reads it again
        // and writes 0.5 + 1/16 B/element per copy.
        dev.set_cuda_kernel_variant("mxfp8_both", 4)
            .expect("variant");
        // The amax pass alone (bf16 max_abs, read 2 B/element), per kernel version.
        for version in [1, 2] {
            dev.set_cuda_kernel_variant("nvfp4", version)
                .expect("variant");
            let t = timed(&mut dev, 30, |d| {
                d.max_abs(x).expect("max_abs");
            });
            report(
                &format!("max_abs bf16 16384x16384 (v{version})"),
                t,
                elems as f64 * 2.0,
                copy_bw,
            );
        }
        for (copies, version) in [
            (Copies::Rowwise, 1),
            (Copies::Rowwise, 2),
            (Copies::Rowwise, 3),
            (Copies::Rowwise, 2),
            (Copies::Rowwise, 3),
            (Copies::Both, 1),
            (Copies::Both, 2),
            (Copies::Both, 3),
            // Version 4 = 3 with the shared-memory-transpose columnwise kernel
            // (nvfp4_quantize_cols_v4); the columnwise copy alone isolates that kernel.
            (Copies::Both, 4),
            (Copies::Columnwise, 3),
            (Copies::Columnwise, 4),
            (Copies::Both, 3),
            (Copies::Both, 4),
            // Version 5: both copies from one read of X (nvfp4_quantize_both_v5).
            (Copies::Both, 5),
            // Version 6: 5 and 4 over pairs of 256-row tiles, whole-sector column scale stores.
            (Copies::Columnwise, 6),
            (Copies::Both, 6),
            // Version 7: 6 and rowwise v3 with nvfp4_word_v4 (selects and merges on the FMA pipe).
            (Copies::Rowwise, 7),
            (Copies::Columnwise, 7),
            (Copies::Both, 7),
            // Version 8: both copies with shorter chains per block; 9: 8 with the class table
            // of thresholds; 7, 8 and 9 alternated twice.
            (Copies::Both, 8),
            (Copies::Both, 9),
            (Copies::Both, 7),
            (Copies::Both, 8),
            (Copies::Both, 9),
            // Version 10: 9 with the both-copies kernel as the parameters kernel's programmatic
            // dependent; 9 and 10 alternated.
            (Copies::Both, 10),
            (Copies::Both, 9),
            (Copies::Both, 10),
        ] {
            if let Err(e) = dev.set_cuda_kernel_variant("nvfp4", version) {
                println!("nvfp4 v{version}: skipped ({e})");
                continue;
            }
            let nv = Nvfp4Views {
                rowwise: copies.rowwise().then(|| {
                    (
                        dev.alloc(DType::U8, elems / 2),
                        dev.alloc(DType::U8, elems / 16),
                    )
                }),
                columnwise: copies.columnwise().then(|| {
                    (
                        dev.alloc(DType::U8, elems / 2),
                        dev.alloc(DType::U8, elems / 16),
                    )
                }),
            };
            let cfg = Nvfp4Config {
                copies,
                ..Nvfp4Config::default()
            };
            let t = timed(&mut dev, 30, |d| {
                d.quantize_nvfp4(x, n, n, &cfg, &nv).expect("nvfp4");
            });
            let copies_n = if copies == Copies::Both { 2.0 } else { 1.0 };
            let bytes = elems as f64 * (4.0 + copies_n * (0.5 + 1.0 / 16.0));
            report(
                &format!(
                    "nvfp4 {} with amax 16384x16384 (v{version})",
                    match copies {
                        Copies::Both => "rowwise+columnwise",
                        Copies::Columnwise => "columnwise",
                        _ => "rowwise",
                    }
                ),
                t,
                bytes,
                copy_bw,
            );
            // Steady state: 10 deferred calls back to back, one read of their amaxes.
            if copies == Copies::Both && version >= 9 {
                let t = timed_steady(
                    &mut dev,
                    10,
                    |d| {
                        d.quantize_nvfp4_deferred(x, n, n, &cfg, &nv)
                            .expect("nvfp4")
                    },
                    |d, pending| {
                        d.read_nvfp4_amaxes(pending).expect("amaxes");
                    },
                );
                report(
                    &format!(
                        "nvfp4 rowwise+columnwise with amax 16384x16384 (v{version}, deferred, steady state)"
                    ),
                    t,
                    bytes,
                    steady_bw,
                );
            }
            for (a, b) in [nv.rowwise, nv.columnwise].into_iter().flatten() {
                dev.free(a).expect("free");
                dev.free(b).expect("free");
            }
        }
    }
    dev.free(x).expect("free");
    assert!(
        dev.host_fallback_calls().is_empty(),
        "a timed op took the host fallback: {:?}",
        dev.host_fallback_calls()
    );

    if !want("optim") {
        return;
    }
    // AdamW over 256M parameters.
    let p_n = 256usize << 20;
    let [p, g, m, v] = [0; 4].map(|_| dev.alloc(DType::F32, p_n));
    let out = dev.alloc(DType::Bf16, p_n);
    dev.fill(p, 0.5).expect("fill");
    dev.fill(g, 1e-3).expect("fill");
    // Same-run copy baseline at this size: 1 GiB f32 device-to-device.
    let t_copy2 = timed(&mut dev, 20, |d| d.copy(g, m).expect("copy"));
    let copy_bw2 = (2 * p_n * 4) as f64 / t_copy2;
    println!(
        "copy f32 256M: {:.1} us, {:.0} GB/s (read + write)",
        t_copy2 * 1e6,
        copy_bw2 / 1e9
    );
    // The grad-norm reduction (blocked f64 sum of squares) over the 1 GiB f32 gradient: reads
    // 4 B/element, 8 B per 131072 elements of group sums come back to the host; then the same
    // 1 GiB read as 512M bf16 (the 16-bit loads: half the bytes per request). Per kernel
    // version: 1 (128 bytes of each of 32 blocks per warp instruction), 2 (16-byte loads, 512
    // contiguous bytes of one block per instruction, a swizzled shared tile), 3 (1 with the
    // 256-byte L2 prefetch hint); the default (0) takes 1 for f32 and 2 for 16-bit views.
    let gh = g.reinterpret(DType::Bf16).expect("reinterpret");
    for version in [1, 2, 3] {
        dev.set_cuda_kernel_variant("sum_squares", version)
            .expect("variant");
        for (what, v) in [("f32 256M", g), ("bf16 512M", gh)] {
            let t = timed(&mut dev, 20, |d| {
                d.sum_squares(v).expect("sum_squares");
            });
            report(
                &format!("sum_squares {what} (v{version})"),
                t,
                (p_n * 4) as f64,
                copy_bw2,
            );
        }
    }
    dev.set_cuda_kernel_variant("sum_squares", 0)
        .expect("variant");
    dev.zero(m).expect("zero");
    // AdamW per kernel version (1: an element a thread, the default; 2: four), with f32
    // gradients (30 bytes per parameter) and with bf16 gradients (28 bytes; the step with bf16
    // gradients), those from the first half of the f32 gradient's bytes.
    let gb = gh.slice(0..p_n).expect("slice");
    let mut step = 0u64;
    for version in [1, 2] {
        dev.set_cuda_kernel_variant("adamw", version)
            .expect("variant");
        for (what, grad, bytes) in [("f32 grads", g, 30), ("bf16 grads", gb, 28)] {
            let t = timed(&mut dev, 20, |d| {
                step += 1;
                let hp = AdamW {
                    lr: 1e-4,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                    step,
                    grad_scale: 1.0,
                };
                d.adamw(p, grad, m, v, &hp, Some(out)).expect("adamw")
            });
            report(
                &format!("adamw 256M {what} + bf16 out (v{version})"),
                t,
                (p_n * bytes) as f64,
                copy_bw2,
            );
        }
    }
    assert!(dev.host_fallback_calls().is_empty());
}
