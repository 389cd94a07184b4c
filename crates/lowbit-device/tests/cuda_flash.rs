//! The flash attention on CUDA (`crates/lowbit-kernels/flash_attention.cu`) against the CPU's
//! exact attention and the CPU flash reference: forward and backward on many shapes (seq 1 to
//! 2048 across the 64-row blocks, GQA 1/1, 4/2, 12/12, 32/8, head sizes 64 and 128, batch 1 to
//! 3), views inside larger buffers whose surroundings must stay untouched, determinism (two
//! runs, identical bytes), finiteness; the head-size error; and an ignored timing test that
//! prints TFLOP/s. Needs a GPU; fails, never skips, without one.
//!
//! Bounds: `max |cuda − cpu| / max |cpu|` (floor 1e-3) ≤ 2e-2 for `out`, `dq`, `dk`, `dv`
//! against the exact op (bf16 operands: the CPU reference of the same rounding measures 2e-3 to
//! 6e-3), and ≤ 1e-2 for `lse` (measured about 1e-3).
#![cfg(feature = "cuda")]

use lowbit_device::{AttentionSpec, DType, Device, View};

mod support;
use support::*;

/// The bound on the relative errors (module documentation).
const BOUND: f64 = 2e-2;

/// `n` values in `[-mag, mag)`.
fn moderate(n: usize, seed: u64, mag: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.unit() * mag).collect()
}

fn spec(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttentionSpec {
    AttentionSpec {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        scale: (1.0 / (head_dim as f64).sqrt()) as f32,
    }
}

/// `max |a − b| / max(max |b|, 1e-3)`; NaN counts as infinitely wrong.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let mag = b.iter().fold(1e-3f64, |m, &x| m.max(f64::from(x).abs()));
    let worst = a.iter().zip(b).fold(0f64, |w, (&x, &y)| {
        let d = (f64::from(x) - f64::from(y)).abs();
        if d.is_nan() { f64::INFINITY } else { w.max(d) }
    });
    worst / mag
}

/// `vals` in the middle of a buffer of `PAD` sentinels either side, and that view.
const PAD: usize = 37;
const SENTINEL: f32 = 1234.5;

fn put(dev: &mut Device, vals: &[f32]) -> View {
    put_whole(dev, vals).1
}

/// [`put`], and the whole buffer.
fn put_whole(dev: &mut Device, vals: &[f32]) -> (View, View) {
    let all = [&vec![SENTINEL; PAD][..], vals, &vec![SENTINEL; PAD][..]].concat();
    let v = dev.alloc(DType::F32, all.len());
    dev.upload(v, &all).unwrap();
    (v, v.slice(PAD..PAD + vals.len()).unwrap())
}

/// The middle of a buffer made by [`put_whole`], after checking its surroundings are untouched.
fn get(dev: &Device, (whole, v): (View, View), name: &str) -> Vec<f32> {
    let all = dev.download::<f32>(whole).unwrap();
    let (head, rest) = all.split_at(PAD);
    let (mid, tail) = rest.split_at(v.len());
    assert!(
        head.iter().chain(tail).all(|&x| x == SENTINEL),
        "{name}: bytes around the view were written"
    );
    mid.to_vec()
}

/// `[out, lse, dq, dk, dv]` of the forward and backward on `dev` (flash or exact).
fn run(dev: &mut Device, s: &AttentionSpec, x: &[Vec<f32>; 4], flash: bool) -> [Vec<f32>; 5] {
    let [q, k, v, dout] = x.each_ref().map(|a| put(dev, a));
    let (qn, kn, ln) = (x[0].len(), x[1].len(), s.batch * s.heads * s.seq);
    let [wo, wq] = [0, 1].map(|_| put_whole(dev, &vec![f32::NAN; qn]));
    let [wk, wv] = [0, 1].map(|_| put_whole(dev, &vec![f32::NAN; kn]));
    let wl = put_whole(dev, &vec![f32::NAN; ln]);
    let [out, dq, dk, dv, lse] = [wo, wq, wk, wv, wl].map(|w| w.1);
    if flash {
        dev.flash_attention(q, k, v, out, lse, s).unwrap();
        dev.flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, s)
            .unwrap();
    } else {
        dev.attention(q, k, v, out, lse, s).unwrap();
        dev.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, s)
            .unwrap();
    }
    let names = ["out", "lse", "dq", "dk", "dv"];
    let views = [wo, wl, wq, wk, wv];
    std::array::from_fn(|w| get(dev, views[w], names[w]))
}

fn inputs(s: &AttentionSpec, seed: u64) -> [Vec<f32>; 4] {
    let qn = s.batch * s.seq * s.heads * s.head_dim;
    let kn = s.batch * s.seq * s.kv_heads * s.head_dim;
    [
        moderate(qn, seed, 2.0),
        moderate(kn, seed + 1, 2.0),
        moderate(kn, seed + 2, 1.0),
        moderate(qn, seed + 3, 1.0),
    ]
}

