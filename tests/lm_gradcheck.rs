//! Whole-model gradient check of the reference language model (`lowbit::train::lm`).
//!
//! The analytic gradient (the hand-written backward through f32 device ops) of the mean
//! cross-entropy with respect to every parameter tensor is compared with central finite
//! differences of an *f64 twin*: a plain host reimplementation of the forward loss, written
//! from the model's description (not from its code paths) and validated first against the f32
//! forward (logits and loss). Finite differences of the f32 forward itself would be noise: with
//! u₃₂ ≈ 6e-8 and a loss near 2, a step h leaves a rounding error of ~u₃₂·2/h in the quotient
//! (1e-2 at h = 1e-5); in f64 it is ~4e-11 and the truncation error h²·f‴/6 ~ 1e-10.
//!
//! Routing (top-k) is piecewise constant; the data seed is chosen so every row's gap between its
//! k-th and (k+1)-th router logit is ≥ `MIN_MARGIN` (far above f32 rounding, so the device and
//! the twin route alike), and an element whose ±h perturbation changes any row's expert set in
//! the twin is skipped and counted. Both expert layouts (grouped and discrete) are checked, with
//! every expert receiving tokens; then the comparator is shown to reject wrong gradients.

use lowbit::device::{DType, Device, View};
use lowbit::model::{Hooks, SplitMix64, Usage};
use lowbit::train::lm::{Lm, LmShape};

/// What hooks return (the one place to adapt if the hooks' error type moves again).
type HookResult<T> = lowbit::buffers::Result<T>;

/// Parameters and gradients in f32 device buffers of our own.
struct F32Hooks {
    params: Vec<View>,
    grads: Vec<View>,
    ready: Vec<usize>,
}

impl Hooks for F32Hooks {
    fn param(&mut self, _: &mut Device, p: usize, _: Usage) -> HookResult<View> {
        Ok(self.params[p])
    }
    fn grad(&mut self, _: &mut Device, p: usize) -> HookResult<View> {
        Ok(self.grads[p])
    }
    fn grad_ready(&mut self, _: &mut Device, p: usize) -> HookResult<()> {
        self.ready[p] += 1;
        Ok(())
    }
}

const BATCH: usize = 12;
/// Central-difference step (f64).
const H: f64 = 1e-5;
/// Smallest allowed gap between a row's k-th and (k+1)-th router logit.
const MIN_MARGIN: f64 = 1e-3;

fn shape(grouped: bool, blocks: usize, top_k: usize) -> LmShape {
    LmShape {
        vocab: 11,
        context: 3,
        embed: 4,
        hidden: 8,
        blocks,
        ffn: 12,
        experts: 4,
        top_k,
        expert_ffn: 6,
        grouped,
    }
}

// ---------------------------------------------------------------------------------------------
// The f64 twin.

/// Named f64 parameters.
struct Params64<'a> {
    names: &'a [String],
    values: &'a [Vec<f64>],
}

impl Params64<'_> {
    fn get(&self, name: &str) -> &[f64] {
        let i = self.names.iter().position(|n| n == name);
        &self.values[i.unwrap_or_else(|| panic!("no parameter {name}"))]
    }

    /// Expert `e`'s weight of projection `fc` (`fc1`/`fc2`), from either layout.
    fn expert(&self, s: &LmShape, fc: &str, e: usize) -> &[f64] {
        if s.grouped {
            let w = self.get(&format!("moe.experts.{fc}.weight"));
            let per = w.len() / s.experts;
            &w[e * per..(e + 1) * per]
        } else {
            self.get(&format!("moe.experts.{e}.{fc}.weight"))
        }
    }
}

