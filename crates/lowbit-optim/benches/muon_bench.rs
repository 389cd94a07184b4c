//! Muon on the GPU: the tensor-core GEMM checked against the CPU, the fast Newton–Schulz mode's
//! deviation from the exact one, and the timings of the GPU matrix (issue 12 item 7):
//!
//! 1. `matmul_tc` (cuBLASLt) against the CPU reference on fresh random inputs: plain, transposed,
//!    with a separate and an in-place C, f32 and bf16 outputs, and symmetric products by blocks
//!    (which must come out exactly symmetric).
//! 2. The deviation of `NsMode::Fast` from `NsMode::Exact`: one Muon step (lr 1, no weight
//!    decay, masters from zero, so the master is `−scale·O`) on Gaussian gradients of a few
//!    shapes, `‖O_fast − O_exact‖ / ‖O_exact‖`; and symmetric blocks on vs off at Llama sizes.
//! 3. One Muon step over the matrices of one Llama-3-8B layer (q, o 4096x4096; k, v 1024x4096;
//!    gate, up 14336x4096; down 4096x14336; f32 parameters and gradients, as PyTorch's): the
//!    fast mode (symmetric blocks with the default mirror, with the identity-GEMM mirror, and
//!    off) timed as `Optimizer::apply` (momentum, NS, weight decay, update, the write-back to
//!    the parameter storage), median of 10; the exact mode as the sum of one timed exact step
//!    of each distinct shape (k, q, gate, down; each once, with the fast mode's deviation from
//!    it at that shape); and, with `--torch SCRIPT`, `torch.optim.Muon` on the same card in the
//!    same run (the script's JSON).
//! 4. Layer-wise over 1 and 2 GPUs: 8 such layers, bf16 parameters and gradients, the layer-wise
//!    plan splitting the matrices between the ranks, the whole optimizer step timed
//!    (`protocol::step`: grad norm, update, bf16 write-back, all-gather of the parameters), and
//!    the gradient sync before it timed separately.
//!
//! `cargo bench -p lowbit-optim --features cuda --bench muon_bench -- [--json PATH]
//! [--torch gpu/torch_muon.py] [--gpus 2] [--layers 8]`. Needs cuBLASLt on the library path
//! (`gpu/with_cublas.sh` finds it). Prints a table last; `--json` writes every number.

use lowbit_buffers::protocol::StepProtocol;
use std::fmt::Write as _;
use std::time::Instant;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, PlanConfig, ShardingPlan,
    ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::Communicator;
use lowbit_comm::nccl::{NcclConfig, run_local_ranks_with};
use lowbit_dev_support::cli::bounded_or_exit;
use lowbit_device::{DType, Device, MatmulTcSpec, View, bf16};
use lowbit_optim::{Muon, MuonConfig, NsMode, OptimConfig, Optimizer, UpdateScope};
use lowbit_train::protocol;

/// The matrices of one Llama-3-8B layer: (name, rows = out, cols = in).
const LAYER: [(&str, usize, usize); 7] = [
    ("q", 4096, 4096),
    ("k", 1024, 4096),
    ("v", 1024, 4096),
    ("o", 4096, 4096),
    ("gate", 14336, 4096),
    ("up", 14336, 4096),
    ("down", 4096, 14336),
];

/// Shapes of the fast-vs-exact deviation (the exact mode runs on the GPU's exact matmul).
const DEVIATION_SHAPES: [(usize, usize); 3] = [(256, 1024), (1024, 256), (512, 512)];

/// Shapes of symmetric blocks on vs off (fast mode only).
const BLOCK_SHAPES: [(usize, usize); 2] = [(4096, 4096), (14336, 4096)];

/// A deterministic generator (xorshift64*), uniform and Gaussian.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let (u, v) = (self.unit(), self.unit());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn gauss_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.gauss() * scale).collect()
    }
}

