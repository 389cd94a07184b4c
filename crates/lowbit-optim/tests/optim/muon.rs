//! `Muon` against `torch.optim.Muon` (PyTorch 2.13, CPU) and its own invariants, through the
//! public API: buffers planned layer-wise (`PlanConfig::new(dp, ShardingStrategy::LayerWise)`,
//! `DataParallelBuffers::with_plan`), the golden gradients written into the gradient views, and
//! `protocol::begin_iteration` / `finish_grad_sync` / `protocol::step`.
//!
//! - goldens (`golden/muon.json`, made by `golden/gen_muon.py`): masters after every step within
//!   a tolerance per NS dtype, justified at [`TOL_F32`] and [`TOL_BF16`], and wrong variants
//!   (4 NS steps instead of 5, Nesterov flipped) fail that tolerance;
//! - dp 2 layer-wise equals dp 1 bit for bit (persistent f32 and MXFP8 primary weights, a rank
//!   that owns no Muon parameter included);
//! - chained with a distributed AdamW owner in one plan (`with_owner_strategy`): dp 2 = dp 1;
//! - export → import continues bit for bit; a skipped step changes nothing; clipping scales the
//!   gradient before the momentum; memory is masters + momentum + scratch;
//! - refusals: a plan that splits a parameter, a non-matrix parameter, bad hyper-parameters.

use lowbit_buffers::protocol::StepProtocol;
use std::time::Duration;

use lowbit_dev_support::json::Json;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, PlanConfig, QuantKind,
    ShardingPlan, ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::{DType, Device};
use lowbit_optim::{
    InvalidInput, Muon, MuonConfig, MuonLrScale, NsDtype, OptimConfig, OptimError, Optimizer,
    OptimizerState, init_from_full,
};
use lowbit_train::protocol;

// ---- the goldens ------------------------------------------------------------------------------

/// Tolerance on |master − torch| (absolute; masters are O(1): initial values N(0, 0.5²), below
/// 2 in magnitude, where an f32 ulp is at most 1.2e-7) over up to 3 steps with f32
/// Newton–Schulz.
///
/// Why not bitwise: PyTorch's CPU sgemm blocks the k sum and uses FMA, ours sums in index order
/// without FMA; its `lerp` and `add_(alpha)` are FMA-vectorized, ours round twice; it divides by
/// the norm, we multiply by `fl32(1/norm)`. Each of those is about one ulp of the value it
/// produces, the Newton–Schulz quintic can amplify relative input perturbations (its slope at
/// small singular values is `a ≈ 3.4`, five times over), and the orthogonalized update enters a
/// master multiplied by `lr·scale ≤ 0.057`.
/// Measured (goldens from PyTorch 2.13 on x86-64, one thread): max error 1.19e-7 in both
/// configurations, i.e. one ulp of the master: the update itself agrees to far below that.
/// The bound is 8 ulps at the masters' magnitude, headroom for goldens regenerated with another
/// BLAS kernel, and 490x below the smallest wrong variant measured (bf16 NS instead of f32:
/// 4.9e-4; 4 NS steps: 1.3e-2; Nesterov flipped: 1.3e-2), which the test asserts exceed it.
const TOL_F32: f32 = 1e-6;

/// Tolerance on |master − torch| with bf16 Newton–Schulz (`torch.optim.Muon` as is).
///
/// Why larger: the iterate is rounded to bf16 (8 significant bits) after every operation, so a
/// sub-ulp difference in an f32 sum (our order vs PyTorch's) flips a bf16 rounding now and then.
/// A flip moves that element of the iterate by 2^-8 relative, which the remaining NS steps
/// spread over the matrix; an element of the update is O(1/√min(rows, cols)) ≈ 0.1–0.35 and
/// reaches a master times `lr·scale ≤ 0.057`, so one flip costs up to ~2e-5 in a master.
/// Measured: max error 1.5e-8 (`nesterov_original`: no flip at all) and 1.95e-5
/// (`plain_match_rms_adamw`, an 8x16 expert at step 1: a flip). The bound allows five such
/// flips on one element, and is 4.9x below f32 NS run against these bf16 goldens (4.9e-4) and
/// 125x below 4 NS steps or Nesterov flipped (≥ 1.25e-2), which the test asserts exceed it.
const TOL_BF16: f32 = 1e-4;

/// An f32 array stored as 8 hex digits (the bit pattern) per value.
fn f32s(v: &Json) -> Vec<f32> {
    let s = v.text();
    assert_eq!(s.len() % 8, 0);
    (0..s.len() / 8)
        .map(|i| f32::from_bits(u32::from_str_radix(&s[8 * i..8 * i + 8], 16).unwrap()))
        .collect()
}

/// One parameter of a golden configuration.
struct GoldenParam {
    name: String,
    shape: Vec<usize>,
    init: Vec<f32>,
    /// Per step.
    grads: Vec<Vec<f32>>,
    /// Per step, after it: (bf16 NS, f32 NS).
    masters: Vec<(Vec<f32>, Vec<f32>)>,
}