/// `y[r] = W·x[r] + b` for rows of `x` (`W` row-major `[out, in]`).
fn linear64(x: &[f64], w: &[f64], b: Option<&[f64]>, inp: usize, out: usize) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len() / inp * out);
    for row in x.chunks_exact(inp) {
        for o in 0..out {
            let wr = &w[o * inp..(o + 1) * inp];
            let dot: f64 = row.iter().zip(wr).map(|(a, b)| a * b).sum();
            y.push(dot + b.map_or(0.0, |b| b[o]));
        }
    }
    y
}

fn rms_norm64(x: &[f64], g: &[f64]) -> Vec<f64> {
    let eps = f64::from(1e-6f32);
    let n = g.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
        let rstd = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().zip(g).map(|(v, g)| v * rstd * g));
    }
    y
}

/// GELU, tanh approximation (the device's constants: √(2/π) and 0.044715 as f32).
fn gelu64(x: f64) -> f64 {
    let beta = f64::from((2.0 / std::f64::consts::PI).sqrt() as f32);
    let kappa = f64::from(0.044715f32);
    0.5 * x * (1.0 + (beta * (x + kappa * x * x * x)).tanh())
}

/// The twin's forward: mean cross-entropy, the logits, and per row the sorted expert set and
/// its routing margin.
struct Forward64 {
    loss: f64,
    logits: Vec<f64>,
    routes: Vec<Vec<usize>>,
    margins: Vec<f64>,
}

fn forward64(s: &LmShape, p: &Params64, tokens: &[u32], targets: &[u32]) -> Forward64 {
    let (b, c, emb, h) = (targets.len(), s.context, s.embed, s.hidden);
    let table = p.get("embed.weight");
    let x0: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| {
            table[t as usize * emb..(t as usize + 1) * emb]
                .iter()
                .copied()
        })
        .collect();
    let mut x = linear64(&x0, p.get("in.weight"), Some(p.get("in.bias")), c * emb, h);
    for k in 0..s.blocks {
        let n = rms_norm64(&x, p.get(&format!("blocks.{k}.norm")));
        let pre = linear64(
            &n,
            p.get(&format!("blocks.{k}.fc1.weight")),
            Some(p.get(&format!("blocks.{k}.fc1.bias"))),
            h,
            s.ffn,
        );
        let act: Vec<f64> = pre.into_iter().map(gelu64).collect();
        let y = linear64(
            &act,
            p.get(&format!("blocks.{k}.fc2.weight")),
            Some(p.get(&format!("blocks.{k}.fc2.bias"))),
            s.ffn,
            h,
        );
        x.iter_mut().zip(&y).for_each(|(x, y)| *x += y);
    }
    // MoE: x + Σ_top-k softmax(chosen logits) · expert(RMSNorm x).
    let n = rms_norm64(&x, p.get("moe.norm"));
    let router = linear64(&n, p.get("moe.router.weight"), None, h, s.experts);
    let mut routes = Vec::with_capacity(b);
    let mut margins = Vec::with_capacity(b);
    for r in 0..b {
        let row = &router[r * s.experts..(r + 1) * s.experts];
        let mut order: Vec<usize> = (0..s.experts).collect();
        order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
        let chosen = &order[..s.top_k];
        margins.push(if s.top_k < s.experts {
            row[order[s.top_k - 1]] - row[order[s.top_k]]
        } else {
            f64::INFINITY
        });
        let mx = chosen
            .iter()
            .map(|&i| row[i])
            .fold(f64::NEG_INFINITY, f64::max);
        let ex: Vec<f64> = chosen.iter().map(|&i| (row[i] - mx).exp()).collect();
        let sum: f64 = ex.iter().sum();
        let nr = &n[r * h..(r + 1) * h];
        for (&e, w) in chosen.iter().zip(&ex) {
            let gate = w / sum;
            let pre = linear64(nr, p.expert(s, "fc1", e), None, h, s.expert_ffn);
            let act: Vec<f64> = pre.into_iter().map(gelu64).collect();
            let y = linear64(&act, p.expert(s, "fc2", e), None, s.expert_ffn, h);
            for (xo, y) in x[r * h..(r + 1) * h].iter_mut().zip(&y) {
                *xo += gate * y;
            }
        }
        let mut set = chosen.to_vec();
        set.sort_unstable();
        routes.push(set);
    }
    let n = rms_norm64(&x, p.get("final.norm"));
    let logits = linear64(
        &n,
        p.get("head.weight"),
        Some(p.get("head.bias")),
        h,
        s.vocab,
    );
    let mut loss = 0.0;
    for (row, &t) in logits.chunks_exact(s.vocab).zip(targets) {
        let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
        loss += lse - row[t as usize];
    }
    Forward64 {
        loss: loss / b as f64,
        logits,
        routes,
        margins,
    }
}