/// Multiply-adds of one Newton–Schulz iteration on a `rows x cols` matrix.
fn ns_macs(rows: usize, cols: usize) -> f64 {
    let (s, l) = (rows.min(cols) as f64, rows.max(cols) as f64);
    2.0 * s * s * l + s * s * s
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `‖a − b‖ / ‖b‖` in f64.
fn rel_fro(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (f64::from(*x) - f64::from(*y)).powi(2);
        den += f64::from(*y).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn card_name(ordinal: usize) -> String {
    lowbit_device::cudarc::driver::CudaContext::new(ordinal)
        .and_then(|c| c.name())
        .unwrap_or_else(|e| format!("GPU {ordinal} ({e:?})"))
}

// ---- 1. matmul_tc against the CPU ------------------------------------------------------------

struct TcCase {
    name: &'static str,
    spec: MatmulTcSpec,
    out: DType,
    /// 0: no C, 1: a separate C, 2: C = D (in place).
    c: u8,
}

/// Uploads `v` as `dtype` (rounded) to `dev`.
fn put(dev: &mut Device, dtype: DType, v: &[f32]) -> View {
    let x = dev.alloc(DType::F32, v.len());
    dev.upload(x, v).expect("upload");
    let y = dev.alloc(dtype, v.len());
    dev.cast(x, y).expect("cast");
    dev.free(x).expect("free");
    y
}

fn get(dev: &mut Device, v: View) -> Vec<f32> {
    let x = dev.alloc(DType::F32, v.len());
    dev.cast(v, x).expect("cast");
    let out = dev.download(x).expect("download");
    dev.free(x).expect("free");
    out
}

/// A symmetric `n x n` matrix (row-major).
fn symmetric(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut m = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            let v = rng.gauss();
            m[i * n + j] = v;
            m[j * n + i] = v;
        }
    }
    m
}

/// Runs every case on the GPU and the CPU; returns (report lines, all passed).
fn check_matmul_tc(gpu: &mut Device, rng: &mut Rng) -> (Vec<String>, bool) {
    let sp = |m, n, k, ta, tb, alpha, beta, sym| MatmulTcSpec {
        trans_a: ta,
        trans_b: tb,
        alpha,
        beta,
        symmetric: sym,
        ..MatmulTcSpec::new(m, n, k)
    };
    let cases = [
        TcCase {
            name: "257x129x1000 NN f32",
            spec: sp(257, 129, 1000, false, false, 1.0, 0.0, false),
            out: DType::F32,
            c: 0,
        },
        TcCase {
            name: "128x300x64 TN +C bf16",
            spec: sp(128, 300, 64, true, false, 0.5, -1.25, false),
            out: DType::Bf16,
            c: 1,
        },
        TcCase {
            name: "200x200x512 NT C=D f32",
            spec: sp(200, 200, 512, false, true, 1.0, 0.75, false),
            out: DType::F32,
            c: 2,
        },
        TcCase {
            name: "sym 2048x2048x128 X·Xᵀ bf16",
            spec: sp(2048, 2048, 128, false, true, 1.0, 0.0, true),
            out: DType::Bf16,
            c: 0,
        },
        TcCase {
            name: "sym 2048x2048x96 Xᵀ·X +C f32",
            spec: sp(2048, 2048, 96, true, false, 2.0, 0.5, true),
            out: DType::F32,
            c: 1,
        },
        TcCase {
            name: "sym 2048x2048x64 X·Xᵀ C=D bf16",
            spec: sp(2048, 2048, 64, false, true, -4.775, 3.4445, true),
            out: DType::Bf16,
            c: 2,
        },
    ];
    let mut cpu = Device::cpu();
    let mut lines = Vec::new();
    let mut all_ok = true;
    for case in &cases {
        let s = case.spec;
        let a_host = rng.gauss_vec(s.m * s.k, 1.0);
        let b_host = if s.symmetric {
            a_host.clone()
        } else {
            rng.gauss_vec(s.k * s.n, 1.0)
        };
        let c_host = if s.symmetric {
            symmetric(rng, s.m)
        } else {
            rng.gauss_vec(s.m * s.n, 1.0)
        };
        let run = |dev: &mut Device| -> Result<Vec<f32>, String> {
            let a = put(dev, DType::Bf16, &a_host);
            let b = if s.symmetric {
                a
            } else {
                put(dev, DType::Bf16, &b_host)
            };
            let c = put(dev, case.out, &c_host);
            // Poison D (NaN) where it is not C, so unwritten elements show.
            let d = if case.c == 2 {
                c
            } else {
                put(dev, case.out, &vec![f32::NAN; s.m * s.n])
            };
            let cv = match case.c {
                0 => None,
                _ => Some(c),
            };
            dev.matmul_tc(a, b, cv, d, &s).map_err(|e| e.to_string())?;
            Ok(get(dev, d))
        };
        let got = run(gpu);
        let want = run(&mut cpu).expect("the CPU reference");
        let line = match got {
            Err(e) => {
                all_ok = false;
                format!("matmul_tc {}: ERROR {e}", case.name)
            }
            Ok(got) => {
                let rel = rel_fro(&got, &want);
                let finite = got.iter().all(|v| v.is_finite());
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                let sym_ok = !(s.symmetric && case.out == DType::Bf16) || {
                    let n = s.m;
                    (0..n).all(|i| {
                        (0..i).all(|j| got[i * n + j].to_bits() == got[j * n + i].to_bits())
                    })
                };
                let tol = if case.out == DType::F32 { 1e-5 } else { 2e-3 };
                let ok = finite && sym_ok && rel <= tol;
                all_ok &= ok;
                format!(
                    "matmul_tc {:<32} rel {:.2e} (tol {tol:.0e}), {:.4}% elements differ, {}{}",
                    case.name,
                    rel,
                    100.0 * differ as f64 / got.len() as f64,
                    if s.symmetric && case.out == DType::Bf16 {
                        if sym_ok {
                            "exactly symmetric, "
                        } else {
                            "NOT SYMMETRIC, "
                        }
                    } else {
                        ""
                    },
                    if ok { "ok" } else { "FAIL" }
                )
            }
        };
        println!("{line}");
        lines.push(line);
    }
    (lines, all_ok)
}