struct GoldenConfig {
    name: String,
    lr: f32,
    muon: MuonConfig,
    params: Vec<GoldenParam>,
}

impl GoldenConfig {
    /// One spec per parameter, all stored as `storage`.
    fn specs(&self, storage: ParamStorage) -> Vec<ParamSpec> {
        self.params
            .iter()
            .map(|p| ParamSpec::new(p.name.clone(), p.shape.clone(), key(storage)))
            .collect()
    }

    /// Each parameter's initial values.
    fn inits(&self) -> Vec<Vec<f32>> {
        self.params.iter().map(|p| p.init.clone()).collect()
    }
}

fn goldens() -> Vec<GoldenConfig> {
    let doc = Json::parse(include_str!("../golden/muon.json")).expect("the golden file parses");
    let coefs: Vec<f32> = doc
        .get("ns_coefficients")
        .arr()
        .iter()
        .map(|c| c.number() as f32)
        .collect();
    let base = MuonConfig::default();
    assert_eq!(
        coefs, base.ns_coefficients,
        "the goldens use PyTorch's coefficients"
    );
    assert_eq!(doc.get("ns_steps").number(), f64::from(base.ns_steps));
    assert_eq!(doc.get("eps").number() as f32, base.eps);
    doc.get("configs")
        .arr()
        .iter()
        .map(|c| {
            let lr_scale = match c.get("adjust_lr_fn").text() {
                "original" => MuonLrScale::Original,
                "match_rms_adamw" => MuonLrScale::MatchRmsAdamW,
                other => panic!("adjust_lr_fn {other}"),
            };
            // The hyper-parameters are f32 values written as doubles: exact.
            let f = |k: &str| {
                let v = c.get(k).number();
                assert_eq!(f64::from(v as f32), v, "{k} is not an f32 value");
                v as f32
            };
            let muon = base
                .with_momentum(f("momentum"))
                .with_nesterov(c.get("nesterov").flag())
                .with_weight_decay(f("weight_decay"))
                .with_lr_scale(lr_scale);
            let params = c
                .get("params")
                .arr()
                .iter()
                .map(|p| {
                    let m = p.get("masters");
                    let (b, f) = (m.get("bf16").arr(), m.get("f32").arr());
                    GoldenParam {
                        name: p.get("name").text().to_string(),
                        shape: p
                            .get("shape")
                            .arr()
                            .iter()
                            .map(|d| d.number() as usize)
                            .collect(),
                        init: f32s(p.get("init")),
                        grads: p.get("grads").arr().iter().map(f32s).collect(),
                        masters: b.iter().zip(f).map(|(b, f)| (f32s(b), f32s(f))).collect(),
                    }
                })
                .collect();
            GoldenConfig {
                name: c.get("name").text().to_string(),
                lr: f("lr"),
                muon,
                params,
            }
        })
        .collect()
}

// ---- driving Muon through the public API ------------------------------------------------------

fn key(storage: ParamStorage) -> BufferKey {
    BufferKey {
        param_storage: storage,
        grad_dtype: GradDType::F32,
        expert: false,
        owner: OptimizerId(0),
    }
}

fn run<T: Send>(dp: usize, f: impl Fn(LocalComm, Device) -> T + Sync) -> Vec<T> {
    run_ranks(
        dp,
        GroupConfig::default().with_timeout(Duration::from_secs(60)),
        f,
    )
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}

/// Layer-wise sharded buffers of `init` on `rank` of `dp`, and a Muon with learning rate `lr`
/// over them.
fn layerwise_muon(
    dev: &mut Device,
    rank: usize,
    dp: usize,
    specs: &[ParamSpec],
    init: &[Vec<f32>],
    muon: MuonConfig,
    lr: f32,
) -> (DataParallelBuffers, Muon) {
    let bufs = buffers(dev, rank, dp, specs, init, ShardingStrategy::LayerWise);
    let mut cb = init_from_full(init);
    let cfg = OptimConfig::new(lr);
    let opt = Muon::new(dev, &bufs, OptimizerId(0), muon, cfg, &mut cb).unwrap();
    (bufs, opt)
}

/// Layer-wise buffers for `dp` ranks on this rank, initialized from `init`.
fn buffers(
    dev: &mut Device,
    rank: usize,
    dp: usize,
    specs: &[ParamSpec],
    init: &[Vec<f32>],
    strategy: ShardingStrategy,
) -> DataParallelBuffers {
    let plan = ShardingPlan::new(specs, &PlanConfig::new(dp, strategy)).unwrap();
    let cfg = DdpConfig::default()
        .with_sharding(strategy)
        .with_overlap(Overlap::None)
        .with_verify(Verify::Full);
    let mut bufs = DataParallelBuffers::with_plan(dev, rank, specs.to_vec(), plan, cfg).unwrap();
    bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
    bufs
}