#[test]
fn flash_on_cuda_matches_the_cpu_within_bf16_error() {
    let shapes = [
        // (batch, seq, heads, kv_heads, head_dim)
        (1, 1, 1, 1, 64),
        (2, 1, 4, 2, 128),
        (3, 17, 4, 2, 64),
        (1, 17, 32, 8, 128),
        (2, 64, 12, 12, 64),
        (1, 64, 1, 1, 128),
        (1, 127, 4, 2, 128),
        (2, 127, 32, 8, 64),
        (1, 128, 12, 12, 128),
        (3, 128, 4, 2, 64),
        (1, 129, 32, 8, 128),
        (2, 129, 1, 1, 64),
        (1, 1000, 4, 2, 64),
        (1, 1000, 1, 1, 128),
        (1, 2048, 2, 1, 64),
        (1, 2048, 1, 1, 128),
    ];
    let mut cpu = Device::cpu();
    let mut g = gpu();
    let names = ["out", "lse", "dq", "dk", "dv"];
    // Both kernel families: wgmma (0, where the GPU loads it) and mma.sync (1).
    for (variant, (n, &(b, sq, h, kvh, hd))) in [0, 1]
        .into_iter()
        .flat_map(|v| shapes.iter().enumerate().map(move |x| (v, x)))
    {
        g.set_cuda_kernel_variant("flash_wgmma", variant).unwrap();
        let s = spec(b, sq, h, kvh, hd);
        let x = inputs(&s, 1000 + n as u64);
        let cuda = run(&mut g, &s, &x, true);
        let exact = run(&mut cpu, &s, &x, false);
        let mut line = format!("flash (variant {variant}) b{b} s{sq} h{h}/{kvh} d{hd} vs exact:");
        for w in 0..5 {
            assert!(
                cuda[w].iter().all(|v| v.is_finite()),
                "{s:?}: {} has non-finite values",
                names[w]
            );
            let e = rel(&cuda[w], &exact[w]);
            let bound = if w == 1 { 1e-2 } else { BOUND };
            line += &format!(" {} {e:.2e}", names[w]);
            assert!(e <= bound, "{s:?}: {} {e:e} (bound {bound})", names[w]);
        }
        println!("{line}");
        // The CPU flash reference is within the same bound (not bit-equal: module docs of
        // lowbit_device's flash op).
        if sq <= 129 {
            let reference = run(&mut cpu, &s, &x, true);
            for w in [0, 2, 3, 4] {
                let e = rel(&cuda[w], &reference[w]);
                assert!(
                    e <= BOUND,
                    "{s:?}: {} {e:e} from the CPU flash reference",
                    names[w]
                );
            }
        }
    }
}

#[test]
fn flash_on_cuda_is_deterministic() {
    let mut g = gpu();
    for (variant, (b, sq, h, kvh, hd)) in [0, 1]
        .into_iter()
        .flat_map(|v| [(2, 1000, 32, 8, 64), (1, 333, 8, 2, 128)].map(|x| (v, x)))
    {
        g.set_cuda_kernel_variant("flash_wgmma", variant).unwrap();
        let s = spec(b, sq, h, kvh, hd);
        let x = inputs(&s, 7);
        let first = run(&mut g, &s, &x, true);
        let second = run(&mut g, &s, &x, true);
        for (w, (a, c)) in first.iter().zip(&second).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(c), "{s:?}: output {w} differs between runs");
        }
    }
}

#[path = "common/flash_bf16.rs"]
mod flash_bf16;

/// q, k, v, out and dout as bf16 views (no conversion pass) give the f32 views' bits, `out`
/// rounded once, for both kernel families.
#[test]
fn flash_on_cuda_bf16_views_give_the_f32_views_bits() {
    let mut g = gpu();
    for variant in [0, 1] {
        g.set_cuda_kernel_variant("flash_wgmma", variant).unwrap();
        for (b, sq, h, kvh, hd) in [(2, 300, 8, 2, 64), (1, 333, 8, 2, 128)] {
            let s = spec(b, sq, h, kvh, hd);
            flash_bf16::assert_bf16_views_match(&mut g, &s, &inputs(&s, 11));
        }
    }
    g.set_cuda_kernel_variant("flash_wgmma", 0).unwrap();
}

/// The mma.sync forward's one-tile (64-row) and two-tile (128-row) blocks give the same bits: a
/// row meets the same key blocks in the same order either way (the blocks past a tile's
/// diagonal that the two-tile kernel skips would change nothing).
#[test]
fn flash_forward_tilings_agree_bit_for_bit() {
    let mut g = gpu();
    g.set_cuda_kernel_variant("flash_wgmma", 1).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (b, sq, h, kvh, hd) in [
        (1, 1, 1, 1, 64),
        (2, 63, 4, 2, 128),
        (1, 129, 32, 8, 64),
        (2, 191, 4, 2, 128),
        (1, 1000, 8, 2, 64),
        (1, 1000, 4, 4, 128),
    ] {
        let s = spec(b, sq, h, kvh, hd);
        let x = inputs(&s, 11);
        g.set_cuda_kernel_variant("flash_fwd_tiles", 1).unwrap();
        let one = run(&mut g, &s, &x, true);
        g.set_cuda_kernel_variant("flash_fwd_tiles", 2).unwrap();
        let two = run(&mut g, &s, &x, true);
        g.set_cuda_kernel_variant("flash_fwd_tiles", 0).unwrap();
        for (w, name) in ["out", "lse"].iter().enumerate() {
            assert_eq!(
                bits(&one[w]),
                bits(&two[w]),
                "{s:?}: {name} differs between tilings"
            );
        }
    }
}