// ---- Muon on one rank --------------------------------------------------------------------------

fn key(storage: ParamStorage, grads: GradDType) -> BufferKey {
    BufferKey::new(storage, grads, OptimizerId(0))
}

/// Layer-wise buffers of `shapes` for `dp` ranks, initialized from `init`.
fn buffers(
    dev: &mut Device,
    rank: usize,
    dp: usize,
    shapes: &[(String, usize, usize)],
    k: BufferKey,
    init: &dyn Fn(usize) -> Vec<f32>,
) -> DataParallelBuffers {
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .map(|(n, r, c)| ParamSpec::new(n.clone(), vec![*r, *c], k))
        .collect();
    let plan =
        ShardingPlan::new(&specs, &PlanConfig::new(dp, ShardingStrategy::LayerWise)).expect("plan");
    let cfg = DdpConfig::default()
        .with_sharding(ShardingStrategy::LayerWise)
        .with_overlap(Overlap::None)
        .with_verify(Verify::Cheap);
    let mut bufs = DataParallelBuffers::with_plan(dev, rank, specs, plan, cfg).expect("buffers");
    bufs.initialize_all(dev, init).expect("initialize");
    bufs
}

fn muon(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    cfg: MuonConfig,
    lr: f32,
    init: &dyn Fn(usize) -> Vec<f32>,
) -> Muon {
    let mut cb = |p: usize, r: std::ops::Range<usize>| init(p)[r].to_vec();
    Muon::new(
        dev,
        bufs,
        OptimizerId(0),
        cfg,
        OptimConfig::new(lr),
        &mut cb,
    )
    .expect("Muon")
}

/// Writes `grads[p]` (f32 host values, rounded to the gradient dtype) into parameter `p`'s
/// gradient view.
fn write_grads(dev: &mut Device, bufs: &mut DataParallelBuffers, grads: &[Vec<f32>]) {
    for (p, g) in grads.iter().enumerate() {
        let dst = bufs.accumulation_view(dev, p).expect("grad view");
        if dst.dtype() == DType::F32 {
            dev.upload(dst, g).expect("upload");
        } else {
            let h: Vec<bf16> = g.iter().map(|v| bf16::from_f32(*v)).collect();
            dev.upload(dst, &h).expect("upload");
        }
    }
}

/// One Muon step (lr 1, no weight decay, masters from zero) of `mode` on the gradients;
/// returns each matrix's master, `−scale·O`.
fn one_step(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    shapes: &[(String, usize, usize)],
    grads: &[Vec<f32>],
    mode: NsMode,
) -> (Vec<Vec<f32>>, f64) {
    let zeros = |p: usize| vec![0f32; shapes[p].1 * shapes[p].2];
    let mut bufs = buffers(
        dev,
        0,
        1,
        shapes,
        key(ParamStorage::F32, GradDType::F32),
        &zeros,
    );
    let cfg = MuonConfig::default()
        .with_weight_decay(0.0)
        .with_ns_mode(mode);
    let mut opt = muon(dev, &bufs, cfg, 1.0, &zeros);
    protocol::begin_iteration(dev, comm, &mut bufs, &opt).expect("begin");
    write_grads(dev, &mut bufs, grads);
    bufs.finish_grad_sync(dev, comm).expect("grad sync");
    dev.synchronize().expect("sync");
    let t = Instant::now();
    protocol::step(dev, comm, &mut bufs, &mut opt).expect("step");
    dev.synchronize().expect("sync");
    let secs = t.elapsed().as_secs_f64();
    let mut m = opt.masters(dev).expect("masters");
    m.sort_by_key(|s| s.param);
    (m.into_iter().map(|s| s.values).collect(), secs)
}