/// One step: `grads[p]` written into every rank's gradient view (the pre-divided reduction of
/// identical gradients is the gradient itself), the sync, the step.
fn step(
    dev: &mut Device,
    comm: &mut LocalComm,
    bufs: &mut DataParallelBuffers,
    opt: &mut Muon,
    grads: &[&[f32]],
) -> lowbit_optim::StepReport {
    protocol::begin_iteration(dev, comm, bufs, opt).unwrap();
    for (p, g) in grads.iter().enumerate() {
        let dst = bufs.accumulation_view(dev, p).unwrap();
        dev.upload(dst, g).unwrap();
    }
    bufs.finish_grad_sync(dev, comm).unwrap();
    protocol::step(dev, comm, bufs, opt).unwrap()
}

/// Full masters (per parameter) from every rank's shards.
fn assemble(numels: &[usize], per_rank: &[Vec<(usize, Vec<f32>)>]) -> Vec<Vec<f32>> {
    let mut out: Vec<Option<Vec<f32>>> = vec![None; numels.len()];
    for (p, v) in per_rank.iter().flatten() {
        assert!(out[*p].is_none(), "parameter {p} owned twice");
        assert_eq!(v.len(), numels[*p]);
        out[*p] = Some(v.clone());
    }
    out.into_iter()
        .enumerate()
        .map(|(p, v)| v.unwrap_or_else(|| panic!("parameter {p} owned by nobody")))
        .collect()
}

/// Trains `steps` steps of the golden gradients at `dp` ranks with `storage`; returns the full
/// masters after every step (`[step][param]`).
fn train(
    g: &GoldenConfig,
    muon: MuonConfig,
    dp: usize,
    storage: ParamStorage,
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    let specs: Vec<ParamSpec> = g.specs(storage);
    let numels: Vec<usize> = specs.iter().map(|s| s.numel).collect();
    let init: Vec<Vec<f32>> = g.inits();
    let per_rank = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let (mut bufs, mut opt) = layerwise_muon(dev, rank, dp, &specs, &init, muon, g.lr);
        let mut seen: Vec<Vec<(usize, Vec<f32>)>> = Vec::new();
        for t in 0..steps {
            let grads: Vec<&[f32]> = g.params.iter().map(|p| &p.grads[t][..]).collect();
            let report = step(dev, &mut comm, &mut bufs, &mut opt, &grads);
            assert!(!report.skipped);
            assert_eq!(opt.steps(), t as u64 + 1);
            let masters = opt.masters(dev).unwrap();
            assert!(masters.iter().all(|m| m.range == (0..numels[m.param])));
            seen.push(masters.into_iter().map(|m| (m.param, m.values)).collect());
        }
        seen
    });
    (0..steps)
        .map(|t| {
            let at: Vec<Vec<(usize, Vec<f32>)>> = per_rank.iter().map(|r| r[t].clone()).collect();
            assemble(&numels, &at)
        })
        .collect()
}

/// Max |ours − torch| over every parameter, element and step, with where it happened and how
/// many elements (of all steps) differ by more than 2.5e-7 (two ulps at the masters' size).
fn max_error(g: &GoldenConfig, ours: &[Vec<Vec<f32>>], dtype: NsDtype) -> (f32, String) {
    let (mut worst, mut beyond, mut total) = ((0f32, String::new()), 0, 0);
    for (t, step) in ours.iter().enumerate() {
        for (p, got) in step.iter().enumerate() {
            let (b, f) = &g.params[p].masters[t];
            let want = if dtype == NsDtype::Bf16 { b } else { f };
            for (i, (x, y)) in got.iter().zip(want).enumerate() {
                let e = (x - y).abs();
                assert!(e.is_finite(), "{}: non-finite master", g.name);
                total += 1;
                beyond += usize::from(e > 2.5e-7);
                if e > worst.0 {
                    worst = (
                        e,
                        format!("{} step {} `{}`[{i}]", g.name, t + 1, g.params[p].name),
                    );
                }
            }
        }
    }
    (
        worst.0,
        format!("{} ({beyond} of {total} beyond 2 ulps)", worst.1),
    )
}

fn tolerance(dtype: NsDtype) -> f32 {
    match dtype {
        NsDtype::F32 => TOL_F32,
        NsDtype::Bf16 => TOL_BF16,
        _ => unreachable!(),
    }
}