// ---------------------------------------------------------------------------------------------
// The comparator.

// Per element: |g − g_fd| ≤ ATOL_REL · ‖g_fd‖∞ + RTOL · |g_fd| (‖·‖∞ over the tensor, at least
// FLOOR); per tensor: ‖g − g_fd‖₂ ≤ L2_REL · max(‖g_fd‖₂, FLOOR·√n).
//
// Why these: the reference g_fd is accurate to ~1e-10 absolute (f64 rounding ~u₆₄·|L|/h ≈ 4e-11,
// truncation ~h²·f‴/6 ≈ 1e-10), so the comparison measures the f32 backward's own rounding.
// The CPU backend rounds once per op, sums in index order, no FMA; along the ~25 ops between
// the loss and a parameter, with sums of ≤ 36 terms, the error of a gradient element is a few
// u₃₂·√n per op relative to the tensor's gradient scale: ~25·6·6e-8 ≈ 1e-5 as a pessimistic
// bound, ~3e-7 typical (measured: rel_l2 ≤ 5e-7, max ratio ≤ 0.02 with the bounds below). The
// bounds leave 20–50× headroom over the measurements and are still ~100× below what any real
// backward bug produces (a dropped term, a wrong gate or rstd factor, a transposed weight: O(1)
// relative errors); the comparator is shown below to reject a 0.1% scaling of one tensor.
// Results do not depend on the machine (the CPU ops are bitwise reproducible; libm's f64
// exp/tanh/ln differ by an ulp at most).
const RTOL: f64 = 1e-4;
const ATOL_REL: f64 = 1e-5;
const L2_REL: f64 = 1e-5;
const FLOOR: f64 = 1e-9;

/// How well one tensor's analytic gradient matches its finite differences.
#[derive(Debug, Clone, Copy)]
struct Agreement {
    /// Largest |g − g_fd|.
    max_abs: f64,
    /// Largest |g − g_fd| / (ATOL_REL·scale + RTOL·|g_fd|): ≤ 1 passes.
    max_ratio: f64,
    /// ‖g − g_fd‖₂ / max(‖g_fd‖₂, FLOOR·√n).
    rel_l2: f64,
    /// ‖g_fd‖∞.
    scale: f64,
}

impl Agreement {
    fn passes(&self) -> bool {
        self.max_ratio <= 1.0 && self.rel_l2 <= L2_REL
    }
}

/// Compares the analytic gradient `g` with the finite differences `fd` at the checked
/// elements (`fd[i]` is `None` where the element was skipped).
fn compare(g: &[f32], fd: &[Option<f64>]) -> Agreement {
    let pairs: Vec<(f64, f64)> = g
        .iter()
        .zip(fd)
        .filter_map(|(&g, fd)| fd.map(|fd| (f64::from(g), fd)))
        .collect();
    let scale = pairs.iter().map(|p| p.1.abs()).fold(0.0, f64::max);
    let atol = ATOL_REL * scale.max(FLOOR);
    let (mut max_abs, mut max_ratio, mut err2, mut ref2) = (0.0f64, 0.0f64, 0.0, 0.0);
    for &(g, fd) in &pairs {
        let d = (g - fd).abs();
        max_abs = max_abs.max(d);
        max_ratio = max_ratio.max(d / (atol + RTOL * fd.abs()));
        err2 += d * d;
        ref2 += fd * fd;
    }
    let denom = ref2.sqrt().max(FLOOR * (pairs.len() as f64).sqrt());
    Agreement {
        max_abs,
        max_ratio,
        rel_l2: err2.sqrt() / denom,
        scale,
    }
}