/// Seconds of `f` (synchronised before and after), median of `reps` after `warmup`.
fn time(dev: &mut Device, warmup: usize, reps: usize, mut f: impl FnMut(&mut Device)) -> f64 {
    for _ in 0..warmup {
        f(dev);
    }
    let mut t = Vec::new();
    for _ in 0..reps {
        dev.synchronize().expect("sync");
        let s = Instant::now();
        f(dev);
        dev.synchronize().expect("sync");
        t.push(s.elapsed().as_secs_f64());
    }
    median(t)
}

#[derive(Default)]
struct OneGpu {
    errors: Vec<String>,
    checks: Vec<String>,
    checks_ok: bool,
    symmetric_blocks: bool,
    deviation: Vec<(String, f64, f64)>,
    blocks_vs_full: Vec<(String, f64)>,
    exact_proxy: Vec<(String, f64, f64)>,
    exact_layer_s: f64,
    exact_measured: bool,
    fast_ms: f64,
    fast_identity_ms: f64,
    fast_full_ms: f64,
}

/// Runs `f`, catching a panic (printed, and recorded in `errors`) so later sections still run.
fn section(name: &str, errors: &mut Vec<String>, f: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        println!("section `{name}` failed: {msg}");
        errors.push(format!("{name}: {msg}"));
    }
}

fn layer_shapes(layers: usize) -> Vec<(String, usize, usize)> {
    (0..layers)
        .flat_map(|l| {
            LAYER
                .iter()
                .map(move |(n, r, c)| (format!("l{l}.{n}"), *r, *c))
        })
        .collect()
}