fn check_goldens(dtype: NsDtype) {
    let tol = tolerance(dtype);
    for g in goldens() {
        let steps = g.params[0].grads.len();
        let muon = g.muon.with_ns_dtype(dtype);
        let ours = train(&g, muon, 1, ParamStorage::F32, steps);
        let (err, at) = max_error(&g, &ours, dtype);
        // The masters moved by much more than the tolerance (the comparison is not vacuous).
        let moved = g
            .params
            .iter()
            .flat_map(|p| {
                let last = &p.masters[steps - 1];
                let want = if dtype == NsDtype::Bf16 {
                    &last.0
                } else {
                    &last.1
                };
                p.init.iter().zip(want).map(|(a, b)| (a - b).abs())
            })
            .fold(0f32, f32::max);
        eprintln!(
            "{dtype:?} {}: max error {err:e} at {at} (masters moved up to {moved:e})",
            g.name
        );
        assert!(
            err <= tol,
            "{dtype:?}: max error {err:e} at {at} exceeds {tol:e}"
        );
        assert!(
            moved > 100.0 * tol,
            "{dtype:?} {}: moved only {moved:e}",
            g.name
        );
        // Wrong variants must exceed the tolerance, so it tells right from wrong.
        let wrong = [
            ("4 NS steps", muon.with_ns_steps(4)),
            ("Nesterov flipped", muon.with_nesterov(!muon.nesterov)),
            ("the other NS dtype", muon.with_ns_dtype(other(dtype))),
        ];
        for (what, w) in wrong {
            let (e, at) = max_error(&g, &train(&g, w, 1, ParamStorage::F32, steps), dtype);
            eprintln!("  wrong variant ({what}): max error {e:e} at {at}");
            assert!(
                e > 3.0 * tol,
                "{dtype:?} {}: {what} is within {e:e}",
                g.name
            );
        }
    }
}

fn other(d: NsDtype) -> NsDtype {
    if d == NsDtype::Bf16 {
        NsDtype::F32
    } else {
        NsDtype::Bf16
    }
}

#[test]
fn matches_torch_muon_with_f32_newton_schulz() {
    check_goldens(NsDtype::F32);
}

#[test]
fn matches_torch_muon_with_bf16_newton_schulz() {
    check_goldens(NsDtype::Bf16);
}

// ---- bitwise invariants -----------------------------------------------------------------------

fn golden0() -> GoldenConfig {
    goldens().into_iter().next().unwrap()
}

/// dp 2 layer-wise (each rank updating the matrices it owns whole) gives dp 1's masters bit for
/// bit, with persistent f32 weights and, for matrices that fit MXFP8 blocks, MXFP8 primary
/// weights (staged and gathered every step).
#[test]
fn dp2_layerwise_equals_dp1_bit_for_bit() {
    let g = golden0();
    for dtype in [NsDtype::Bf16, NsDtype::F32] {
        let muon = g.muon.with_ns_dtype(dtype);
        let one = train(&g, muon, 1, ParamStorage::F32, 3);
        let two = train(&g, muon, 2, ParamStorage::F32, 3);
        assert!(
            bits(&one) == bits(&two),
            "{dtype:?}: dp 2 differs from dp 1"
        );
    }
    // MXFP8 storage needs 32-column blocks: a square 32x32 and a grouped [2, 32, 64] tensor.
    let g = mxfp8_config();
    let muon = g.muon;
    let one = train(&g, muon, 1, ParamStorage::Quantized(QuantKind::Mxfp8), 3);
    let two = train(&g, muon, 2, ParamStorage::Quantized(QuantKind::Mxfp8), 3);
    assert!(bits(&one) == bits(&two), "MXFP8: dp 2 differs from dp 1");
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter()
        .map(|s| {
            s.iter()
                .map(|p| p.iter().map(|x| x.to_bits()).collect())
                .collect()
        })
        .collect()
}

/// Deterministic values in `[-scale, scale)`.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A configuration of MXFP8-compatible shapes with generated values (no goldens).
fn mxfp8_config() -> GoldenConfig {
    let shapes = [("sq", vec![32, 32]), ("experts", vec![2, 32, 64])];
    let params = shapes
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            GoldenParam {
                name: name.to_string(),
                shape: shape.clone(),
                init: values(100 + i as u64, n, 0.5),
                grads: (0..3)
                    .map(|t| values(200 + 10 * i as u64 + t, n, 0.1))
                    .collect(),
                masters: Vec::new(),
            }
        })
        .collect();
    GoldenConfig {
        name: "mxfp8".into(),
        lr: 0.02,
        muon: MuonConfig::default(),
        params,
    }
}

/// With one Muon parameter and dp 2, one rank owns nothing: it still takes part in every
/// collective (the gradient sync, the norm, the MXFP8 staging and gather) and the result is
/// dp 1's.
#[test]
fn a_rank_without_muon_parameters_takes_part() {
    let mut g = mxfp8_config();
    g.params.truncate(1);
    let storage = ParamStorage::Quantized(QuantKind::Mxfp8);
    let one = train(&g, g.muon, 1, storage, 3);
    let two = train(&g, g.muon, 2, storage, 3);
    assert!(bits(&one) == bits(&two));
}

