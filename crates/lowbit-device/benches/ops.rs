//! The fused AdamW step against its memory-traffic bound, measured in the same run.
//!
//! # What is measured
//! - `copy/64MiB`: [`Device::copy`] of a 64 MiB buffer into another, already touched one. Its
//!   bandwidth counts bytes read plus bytes written (128 MiB per copy).
//! - `adamw/4M_bf16_out`: [`Device::adamw`] over 4Mi parameters (f32 param, grad, m, v; bf16
//!   out), the shard step of the distributed optimizer. It must read 16 bytes per parameter
//!   (param, grad, m, v) and write 14 (param, m, v, bf16 copy): 30 bytes.
//! - `adamw/4M_no_out`: the same without the bf16 copy (26 bytes per parameter).
//! - `cast/4M_f32_bf16`: f32 → bf16 [`Device::cast`] (6 bytes per element), for scale.
//!
//! # The summary
//! After criterion runs, the median time of each benchmark is read back from
//! `<criterion dir>/<group>/<id>/new/estimates.json` (the `point_estimate` of `median`; only
//! files this run wrote count). The criterion dir is `$CRITERION_HOME`, else
//! `$CARGO_TARGET_DIR/criterion`, else the workspace's `target/criterion`, and is handed to
//! criterion so that both agree. For each op: elements/s, GB/s of its ideal traffic, and that
//! bandwidth as a fraction of the copy's (`x copy`). An op at its byte bound scores 1.0 minus
//! what write-allocate traffic costs it (a streaming copy may avoid that; an element-wise kernel
//! with ordinary stores reads each written line first).
//!
//! Run with `cargo bench -p lowbit-device --bench ops` (about 30 s).

use std::hint::black_box;
use std::time::Duration;

use criterion::Throughput;
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{AdamW, DType, Device, View};
use lowbit_testkit::bench::{BenchRun, print_load_average};

const COPY_BYTES: usize = 64 << 20;
const PARAMS: usize = 4 << 20;

/// One benchmark: where criterion writes it, how many elements and ideal bytes it moves.
struct Case {
    group: &'static str,
    id: &'static str,
    elems: usize,
    bytes: usize,
}

const CASES: [Case; 4] = [
    Case {
        group: "copy",
        id: "64MiB",
        elems: COPY_BYTES,
        bytes: 2 * COPY_BYTES,
    },
    Case {
        group: "adamw",
        id: "4M_bf16_out",
        elems: PARAMS,
        bytes: 30 * PARAMS,
    },
    Case {
        group: "adamw",
        id: "4M_no_out",
        elems: PARAMS,
        bytes: 26 * PARAMS,
    },
    Case {
        group: "cast",
        id: "4M_f32_bf16",
        elems: PARAMS,
        bytes: 6 * PARAMS,
    },
];

/// A deterministic f32 view of `n` values in about ±`scale`.
fn filled(dev: &mut Device, n: usize, seed: u32, scale: f32) -> View {
    let vals = xorshift32_signed(seed | 1, n, scale);
    let v = dev.alloc(DType::F32, n);
    dev.upload(v, &vals).expect("upload");
    v
}

fn main() {
    let (run, mut c) = BenchRun::start(Duration::from_millis(500), Duration::from_secs(3));
    let mut dev = Device::cpu();

    {
        let src = dev.alloc(DType::U8, COPY_BYTES);
        let dst = dev.alloc(DType::U8, COPY_BYTES);
        dev.write_bytes(src, &vec![0x5A; COPY_BYTES])
            .expect("write");
        dev.copy(src, dst).expect("touch the destination");
        let mut g = c.benchmark_group("copy");
        g.throughput(Throughput::Bytes(2 * COPY_BYTES as u64));
        g.bench_function("64MiB", |b| b.iter(|| dev.copy(src, dst).expect("copy")));
        g.finish();
        dev.free(src).expect("free");
        dev.free(dst).expect("free");
    }
    {
        let p = filled(&mut dev, PARAMS, 1, 1.0);
        let g_ = filled(&mut dev, PARAMS, 2, 1e-2);
        let m = filled(&mut dev, PARAMS, 3, 1e-3);
        let v_sq = filled(&mut dev, PARAMS, 4, 1e-4);
        // exp_avg_sq ≥ 0: fold the signs away (|x| = sqrt(x²) exactly for these magnitudes).
        let abs: Vec<f32> = dev
            .download::<f32>(v_sq)
            .expect("download")
            .iter()
            .map(|x| x.abs())
            .collect();
        dev.upload(v_sq, &abs).expect("upload");
        let out = dev.alloc(DType::Bf16, PARAMS);
        let mut g = c.benchmark_group("adamw");
        g.throughput(Throughput::Elements(PARAMS as u64));
        g.bench_function("4M_bf16_out", |b| {
            b.iter(|| {
                dev.adamw(p, g_, m, v_sq, black_box(&hp()), Some(out))
                    .expect("adamw")
            })
        });
        g.bench_function("4M_no_out", |b| {
            b.iter(|| {
                dev.adamw(p, g_, m, v_sq, black_box(&hp()), None)
                    .expect("adamw")
            })
        });
        g.finish();
        let mut g = c.benchmark_group("cast");
        g.throughput(Throughput::Elements(PARAMS as u64));
        g.bench_function("4M_f32_bf16", |b| {
            b.iter(|| dev.cast(p, out).expect("cast"))
        });
        g.finish();
    }
    c.final_summary();
    summary(&run);
}

fn hp() -> AdamW {
    AdamW {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 100,
        grad_scale: 1.0,
    }
}

/// Prints elements/s, GB/s and the ratio to the copy bandwidth of every case this run measured.
fn summary(run: &BenchRun) {
    let times: Vec<Option<f64>> = CASES.iter().map(|k| run.median_ns(k.group, k.id)).collect();
    let Some(copy_ns) = times[0] else {
        println!("\n(copy baseline not measured in this run: no summary)");
        return;
    };
    let copy_gbs = CASES[0].bytes as f64 / copy_ns;
    println!("\nlowbit-device ops, median times; bandwidth = ideal bytes read + written / time");
    println!(
        "{:<20} {:>10} {:>14} {:>9} {:>8}",
        "benchmark", "time", "elements/s", "GB/s", "x copy"
    );
    for (case, t) in CASES.iter().zip(&times) {
        let Some(t) = t else { continue };
        let gbs = case.bytes as f64 / t;
        println!(
            "{:<20} {:>7.2} ms {:>14.3e} {:>9.2} {:>8.2}",
            format!("{}/{}", case.group, case.id),
            t / 1e6,
            case.elems as f64 / (t * 1e-9),
            gbs,
            gbs / copy_gbs
        );
    }
    print_load_average(
        "well above 1, other processes share the memory bus and the numbers are noisy",
    );
    if let Some(t) = times[1] {
        println!(
            "\nAdamW (4Mi params, bf16 out): {:.3e} params/s = {:.2} GB/s of its 30 B/param bound \
             = {:.2}x the {:.2} GB/s memory-copy bandwidth of this run",
            PARAMS as f64 / (t * 1e-9),
            CASES[1].bytes as f64 / t,
            CASES[1].bytes as f64 / t / copy_gbs,
            copy_gbs
        );
    }
}