// ---------------------------------------------------------------------------------------------

/// Tokens and targets of `BATCH` rows from `seed`.
fn data(s: &LmShape, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = SplitMix64(seed);
    let mut draw = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % s.vocab as u64) as u32)
            .collect()
    };
    let tokens = draw(BATCH * s.context);
    let targets = draw(BATCH);
    (tokens, targets)
}

/// The model's initial values, with norms and biases moved off 1 and 0 so that their
/// gradients and the forward's bias/scale paths are exercised at a generic point.
fn params(s: &LmShape) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64(0xC0FFEE);
    let mut v = s.init(7);
    for (p, info) in v.iter_mut().zip(s.params()) {
        if info.name.ends_with(".norm") {
            p.iter_mut().for_each(|x| *x += 0.25 * rng.uniform());
        } else if info.name.ends_with(".bias") {
            p.iter_mut().for_each(|x| *x += 0.1 * rng.uniform());
        }
    }
    v
}

/// Checks every parameter tensor of the model (all elements of each), printing a line per
/// tensor (`--nocapture`).
fn check(s: LmShape) {
    use std::fmt::Write as _;
    let start = std::time::Instant::now();
    let mut log = String::new();
    let infos = s.params();
    let names: Vec<String> = infos.iter().map(|p| p.name.clone()).collect();
    let init = params(&s);
    let init64: Vec<Vec<f64>> = init
        .iter()
        .map(|p| p.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let twin = |values: &[Vec<f64>], tokens: &[u32], targets: &[u32]| {
        forward64(
            &s,
            &Params64 {
                names: &names,
                values,
            },
            tokens,
            targets,
        )
    };

    // Data whose routing is unambiguous and uses every expert.
    let (tokens, targets, base) = (0..200u64)
        .map(|seed| {
            let (tok, tgt) = data(&s, seed);
            let f = twin(&init64, &tok, &tgt);
            (tok, tgt, f)
        })
        .find(|(_, _, f)| {
            let used = (0..s.experts).all(|e| f.routes.iter().any(|r| r.contains(&e)));
            used && f.margins.iter().all(|&m| m >= MIN_MARGIN)
        })
        .expect("a data seed with clear routing");

    // The analytic gradient.
    let mut dev = Device::cpu();
    let mut hooks = F32Hooks {
        params: Vec::new(),
        grads: Vec::new(),
        ready: vec![0; infos.len()],
    };
    for p in &init {
        let v = dev.alloc(DType::F32, p.len());
        dev.upload(v, p).unwrap();
        hooks.params.push(v);
        let g = dev.alloc(DType::F32, p.len());
        dev.zero(g).unwrap();
        hooks.grads.push(g);
    }
    let mut lm = Lm::new(&mut dev, s, BATCH);
    let logits = lm.logits(&mut dev, &mut hooks, &tokens).unwrap();
    let loss = lm
        .step(&mut dev, &mut hooks, &tokens, &targets, Some(1.0))
        .unwrap();
    assert!(
        hooks.ready.iter().all(|&n| n == 1),
        "every gradient reported ready once: {:?}",
        hooks.ready
    );
    let grads: Vec<Vec<f32>> = hooks
        .grads
        .iter()
        .map(|&g| dev.download(g).unwrap())
        .collect();

    // The twin against the f32 forward.
    let lmax = base.logits.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let logit_err = logits
        .iter()
        .zip(&base.logits)
        .map(|(&a, b)| (f64::from(a) - b).abs())
        .fold(0.0, f64::max);
    let loss_err = (f64::from(loss) - base.loss).abs() / base.loss;
    let _ = writeln!(
        log,
        "{s:?}\n  loss f32 {loss} f64 {:.9} (rel {loss_err:.1e}), max logit err \
         {logit_err:.1e} of {lmax:.2}",
        base.loss
    );
    assert!(loss_err < 1e-6, "loss: f32 {loss} vs f64 {}", base.loss);
    assert!(
        logit_err < 1e-6 * lmax.max(1.0),
        "logits differ by {logit_err}"
    );

    // Central differences of the twin, every element of every tensor.
    let mut values = init64.clone();
    let mut skipped = 0usize;
    let mut results = Vec::new();
    for (t, info) in infos.iter().enumerate() {
        let mut fd = Vec::with_capacity(values[t].len());
        for j in 0..values[t].len() {
            let x = values[t][j];
            values[t][j] = x + H;
            let plus = twin(&values, &tokens, &targets);
            values[t][j] = x - H;
            let minus = twin(&values, &tokens, &targets);
            values[t][j] = x;
            if plus.routes != base.routes || minus.routes != base.routes {
                skipped += 1;
                fd.push(None);
            } else {
                fd.push(Some((plus.loss - minus.loss) / (2.0 * H)));
            }
        }
        let a = compare(&grads[t], &fd);
        let _ = writeln!(
            log,
            "  {:<26} {:>4} el  |g_fd|max {:.2e}  max|err| {:.2e}  ratio {:.3}  rel_l2 {:.2e}",
            info.name,
            fd.len(),
            a.scale,
            a.max_abs,
            a.max_ratio,
            a.rel_l2
        );
        results.push((info.name.clone(), fd, a));
    }
    let _ = writeln!(
        log,
        "  {skipped} elements skipped (routing changed), {:.2} s",
        start.elapsed().as_secs_f64()
    );
    eprint!("{log}");
    assert!(
        skipped * 100
            <= infos
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum(),
        "too many skipped elements: {skipped}"
    );
    let failed: Vec<String> = results
        .iter()
        .filter(|(_, _, a)| !a.passes())
        .map(|(name, _, a)| format!("{name}: {a:?}"))
        .collect();
    assert!(
        failed.is_empty(),
        "analytic gradients disagree with f64 finite differences:\n{}",
        failed.join("\n")
    );
    for (name, _, a) in &results {
        assert!(a.scale > 0.0, "{name}: gradient is identically zero");
    }

    // The comparator rejects wrong gradients: any tensor's sign flipped, any tensor 0.1% off,
    // a single element of a tensor wrong by 0.1% of the tensor's scale.
    for (t, (name, fd, a)) in results.iter().enumerate() {
        let flipped: Vec<f32> = grads[t].iter().map(|g| -g).collect();
        assert!(
            !compare(&flipped, fd).passes(),
            "{name}: sign flip undetected"
        );
        let scaled: Vec<f32> = grads[t].iter().map(|g| g * 1.001).collect();
        assert!(
            !compare(&scaled, fd).passes(),
            "{name}: 0.1% error undetected"
        );
        let mut one = grads[t].clone();
        let j = fd
            .iter()
            .position(|v| v.is_some_and(|v| v.abs() < 0.5 * a.scale))
            .unwrap_or(0);
        one[j] += (1e-3 * a.scale) as f32;
        assert!(
            !compare(&one, fd).passes(),
            "{name}: one wrong element undetected"
        );
    }
}

#[test]
fn lm_gradients_match_f64_finite_differences_grouped_experts() {
    check(shape(true, 2, 2));
}

#[test]
fn lm_gradients_match_f64_finite_differences_discrete_experts() {
    check(shape(false, 2, 2));
}

/// Three of four experts per token, one dense block.
#[test]
fn lm_gradients_match_f64_finite_differences_top3() {
    check(shape(false, 1, 3));
}