/// Export after 2 steps, import into a fresh optimizer whose masters came from other values:
/// the next 2 steps are bitwise those of the uninterrupted run. State of another rule or
/// layout is refused and changes nothing.
#[test]
fn export_import_round_trip_continues_bit_for_bit() {
    let g = golden0();
    let specs: Vec<ParamSpec> = g.specs(ParamStorage::F32);
    let init: Vec<Vec<f32>> = g.inits();
    let grads = |t: usize| -> Vec<&[f32]> { g.params.iter().map(|p| &p.grads[t][..]).collect() };
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let (mut b1, mut o1) = layerwise_muon(dev, rank, 2, &specs, &init, g.muon, g.lr);
        for t in 0..2 {
            step(dev, &mut comm, &mut b1, &mut o1, &grads(t));
        }
        let state = o1.export_state(dev).unwrap();
        assert_eq!(state.len(), 1);
        assert_eq!(state[0].rule, "muon");
        assert_eq!(state[0].steps, 2);
        // The checkpoint's weights are the masters (every rank's), as a resume would load them.
        let masters: Vec<Vec<f32>> = {
            let mine = o1.masters(dev).unwrap();
            let buf = dev.alloc(DType::F32, specs.iter().map(|s| s.numel).sum());
            let offsets: Vec<usize> = specs
                .iter()
                .scan(0, |o, s| {
                    let at = *o;
                    *o += s.numel;
                    Some(at)
                })
                .collect();
            for m in &mine {
                let at = offsets[m.param];
                dev.upload(buf.slice(at..at + m.values.len()).unwrap(), &m.values)
                    .unwrap();
            }
            // Each element is owned by one rank and zero elsewhere: a sum is the union.
            comm.start_all_reduce(dev, buf, lowbit_comm::ReduceOp::Sum)
                .and_then(|w| w.wait(dev))
                .unwrap();
            let all: Vec<f32> = dev.download(buf).unwrap();
            specs
                .iter()
                .zip(&offsets)
                .map(|(s, &o)| all[o..o + s.numel].to_vec())
                .collect()
        };
        let other: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.25; s.numel]).collect();
        let mut b2 = buffers(dev, rank, 2, &specs, &masters, ShardingStrategy::LayerWise);
        let mut cb = init_from_full(&other);
        let cfg = OptimConfig::new(g.lr);
        let mut o2 = Muon::new(dev, &b2, OptimizerId(0), g.muon, cfg, &mut cb).unwrap();
        // Refused: another rule, another owner, a wrong length; nothing changes.
        let before = o2.export_state(dev).unwrap();
        let mut wrong_rule = state.clone();
        wrong_rule[0].rule = "adamw".into();
        let mut wrong_owner = state.clone();
        wrong_owner[0].owner = OptimizerId(7);
        let mut wrong_len = state.clone();
        if let Some(t) = wrong_len[0].tensors.first_mut() {
            t.values.pop();
        }
        for bad in [wrong_rule, wrong_owner, wrong_len] {
            if bad == state {
                continue; // a rank that owns nothing has no tensor to shorten
            }
            let r = o2.import_state(dev, &bad);
            assert!(
                matches!(r, Err(OptimError::Invalid(InvalidInput::StateMismatch(_)))),
                "{r:?}"
            );
            assert!(
                o2.export_state(dev).unwrap() == before,
                "a refused import changed state"
            );
        }
        o2.import_state(dev, &state).unwrap();
        assert!(o2.export_state(dev).unwrap() == state);
        for t in 2..3 {
            step(dev, &mut comm, &mut b1, &mut o1, &grads(t));
            step(dev, &mut comm, &mut b2, &mut o2, &grads(t));
            let (s1, s2): (Vec<OptimizerState>, Vec<OptimizerState>) =
                (o1.export_state(dev).unwrap(), o2.export_state(dev).unwrap());
            assert!(s1 == s2, "rank {rank}: state after step {t}");
            for p in 0..specs.len() {
                let (v1, v2) = (b1.param_view(p).unwrap(), b2.param_view(p).unwrap());
                assert_eq!(dev.read_bytes(v1).unwrap(), dev.read_bytes(v2).unwrap());
            }
        }
    });
}

/// A step whose gradient norm is not finite is skipped: masters, momentum, step count and
/// weights stay bitwise as they were.
#[test]
fn a_non_finite_step_changes_nothing() {
    let g = golden0();
    let specs: Vec<ParamSpec> = g.specs(ParamStorage::Bf16);
    let init: Vec<Vec<f32>> = g.inits();
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let (mut bufs, mut opt) = layerwise_muon(dev, rank, 2, &specs, &init, g.muon, g.lr);
        let grads: Vec<&[f32]> = g.params.iter().map(|p| &p.grads[0][..]).collect();
        step(dev, &mut comm, &mut bufs, &mut opt, &grads);
        let before = opt.export_state(dev).unwrap();
        let weights = |dev: &mut Device, bufs: &DataParallelBuffers| -> Vec<Vec<u8>> {
            (0..specs.len())
                .map(|p| dev.read_bytes(bufs.param_view(p).unwrap()).unwrap())
                .collect()
        };
        let w_before = weights(dev, &bufs);
        let mut poisoned: Vec<Vec<f32>> = g.params.iter().map(|p| p.grads[1].clone()).collect();
        poisoned[2][5] = f32::INFINITY;
        let refs: Vec<&[f32]> = poisoned.iter().map(|v| &v[..]).collect();
        let report = step(dev, &mut comm, &mut bufs, &mut opt, &refs);
        assert!(report.skipped);
        assert!(opt.export_state(dev).unwrap() == before);
        assert_eq!(opt.steps(), 1);
        assert!(weights(dev, &bufs) == w_before);
    });
}