fn one_gpu(comm: &mut dyn Communicator, dev: &mut Device) -> OneGpu {
    let mut out = OneGpu::default();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);

    // 1. matmul_tc vs the CPU; without working symmetric blocks, the rest runs without them.
    let (lines, ok) = check_matmul_tc(dev, &mut rng);
    out.checks = lines;
    out.checks_ok = ok;
    out.symmetric_blocks = !out
        .checks
        .iter()
        .any(|l| l.contains("sym") && !l.ends_with("ok"));
    if !out.symmetric_blocks {
        println!("symmetric blocks failed: the fast mode runs with full GEMMs below");
        dev.set_cuda_kernel_variant("matmul_tc_symmetric", 0)
            .expect("variant");
    }

    section("fast one layer", &mut out.errors, || {
        // Fast: one layer, f32 parameters and gradients.
        let shapes = layer_shapes(1);
        let grads: Vec<Vec<f32>> = shapes
            .iter()
            .map(|(_, r, c)| rng.gauss_vec(r * c, 1.0))
            .collect();
        let init_vals: Vec<Vec<f32>> = shapes
            .iter()
            .map(|(_, r, c)| rng.gauss_vec(r * c, 0.02))
            .collect();
        let init = |p: usize| init_vals[p].clone();
        let mut bufs = buffers(
            dev,
            0,
            1,
            &shapes,
            key(ParamStorage::F32, GradDType::F32),
            &init,
        );
        write_grads(dev, &mut bufs, &grads);
        let cfg = MuonConfig::default().with_ns_mode(NsMode::Fast);
        let mut opt = muon(dev, &bufs, cfg, 0.02, &init);
        let mut step = |d: &mut Device| {
            opt.begin_step();
            opt.update(d, 1.0, UpdateScope::All).expect("update");
        };
        out.fast_ms = 1e3 * time(dev, 3, 10, &mut step);
        println!("fast Muon step, one layer: {:.2} ms", out.fast_ms);
        if out.symmetric_blocks {
            dev.set_cuda_kernel_variant("matmul_tc_symmetric", 2)
                .expect("variant");
            out.fast_identity_ms = 1e3 * time(dev, 2, 10, &mut step);
            dev.set_cuda_kernel_variant("matmul_tc_symmetric", 0)
                .expect("variant");
            out.fast_full_ms = 1e3 * time(dev, 2, 10, &mut step);
            dev.set_cuda_kernel_variant("matmul_tc_symmetric", 1)
                .expect("variant");
            println!(
                "fast Muon step, one layer: mirror by identity GEMM {:.2} ms, symmetric blocks off {:.2} ms; default again {:.2} ms",
                out.fast_identity_ms,
                out.fast_full_ms,
                1e3 * time(dev, 1, 10, &mut step)
            );
        }
    });

    section("fast vs exact", &mut out.errors, || {
        // 2. Fast vs exact on small shapes (the exact mode on the GPU's exact matmul).
        let (shapes, grads) = named_shapes_and_grads(&DEVIATION_SHAPES, &mut rng);
        let t = Instant::now();
        let (exact, _) = one_step(dev, comm, &shapes, &grads, NsMode::Exact);
        let exact_s = t.elapsed().as_secs_f64();
        let (fast, _) = one_step(dev, comm, &shapes, &grads, NsMode::Fast);
        for (i, (name, r, c)) in shapes.iter().enumerate() {
            let rel = rel_fro(&fast[i], &exact[i]);
            let max_abs = fast[i]
                .iter()
                .zip(&exact[i])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let scale = exact[i].iter().map(|v| v.abs()).fold(0f32, f32::max);
            println!(
                "fast vs exact NS, {name} ({} NS GMAC): rel {rel:.3e}, max |diff| {:.3e} of max |O| {:.3e}",
                5.0 * ns_macs(*r, *c) / 1e9,
                max_abs,
                scale
            );
            out.deviation
                .push((name.clone(), rel, f64::from(max_abs) / f64::from(scale)));
        }
        println!("(the exact steps of these shapes took {exact_s:.1} s)");
    });

    section("symmetric blocks vs full", &mut out.errors, || {
        // Symmetric blocks on vs off at Llama sizes (fast mode both).
        if out.symmetric_blocks {
            let (shapes, grads) = named_shapes_and_grads(&BLOCK_SHAPES, &mut rng);
            let (on, _) = one_step(dev, comm, &shapes, &grads, NsMode::Fast);
            dev.set_cuda_kernel_variant("matmul_tc_symmetric", 0)
                .expect("variant");
            let (off, _) = one_step(dev, comm, &shapes, &grads, NsMode::Fast);
            dev.set_cuda_kernel_variant("matmul_tc_symmetric", 1)
                .expect("variant");
            for (i, (name, _, _)) in shapes.iter().enumerate() {
                let rel = rel_fro(&on[i], &off[i]);
                println!("fast NS symmetric blocks vs full GEMMs, {name}: rel {rel:.3e}");
                out.blocks_vs_full.push((name.clone(), rel));
            }
        }
    });

    section("exact", &mut out.errors, || {
        // 3. Exact: one step of each distinct shape of the layer, timed (one run each), with
        // the fast mode on the same gradient beside it (the deviation at Llama sizes). The
        // layer's time is the sum over its matrices (o = q, v = k, up = gate). A shape whose
        // predicted time (from the measured rate) passes 60 s is extrapolated instead.
        let mut rate = 0f64; // multiply-adds per second of the exact mode so far
        let mut per_shape = Vec::new();
        for (r, c) in [
            (1024usize, 4096usize),
            (4096, 4096),
            (14336, 4096),
            (4096, 14336),
        ] {
            let macs = 5.0 * ns_macs(r, c);
            let name = format!("{r}x{c}");
            if rate > 0.0 && macs / rate > 60.0 {
                println!(
                    "exact Muon step, {name}: skipped, ~{:.0} s predicted",
                    macs / rate
                );
                per_shape.push(((r, c), macs / rate, false));
                continue;
            }
            let shapes = vec![(name.clone(), r, c)];
            let grads = vec![rng.gauss_vec(r * c, 1.0)];
            let (exact, secs) = one_step(dev, comm, &shapes, &grads, NsMode::Exact);
            rate = macs / secs;
            let (fast, _) = one_step(dev, comm, &shapes, &grads, NsMode::Fast);
            let rel = rel_fro(&fast[0], &exact[0]);
            let max_abs = fast[0]
                .iter()
                .zip(&exact[0])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let scale = exact[0].iter().map(|v| v.abs()).fold(0f32, f32::max);
            println!(
                "exact Muon step, {name}: {secs:.2} s ({:.0} GMAC/s); fast vs exact: rel {rel:.3e}, max |diff| {max_abs:.3e} of max |O| {scale:.3e}",
                rate / 1e9
            );
            out.deviation
                .push((name.clone(), rel, f64::from(max_abs) / f64::from(scale)));
            out.exact_proxy.push((name, secs, rate / 1e9));
            per_shape.push(((r, c), secs, true));
        }
        let t = |rc: (usize, usize)| {
            per_shape
                .iter()
                .find(|(s, _, _)| *s == rc)
                .map_or(0.0, |(_, t, _)| *t)
        };
        out.exact_measured = per_shape.iter().all(|(_, _, m)| *m);
        out.exact_layer_s = 2.0 * t((1024, 4096))
            + 2.0 * t((4096, 4096))
            + 2.0 * t((14336, 4096))
            + t((4096, 14336));
        println!(
            "exact Muon step, one layer: {:.1} s ({})",
            out.exact_layer_s,
            if out.exact_measured {
                "the sum of the measured steps of its matrices"
            } else {
                "partly extrapolated"
            }
        );
    });

    assert!(
        dev.host_fallback_calls().is_empty(),
        "a timed op took the host fallback: {:?}",
        dev.host_fallback_calls()
    );
    out
}