#[test]
fn flash_on_cuda_refuses_other_head_sizes() {
    let mut g = gpu();
    let s = spec(1, 8, 2, 1, 96);
    let q = put(&mut g, &vec![0.0; 8 * 2 * 96]);
    let k = put(&mut g, &vec![0.0; 8 * 96]);
    let out = put(&mut g, &vec![0.0; 8 * 2 * 96]);
    let lse = put(&mut g, &[0.0; 16]);
    let err = g.flash_attention(q, k, k, out, lse, &s).unwrap_err();
    assert!(err.to_string().contains("head_dim 96"), "{err}");
}

/// TFLOP/s of the flash attention: forward FLOPs `4·b·h·s²·d / 2` (causal), backward 2.5× the
/// forward (FlashAttention-2's convention), so forward + backward counts 3.5× the forward;
/// median wall time of 10 synchronised runs after 2 warm-ups. `cargo test -p lowbit-device
/// --features cuda --release --test cuda_flash -- --ignored --nocapture flash_timing`.
#[test]
#[ignore = "timing"]
fn flash_timing() {
    let mut g = gpu();
    for (b, sq, h, kvh, hd) in [
        (8, 2048, 32, 8, 64),
        (2, 4096, 32, 8, 128),
        (8, 1024, 12, 12, 64),
    ] {
        let s = spec(b, sq, h, kvh, hd);
        let (qn, kn) = (b * sq * h * hd, b * sq * kvh * hd);
        let mut buf = |n: usize, seed: u64| {
            let v = g.alloc(DType::F32, n);
            g.upload(v, &moderate(n, seed, 1.0)).unwrap();
            v
        };
        let [q, dout, out, dq] = [1, 2, 3, 4].map(|sd| buf(qn, sd));
        let [k, v, dk, dv] = [5, 6, 7, 8].map(|sd| buf(kn, sd));
        let lse = buf(b * h * sq, 9);
        // The forward of each mma.sync tiling (query rows per warp), then the default's, and
        // forward + backward of both kernel families.
        g.set_cuda_kernel_variant("flash_wgmma", 1).unwrap();
        for tiles in [1, 2] {
            g.set_cuda_kernel_variant("flash_fwd_tiles", tiles).unwrap();
            let t = time(&mut g, 10, |g| {
                g.flash_attention(q, k, v, out, lse, &s).unwrap()
            });
            let flops = 2.0 * (b * h) as f64 * (sq * sq) as f64 * hd as f64;
            println!(
                "flash b{b} s{sq} h{h}/{kvh} d{hd}: forward, {tiles} tile(s) per warp {:.3} ms \
                 {:.1} TFLOP/s",
                t / 1e3,
                flops / t / 1e6
            );
        }
        g.set_cuda_kernel_variant("flash_fwd_tiles", 0).unwrap();
        for variant in [1, 0] {
            g.set_cuda_kernel_variant("flash_wgmma", variant).unwrap();
            let fwd = time(&mut g, 10, |g| {
                g.flash_attention(q, k, v, out, lse, &s).unwrap()
            });
            let both = time(&mut g, 10, |g| {
                g.flash_attention(q, k, v, out, lse, &s).unwrap();
                g.flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &s)
                    .unwrap()
            });
            let flops = 4.0 * (b * h) as f64 * (sq * sq) as f64 * hd as f64 / 2.0;
            let (tf, tb) = (flops / fwd / 1e6, 3.5 * flops / both / 1e6);
            let kind = if variant == 0 { "wgmma" } else { "mma_sync" };
            println!(
                "flash ({kind}) b{b} s{sq} h{h}/{kvh} d{hd}: forward {:.3} ms {tf:.1} TFLOP/s, \
             forward+backward {:.3} ms {tb:.1} TFLOP/s",
                fwd / 1e3,
                both / 1e3
            );
            println!(
                "{{\"op\": \"lowbit_flash\", \"kernels\": \"{kind}\", \"batch\": {b}, \"seq\": {sq}, \
             \"heads\": {h}, \"kv_heads\": {kvh}, \"head_dim\": {hd}, \"fwd_ms\": {:.4}, \
             \"fwd_tflops\": {tf:.1}, \"fwd_bwd_ms\": {:.4}, \"fwd_bwd_tflops\": {tb:.1}}}",
                fwd / 1e3,
                both / 1e3
            );
        }
    }
}