// ---- refusals ---------------------------------------------------------------------------------

fn new_muon(
    specs: &[ParamSpec],
    dp: usize,
    rank: usize,
    strategy: ShardingStrategy,
    muon: MuonConfig,
) -> Result<Muon, OptimError> {
    let mut dev = Device::cpu();
    let init: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.5; s.numel]).collect();
    let bufs = buffers(&mut dev, rank, dp, specs, &init, strategy);
    let mut cb = init_from_full(&init);
    Muon::new(
        &mut dev,
        &bufs,
        OptimizerId(0),
        muon,
        OptimConfig::new(0.01),
        &mut cb,
    )
}

/// Under the distributed rule at dp 2 the one bucket is cut in the middle of `b`: every rank
/// refuses the plan naming `b` (each rank checks every rank's pieces, so all refuse alike).
#[test]
fn a_plan_that_splits_a_parameter_is_refused_on_every_rank() {
    let k = key(ParamStorage::F32);
    let specs = vec![
        ParamSpec::new("a", vec![16, 8], k),
        ParamSpec::new("b", vec![24, 16], k),
        ParamSpec::new("c", vec![8, 8], k),
    ];
    for rank in 0..2 {
        let r = new_muon(
            &specs,
            2,
            rank,
            ShardingStrategy::Distributed,
            MuonConfig::default(),
        );
        match r {
            Err(OptimError::Invalid(InvalidInput::PartialParameter { name, numel, .. })) => {
                assert_eq!(name, "b");
                assert_eq!(numel, 24 * 16);
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        let msg = new_muon(
            &specs,
            2,
            rank,
            ShardingStrategy::Distributed,
            MuonConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("`b`") && msg.contains("LayerWise"), "{msg}");
        // The same parameters planned layer-wise are accepted, and so is dp 1 distributed
        // (one rank owns everything whole).
        new_muon(
            &specs,
            2,
            rank,
            ShardingStrategy::LayerWise,
            MuonConfig::default(),
        )
        .unwrap();
    }
    new_muon(
        &specs,
        1,
        0,
        ShardingStrategy::Distributed,
        MuonConfig::default(),
    )
    .unwrap();
}

#[test]
fn non_matrix_parameters_are_refused() {
    let k = key(ParamStorage::F32);
    for shape in [vec![64], vec![2, 2, 4, 4]] {
        let specs = vec![
            ParamSpec::new("w", vec![8, 8], k),
            ParamSpec::new("odd", shape.clone(), k),
        ];
        match new_muon(
            &specs,
            1,
            0,
            ShardingStrategy::LayerWise,
            MuonConfig::default(),
        ) {
            Err(OptimError::Invalid(InvalidInput::NotAMatrix { name, shape: s })) => {
                assert_eq!(name, "odd");
                assert_eq!(s, shape);
            }
            other => panic!("{shape:?}: {other:?}"),
        }
    }
}

#[test]
fn bad_hyper_parameters_are_refused() {
    let specs = vec![ParamSpec::new("w", vec![8, 8], key(ParamStorage::F32))];
    let base = MuonConfig::default();
    let bad = [
        base.with_ns_steps(0),
        base.with_ns_steps(100),
        base.with_momentum(f32::NAN),
        base.with_momentum(f32::INFINITY),
        base.with_momentum(1.0),
        base.with_momentum(-0.1),
        base.with_eps(0.0),
        base.with_weight_decay(f32::NAN),
        base.with_ns_coefficients([3.4445, f32::NAN, 2.0315]),
    ];
    for cfg in bad {
        assert!(cfg.validate().is_err(), "{cfg:?}");
        let r = new_muon(&specs, 1, 0, ShardingStrategy::LayerWise, cfg);
        assert!(
            matches!(
                r,
                Err(OptimError::Invalid(InvalidInput::Hyper {
                    rule: "Muon",
                    ..
                }))
            ),
            "{cfg:?}: {r:?}"
        );
    }
    let mut dev = Device::cpu();
    let init = vec![vec![0.5; 64]];
    let bufs = buffers(&mut dev, 0, 1, &specs, &init, ShardingStrategy::LayerWise);
    let r = Muon::new(
        &mut dev,
        &bufs,
        OptimizerId(0),
        base,
        OptimConfig::new(f32::NAN),
        &mut init_from_full(&init),
    );
    assert!(matches!(
        r,
        Err(OptimError::Invalid(InvalidInput::LearningRate(_)))
    ));
}

/// `torch.optim.Muon`'s defaults.
#[test]
fn defaults_are_torchs() {
    let d = MuonConfig::default();
    assert_eq!(d.momentum, 0.95);
    assert!(d.nesterov);
    assert_eq!(d.ns_steps, 5);
    assert_eq!(d.ns_coefficients, [3.4445, -4.7750, 2.0315]);
    assert_eq!(d.eps, 1e-7);
    assert_eq!(d.weight_decay, 0.1);
    assert_eq!(d.lr_scale, MuonLrScale::Original);
    assert_eq!(d.ns_dtype, NsDtype::Bf16);
    d.validate().unwrap();
}

/// The learning-rate scales: PyTorch's two rules and Megatron's spectral one (`√max(out, in)`,
/// Emerging-Optimizers' `get_muon_scale_factor(mode="spectral")`).
#[test]
fn lr_scale_factors() {
    assert_eq!(MuonLrScale::Original.factor(16, 8), 2f64.sqrt());
    assert_eq!(MuonLrScale::Original.factor(8, 16), 1.0);
    assert_eq!(MuonLrScale::MatchRmsAdamW.factor(8, 16), 0.2 * 4.0);
    assert_eq!(MuonLrScale::Spectral.factor(8, 16), 4.0);
    assert_eq!(MuonLrScale::Spectral.factor(64, 9), 8.0);
    // Spectral at lr equals MatchRmsAdamW at 5·lr without weight decay (same f32 step size for
    // these shapes), so the factor is what the update uses.
    let mut g = golden0();
    g.muon = g.muon.with_weight_decay(0.0);
    let spectral = train(
        &g,
        g.muon.with_lr_scale(MuonLrScale::Spectral),
        1,
        ParamStorage::F32,
        2,
    );
    g.lr *= 5.0;
    let matched = train(
        &g,
        g.muon.with_lr_scale(MuonLrScale::MatchRmsAdamW),
        1,
        ParamStorage::F32,
        2,
    );
    let diff = spectral
        .iter()
        .flatten()
        .flatten()
        .zip(matched.iter().flatten().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff <= 1e-6, "{diff}");
}

/// Clipping scales the gradient before the momentum: a clipped run equals, bit for bit, an
/// unclipped run fed the gradients multiplied by each step's clip factor.
#[test]
fn clipping_scales_the_gradient_before_the_momentum() {
    let g = golden0();
    let specs: Vec<ParamSpec> = g.specs(ParamStorage::F32);
    let init: Vec<Vec<f32>> = g.inits();
    run(1, |mut comm, mut dev| {
        let dev = &mut dev;
        let make = |dev: &mut Device, cfg: OptimConfig| {
            let bufs = buffers(dev, 0, 1, &specs, &init, ShardingStrategy::LayerWise);
            let opt = Muon::new(
                dev,
                &bufs,
                OptimizerId(0),
                g.muon,
                cfg,
                &mut init_from_full(&init),
            )
            .unwrap();
            (bufs, opt)
        };
        let (mut b1, mut o1) = make(dev, OptimConfig::new(g.lr).with_clip_grad(Some(0.5)));
        let (mut b2, mut o2) = make(dev, OptimConfig::new(g.lr));
        for t in 0..3 {
            let grads: Vec<&[f32]> = g.params.iter().map(|p| &p.grads[t][..]).collect();
            let report = step(dev, &mut comm, &mut b1, &mut o1, &grads);
            assert!(report.clip_coef < 1.0, "{report:?}");
            let scaled: Vec<Vec<f32>> = grads
                .iter()
                .map(|v| v.iter().map(|x| x * report.clip_coef).collect())
                .collect();
            let refs: Vec<&[f32]> = scaled.iter().map(|v| &v[..]).collect();
            step(dev, &mut comm, &mut b2, &mut o2, &refs);
            assert!(
                o1.export_state(dev).unwrap() == o2.export_state(dev).unwrap(),
                "step {t}"
            );
        }
    });
}

/// Memory: fp32 masters and momentum of the owned parameters; scratch for the Nesterov update
/// and `g − buf` (largest parameter, f32) and for Newton–Schulz (largest matrix: the iterate in
/// the NS dtype and its f32 successor; `A` and `B` in f32 and, in bf16 mode, bf16). A rank that
/// owns nothing holds nothing.
#[test]
fn memory_is_masters_momentum_and_scratch() {
    let g = golden0();
    let specs: Vec<ParamSpec> = g.specs(ParamStorage::F32);
    let numel: usize = specs.iter().map(|s| s.numel).sum();
    let (max_numel, max_len, side) = (1024, 1024, 32); // the 32x32 matrix
    for (dtype, ns_bytes) in [(NsDtype::Bf16, 2), (NsDtype::F32, 4)] {
        let m = new_muon(
            &specs,
            1,
            0,
            ShardingStrategy::LayerWise,
            g.muon.with_ns_dtype(dtype),
        )
        .unwrap()
        .memory();
        assert_eq!(m.masters, 4 * numel);
        assert_eq!(m.state, 4 * numel);
        let bf16_copies = if dtype == NsDtype::Bf16 {
            2 * 2 * side * side
        } else {
            0
        };
        let scratch = 2 * 4 * max_numel + (ns_bytes + 4) * max_len + 2 * 4 * side * side;
        assert_eq!(m.grad_scratch, scratch + bf16_copies, "{dtype:?}");
    }
    // One parameter at dp 2: the rank that does not own it holds nothing.
    let one = &specs[..1];
    let held: Vec<usize> = (0..2)
        .map(|r| {
            let m = new_muon(one, 2, r, ShardingStrategy::LayerWise, g.muon)
                .unwrap()
                .memory();
            m.masters + m.state + m.grad_scratch
        })
        .collect();
    assert!(held.contains(&0) && held.iter().any(|&b| b > 0), "{held:?}");
}

/// The intended deployment: Muon's owner planned layer-wise and AdamW's distributed in one plan
/// (`PlanConfig::with_owner_strategy`), chained, MXFP8 primary weights for the matrices. At dp 2
/// every master of both parts equals dp 1's bit for bit.
#[test]
fn chained_with_distributed_adamw_dp2_equals_dp1() {
    let g = mxfp8_config();
    let mxfp8 = ParamStorage::Quantized(QuantKind::Mxfp8);
    let mut specs: Vec<ParamSpec> = g.specs(mxfp8);
    let bias_key = BufferKey {
        owner: OptimizerId(1),
        ..key(ParamStorage::Bf16)
    };
    specs.push(ParamSpec::new("bias", vec![300], bias_key));
    let init: Vec<Vec<f32>> = g
        .params
        .iter()
        .map(|p| p.init.clone())
        .chain([values(7, 300, 0.5)])
        .collect();
    let grads: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|t| {
            g.params
                .iter()
                .map(|p| p.grads[t].clone())
                .chain([values(300 + t as u64, 300, 0.1)])
                .collect()
        })
        .collect();
    let train = |dp: usize| {
        let per_rank = run(dp, |mut comm, mut dev| {
            let dev = &mut dev;
            let rank = comm.rank();
            let pc = PlanConfig::new(dp, ShardingStrategy::Distributed)
                .with_owner_strategy(OptimizerId(0), ShardingStrategy::LayerWise);
            let plan = ShardingPlan::new(&specs, &pc).unwrap();
            let cfg = DdpConfig::default()
                .with_overlap(Overlap::None)
                .with_verify(Verify::Full);
            let mut bufs =
                DataParallelBuffers::with_plan(dev, rank, specs.clone(), plan, cfg).unwrap();
            bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
            let mut cb = init_from_full(&init);
            let cfg = OptimConfig::new(g.lr);
            let muon = Muon::new(dev, &bufs, OptimizerId(0), g.muon, cfg, &mut cb).unwrap();
            let adamw = lowbit_optim::DistributedOptimizer::new(
                dev,
                &bufs,
                OptimizerId(1),
                lowbit_optim::AdamW::default(),
                OptimConfig::new(1e-2),
                &mut cb,
            )
            .unwrap();
            let mut opt =
                lowbit_optim::ChainedOptimizer::new(vec![Box::new(muon), Box::new(adamw)]).unwrap();
            for step_grads in &grads {
                protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
                for (p, gr) in step_grads.iter().enumerate() {
                    let dst = bufs.accumulation_view(dev, p).unwrap();
                    dev.upload(dst, gr).unwrap();
                }
                bufs.finish_grad_sync(dev, &mut comm).unwrap();
                assert!(
                    !protocol::step(dev, &mut comm, &mut bufs, &mut opt)
                        .unwrap()
                        .skipped
                );
            }
            opt.masters(dev).unwrap()
        });
        // Every piece, keyed by (parameter, range), as bits.
        let mut all: Vec<(usize, usize, Vec<u32>)> = per_rank
            .into_iter()
            .flatten()
            .map(|m| {
                (
                    m.param,
                    m.range.start,
                    m.values.iter().map(|x| x.to_bits()).collect(),
                )
            })
            .collect();
        all.sort();
        // Concatenate each parameter's pieces.
        let mut full: Vec<Vec<u32>> = vec![Vec::new(); specs.len()];
        for (p, _, v) in all {
            full[p].extend(v);
        }
        full
    };
    let (one, two) = (train(1), train(2));
    for (p, s) in specs.iter().enumerate() {
        assert_eq!(one[p].len(), s.numel);
        assert!(one[p] == two[p], "`{}`: dp 2 differs from dp 1", s.name);
    }
}