// ---- 4. layer-wise over GPUs -----------------------------------------------------------------

struct RankTimes {
    step_s: Vec<f64>,
    sync_s: Vec<f64>,
    owned_macs: f64,
    owned_params: usize,
}

/// `layers` layers on this rank of `comm`: bf16 parameters and gradients, fast Muon, the
/// layer-wise plan; times of `protocol::step` and of the gradient sync, per step.
fn layerwise(
    comm: &mut dyn Communicator,
    dev: &mut Device,
    layers: usize,
    steps: usize,
) -> RankTimes {
    let (rank, dp) = (comm.rank(), comm.size());
    let shapes = layer_shapes(layers);
    let max = shapes.iter().map(|(_, r, c)| r * c).max().unwrap_or(0);
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let vals = rng.gauss_vec(max, 0.02);
    let init = |p: usize| vals[..shapes[p].1 * shapes[p].2].to_vec();
    let mut bufs = buffers(
        dev,
        rank,
        dp,
        &shapes,
        key(ParamStorage::Bf16, GradDType::Bf16),
        &init,
    );
    // One bf16 gradient source, copied into every gradient view each step.
    let src = dev.alloc(DType::Bf16, max);
    let g: Vec<bf16> = rng
        .gauss_vec(max, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    dev.upload(src, &g).expect("upload");
    let cfg = MuonConfig::default().with_ns_mode(NsMode::Fast);
    let mut opt = muon(dev, &bufs, cfg, 0.02, &init);
    let owned = bufs.plan().owned(rank).expect("owned pieces");
    let owned_macs = owned
        .iter()
        .map(|o| 5.0 * ns_macs(shapes[o.param].1, shapes[o.param].2))
        .sum();
    let owned_params = owned.len();
    let (mut step_s, mut sync_s) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        protocol::begin_iteration(dev, comm, &mut bufs, &opt).expect("begin");
        for (p, (_, r, c)) in shapes.iter().enumerate() {
            let dst = bufs.accumulation_view(dev, p).expect("grad view");
            dev.copy(src.slice(0..r * c).expect("slice"), dst)
                .expect("copy");
        }
        dev.synchronize().expect("sync");
        comm.barrier().expect("barrier");
        let t = Instant::now();
        bufs.finish_grad_sync(dev, comm).expect("grad sync");
        dev.synchronize().expect("sync");
        sync_s.push(t.elapsed().as_secs_f64());
        comm.barrier().expect("barrier");
        let t = Instant::now();
        let report = protocol::step(dev, comm, &mut bufs, &mut opt).expect("step");
        dev.synchronize().expect("sync");
        step_s.push(t.elapsed().as_secs_f64());
        assert!(!report.skipped, "a step was skipped");
    }
    RankTimes {
        step_s,
        sync_s,
        owned_macs,
        owned_params,
    }
}

struct Multi {
    gpus: usize,
    step_ms: f64,
    sync_ms: f64,
    per_rank: Vec<(usize, f64)>,
}

fn run_layerwise(gpus: usize, layers: usize, steps: usize, warmup: usize) -> Result<Multi, String> {
    let per_rank = run_local_ranks_with(gpus, NcclConfig::default(), |mut comm, mut dev| {
        layerwise(&mut comm, &mut dev, layers, steps)
    })
    .map_err(|e| e.to_string())?
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .map_err(|e| e.to_string())?;
    let worst = |f: &dyn Fn(&RankTimes) -> &Vec<f64>| -> f64 {
        let per_step: Vec<f64> = (warmup..steps)
            .map(|s| per_rank.iter().map(|r| f(r)[s]).fold(0.0, f64::max))
            .collect();
        1e3 * median(per_step)
    };
    Ok(Multi {
        gpus,
        step_ms: worst(&|r| &r.step_s),
        sync_ms: worst(&|r| &r.sync_s),
        per_rank: per_rank
            .iter()
            .map(|r| (r.owned_params, r.owned_macs))
            .collect(),
    })
}

// ---- the torch baseline, the table -----------------------------------------------------------

/// `ms` from the torch script's JSON (a flat object), by running it.
fn torch_baseline(script: &str) -> Result<(f64, String), String> {
    let path = std::env::temp_dir().join(format!("torch_muon_{}.json", std::process::id()));
    let status = std::process::Command::new("python3")
        .arg(script)
        .arg("--json")
        .arg(&path)
        .status()
        .map_err(|e| format!("python3: {e}"))?;
    if !status.success() {
        return Err(format!("{script} failed ({status})"));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    let num = |key: &str| -> Option<f64> {
        let at = text.find(&format!("\"{key}\":"))? + key.len() + 3;
        let rest = text[at..].trim_start();
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || ".eE+-".contains(c)))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    let ms = num("ms").ok_or("no \"ms\" in the torch JSON")?;
    let version = text
        .find("\"torch\": \"")
        .and_then(|i| text[i + 10..].split('"').next().map(str::to_string))
        .unwrap_or_default();
    Ok((ms, version))
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    // `cargo bench` appends `--bench` to every bench target's arguments; it is not a flag here.
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let json_path = arg(&args, "--json");
    let torch_script = arg(&args, "--torch");
    let gpus =
        arg(&args, "--gpus").map_or(2, |v| bounded_or_exit("muon_bench", "--gpus", &v, 1..=64));
    let layers =
        arg(&args, "--layers").map_or(8, |v| bounded_or_exit("muon_bench", "--layers", &v, 1..=64));
    let card = card_name(0);
    println!("card: {card}");

    let one = match run_local_ranks_with(1, NcclConfig::default(), |mut comm, mut dev| {
        one_gpu(&mut comm, &mut dev)
    }) {
        Ok(mut r) => match r.pop() {
            Some(Ok(one)) => one,
            Some(Err(e)) => OneGpu {
                errors: vec![format!("the one-GPU part: {e}")],
                ..OneGpu::default()
            },
            None => OneGpu::default(),
        },
        Err(e) => OneGpu {
            errors: vec![format!("the one-GPU world: {e}")],
            ..OneGpu::default()
        },
    };

    let (steps, warmup) = (6, 2);
    let mut multi = Vec::new();
    for g in [1, gpus] {
        if g == 1 && gpus == 1 && !multi.is_empty() {
            continue;
        }
        match run_layerwise(g, layers, steps, warmup) {
            Ok(m) => {
                println!(
                    "layer-wise, {layers} layers, {g} GPU(s): step {:.1} ms (grad sync before it {:.1} ms); owned per rank: {}",
                    m.step_ms,
                    m.sync_ms,
                    m.per_rank
                        .iter()
                        .map(|(p, macs)| format!("{p} matrices / {:.1} TMAC", macs / 1e12))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                multi.push(m);
            }
            Err(e) => println!("layer-wise on {g} GPU(s) failed: {e}"),
        }
    }

    let torch = torch_script.as_deref().map(torch_baseline);
    if let Some(Err(e)) = &torch {
        println!("torch baseline failed: {e}");
    }
    let torch_ms = match &torch {
        Some(Ok((ms, _))) => Some(*ms),
        _ => None,
    };
    let torch_version = match &torch {
        Some(Ok((_, v))) => v.clone(),
        _ => String::new(),
    };

    // The table.
    let mut t = String::new();
    let _ = writeln!(t, "\nMuon on {card}");
    let _ = writeln!(
        t,
        "one Llama-3-8B layer (q, k, v, o, gate, up, down; 218M parameters), one step, 5 NS iterations, bf16 iterate"
    );
    let _ = writeln!(t, "{:<48} {:>12} {:>12}", "variant", "ms/step", "vs torch");
    let ratio = |ms: f64| torch_ms.map_or("-".to_string(), |t| format!("{:.2}x", t / ms));
    let mut row = |name: &str, ms: f64| {
        let _ = writeln!(t, "{name:<48} {ms:>12.2} {:>12}", ratio(ms));
    };
    row(
        if one.exact_measured {
            "lowbit exact (sum of its matrices' steps)"
        } else {
            "lowbit exact (partly extrapolated)"
        },
        1e3 * one.exact_layer_s,
    );
    row(
        if one.symmetric_blocks {
            "lowbit fast (cuBLASLt, symmetric blocks)"
        } else {
            "lowbit fast (cuBLASLt)"
        },
        one.fast_ms,
    );
    if one.symmetric_blocks {
        row("lowbit fast, mirror by identity GEMM", one.fast_identity_ms);
        row("lowbit fast, symmetric blocks off", one.fast_full_ms);
    }
    if let Some(ms) = torch_ms {
        row(&format!("torch.optim.Muon {torch_version}"), ms);
    }
    let _ = writeln!(
        t,
        "(vs torch: torch's ms / this row's ms, > 1 is faster than torch; target: fast > 1)"
    );
    let _ = writeln!(
        t,
        "\nlayer-wise, {layers} layers, fast mode, bf16 params and grads: whole optimizer step (norm, update, gather)"
    );
    let _ = writeln!(
        t,
        "{:<8} {:>12} {:>14} {:>16} {:>12}",
        "GPUs", "step ms", "layers/s", "speedup", "+grad sync"
    );
    let base = multi.first().map(|m| (m.step_ms, m.step_ms + m.sync_ms));
    for m in &multi {
        let (b, bs) = base.unwrap_or((m.step_ms, m.step_ms));
        let _ = writeln!(
            t,
            "{:<8} {:>12.1} {:>14.1} {:>15.2}x {:>11.2}x",
            m.gpus,
            m.step_ms,
            layers as f64 / (m.step_ms / 1e3),
            b / m.step_ms,
            bs / (m.step_ms + m.sync_ms)
        );
    }
    let _ = writeln!(
        t,
        "(speedup: 1-GPU step time / this step time, target >= 1.7x; +grad sync: the same with the gradient reduction before the step included)"
    );
    for e in &one.errors {
        let _ = writeln!(t, "error: {e}");
    }
    println!("{t}");

    if let Some(path) = json_path {
        let mut j = String::new();
        let _ = write!(
            j,
            "{{\"card\": \"{card}\", \"checks_ok\": {}, ",
            one.checks_ok
        );
        let _ = write!(j, "\"symmetric_blocks\": {}, ", one.symmetric_blocks);
        write_list(&mut j, "errors", &one.errors, |l| {
            format!("\"{}\"", l.replace(['"', '\\', '\n'], "'"))
        });
        write_list(&mut j, "checks", &one.checks, |l| {
            format!("\"{}\"", l.replace('"', "'"))
        });
        write_list(&mut j, "fast_vs_exact", &one.deviation, |(n, r, m)| {
            format!("{{\"shape\": \"{n}\", \"rel_fro\": {r:e}, \"max_abs_over_max\": {m:e}}}")
        });
        write_list(&mut j, "blocks_vs_full", &one.blocks_vs_full, |(n, r)| {
            format!("{{\"shape\": \"{n}\", \"rel_fro\": {r:e}}}")
        });
        write_list(&mut j, "exact_steps", &one.exact_proxy, |(n, s, g)| {
            format!("{{\"shape\": \"{n}\", \"seconds\": {s}, \"gmac_per_s\": {g}}}")
        });
        let _ = write!(
            j,
            "\"layer_ms\": {{\"exact\": {}, \"exact_measured\": {}, \"fast\": {}, \"fast_identity_mirror\": {}, \"fast_blocks_off\": {}, \"torch\": {}}}, ",
            1e3 * one.exact_layer_s,
            one.exact_measured,
            one.fast_ms,
            one.fast_identity_ms,
            if one.symmetric_blocks {
                one.fast_full_ms.to_string()
            } else {
                "null".into()
            },
            torch_ms.map_or("null".to_string(), |v| v.to_string())
        );
        let _ = write!(
            j,
            "\"torch_version\": \"{torch_version}\", \"layers\": {layers}, "
        );
        let _ = write!(
            j,
            "\"layerwise\": [{}]}}",
            multi
                .iter()
                .map(|m| format!(
                    "{{\"gpus\": {}, \"step_ms\": {}, \"grad_sync_ms\": {}, \"owned\": [{}]}}",
                    m.gpus,
                    m.step_ms,
                    m.sync_ms,
                    m.per_rank
                        .iter()
                        .map(|(p, macs)| format!("{{\"matrices\": {p}, \"ns_macs\": {macs}}}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        std::fs::write(&path, j).expect("writing the JSON");
    }
    if !one.checks_ok || !one.errors.is_empty() {
        eprintln!("some matmul_tc checks or sections failed");
        std::process::exit(1);
    }
}

/// A matrix's name, rows and columns.
type NamedShape = (String, usize, usize);

/// Each `(rows, cols)` named `"{rows}x{cols}"`, with a Gaussian gradient for each.
fn named_shapes_and_grads(
    dims: &[(usize, usize)],
    rng: &mut Rng,
) -> (Vec<NamedShape>, Vec<Vec<f32>>) {
    let shapes: Vec<(String, usize, usize)> = dims
        .iter()
        .map(|(r, c)| (format!("{r}x{c}"), *r, *c))
        .collect();
    let grads = shapes
        .iter()
        .map(|(_, r, c)| rng.gauss_vec(r * c, 1.0))
        .collect();
    (shapes, grads)
}

/// Appends `"key": [..], ` to `j`, the array holding `items` mapped by `f`.
fn write_list<T>(j: &mut String, key: &str, items: &[T], f: impl FnMut(&T) -> String) {
    let body = items.iter().map(f).collect::<Vec<_>>().join(", ");
    let _ = write!(j, "\"{key}\": [{body}], ");
}
