//! The decoder: [`Llama`], its forward over `lowbit-nn`'s layers and its hand-written backward.
//!
//! Per layer `l` (pre-norm, as Hugging Face's `LlamaDecoderLayer`):
//! `n₁ = RMSNorm(x)`, `q = rope(n₁·W_qᵀ)`, `k = rope(n₁·W_kᵀ)`, `v = n₁·W_vᵀ`,
//! `h = o_proj(attn(q, k, v)) + x`, `x' = down(silu(gate(n₂)) · up(n₂)) + h` with `n₂ =
//! RMSNorm(h)`; then the final RMSNorm and the head (the embedding when tied), whose
//! cross-entropy runs in chunks of rows so that the `[rows, vocab]` logits never exist at once.
//!
//! The backward runs the layers in reverse; the residual stream's gradient is one buffer that
//! each block's two branches add into. Parameters are reported ready in exactly the reverse of
//! [`crate::params::params`]' order.
//!
//! All activations and scratch live in one f32 device buffer carved once by [`Llama::new`]
//! ([`Llama::activation_bytes`] is its size), so a step allocates nothing.

use lowbit_device::{DType, Device, MatmulMode, View};
use lowbit_nn::Hooks;
use lowbit_nn::layers::{
    Attention, ChunkedCrossEntropy, Embedding, GradStart, HeadGrad, InputGrad, Linear, LossScratch,
    RmsNorm, Rope, Scratch, SwiGlu, SwiGluActs, rope_tables, shared_input,
};

use crate::config::LlamaConfig;
use crate::params::{self, EMBEDDING, LayerIds};
use crate::recompute::{Act, ActivationBytes, Recompute, row_bytes};
use crate::{LlamaError, Result};

/// The f32 logits of one chunk of the chunked cross-entropy stay within this many bytes: 1 GiB
/// keeps the head's GEMMs at thousands of rows (5,336 at vocab 50,304; 2,093 at 128,256),
/// where cuBLASLt runs them at GEMM speed; at 64 MiB (333 and 130 rows) the logits product ran
/// at 215 TFLOP/s on an H200, a third of its rate at full size.
pub const LOGITS_CHUNK_BYTES: usize = 1 << 30;

/// One layer's saved activations (views into the arena).
#[derive(Clone, Copy, Debug)]
struct LayerActs {
    /// `RMSNorm(x)`, the q/k/v projections' input.
    n1: View,
    rstd1: View,
    /// Post-RoPE queries and keys, values (attention's inputs).
    q: View,
    k: View,
    v: View,
    /// Attention's output (o_proj's input) and its log-sum-exps.
    att: View,
    lse: View,
    /// The residual after attention, and its norm.
    h: View,
    n2: View,
    rstd2: View,
    /// The MLP's gate, up and `silu(gate)·up`.
    gate: View,
    up: View,
    act: View,
}

impl LayerActs {
    /// The views in [`Act::ALL`]'s order.
    fn from_views(v: [View; 13]) -> LayerActs {
        let [n1, rstd1, q, k, v, att, lse, h, n2, rstd2, gate, up, act] = v;
        LayerActs {
            n1,
            rstd1,
            q,
            k,
            v,
            att,
            lse,
            h,
            n2,
            rstd2,
            gate,
            up,
            act,
        }
    }

    /// The first `rows` token rows of each view.
    fn head(&self, cfg: &LlamaConfig, rows: usize) -> Result<LayerActs> {
        let v = [
            self.n1, self.rstd1, self.q, self.k, self.v, self.att, self.lse, self.h, self.n2,
            self.rstd2, self.gate, self.up, self.act,
        ];
        let mut out = v;
        for ((o, v), a) in out.iter_mut().zip(v).zip(Act::ALL) {
            *o = v.slice(0..rows * a.width(cfg))?;
        }
        Ok(LayerActs::from_views(out))
    }

    fn swiglu(&self) -> SwiGluActs {
        SwiGluActs {
            gate: self.gate,
            up: self.up,
            act: self.act,
        }
    }
}

/// Views carved from one buffer in order.
struct Arena {
    buf: View,
    next: usize,
}

impl Arena {
    fn take(&mut self, n: usize) -> Result<View> {
        let v = self.buf.slice(self.next..self.next + n)?;
        self.next += n;
        Ok(v)
    }
}

/// The f32 word counts [`Llama::new`] carves, in its order (the [`Act::bf16_when_fast`]
/// activations in bf16 when `bf16`); `None` on overflow.
fn arena_sizes(
    cfg: &LlamaConfig,
    batch: usize,
    seq: usize,
    r: Recompute,
    bf16: bool,
) -> Option<Vec<usize>> {
    let rows = batch.checked_mul(seq)?;
    let (d, f, v) = (cfg.dim, cfg.ffn, cfg.vocab);
    let (qw, kw) = cfg.qkv_widths();
    let rd = rows.checked_mul(d)?;
    let rq = rows.checked_mul(qw)?;
    let rk = rows.checked_mul(kw)?;
    let rf = rows.checked_mul(f)?;
    let vd = v.checked_mul(d)?;
    let half = cfg.head_dim / 2;
    let mut s = vec![rows, rows, seq.checked_mul(half)?, seq.checked_mul(half)?];
    for _ in 0..=cfg.layers {
        s.push(rd);
    }
    // The shared slot, then each layer's kept activations.
    let act = |a: Act| a.words(cfg, rows, bf16);
    for a in Act::ALL.into_iter().filter(|&a| r.shares(a)) {
        s.push(act(a)?);
    }
    for _ in 0..cfg.layers {
        for a in Act::ALL.into_iter().filter(|&a| !r.shares(a)) {
            s.push(act(a)?);
        }
    }
    // Final norm; backward buffers; the loss's (logits, losses, two head copies, the bf16
    // logits gradient); the layers' scratch; the tied head's gradient.
    s.extend([rd, rows, rd, rd, rd, rq, rq, rk, rk, rf, rf]);
    let chunk = chunk_rows(cfg, rows);
    let biggest = params::params_max_numel(cfg);
    let cv = chunk.checked_mul(v)?;
    s.extend([cv, rows, vd, vd, cv.div_ceil(2), biggest, biggest]);
    if cfg.tied {
        s.push(vd);
    }
    Some(s)
}

/// Rows per cross-entropy chunk: as many as keep `chunk·vocab` f32 within
/// [`LOGITS_CHUNK_BYTES`], at least 1, at most `rows`.
fn chunk_rows(cfg: &LlamaConfig, rows: usize) -> usize {
    (LOGITS_CHUNK_BYTES / 4 / cfg.vocab).clamp(1, rows.max(1))
}

/// The decoder's activations and scratch for batches of `batch` sequences of `seq` tokens, and
/// its forward and backward over parameters the hooks hold.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    batch: usize,
    seq: usize,
    chunk_rows: usize,
    arena: View,
    ids: View,
    targets: View,
    cos: View,
    sin: View,
    /// What the backward recomputes.
    recompute: Recompute,
    /// The residual stream entering each layer; `x[layers]` enters the final norm.
    x: Vec<View>,
    acts: Vec<LayerActs>,
    nf: View,
    rstdf: View,
    /// Backward: the residual stream's gradient and two of the same width.
    dres: View,
    dn: View,
    dtmp: View,
    datt: View,
    dq: View,
    dk: View,
    dv: View,
    work: [View; 2],
    loss: LossScratch,
    scratch: Scratch,
    /// The tied head's gradient, which the embedding's backward completes.
    embed_grad: Option<View>,
}

impl Llama {
    /// Device bytes [`Llama::new`] allocates for this shape (activations, scratch, the chunked
    /// loss's buffers, two f32 copies of the head's weight), or [`LlamaError::Config`] for an
    /// invalid config or a count that overflows. For a memory check before building.
    pub fn activation_bytes(cfg: &LlamaConfig, batch: usize, seq: usize) -> Result<usize> {
        Self::activation_bytes_with(cfg, batch, seq, Recompute::Off)
    }

    /// [`Llama::activation_bytes`] of [`Llama::with_recompute`]`(.., r)` on a device in the
    /// exact mode.
    pub fn activation_bytes_with(
        cfg: &LlamaConfig,
        batch: usize,
        seq: usize,
        r: Recompute,
    ) -> Result<usize> {
        Self::activation_bytes_in(cfg, batch, seq, r, MatmulMode::Exact)
    }

    /// [`Llama::activation_bytes_with`] on a device in `mode`: under [`MatmulMode::Bf16`] the
    /// norms' outputs and SwiGLU's product are kept in bf16 (their only readers are bf16
    /// products), half their bytes.
    pub fn activation_bytes_in(
        cfg: &LlamaConfig,
        batch: usize,
        seq: usize,
        r: Recompute,
        mode: MatmulMode,
    ) -> Result<usize> {
        cfg.validate()?;
        arena_sizes(cfg, batch, seq, r, mode == MatmulMode::Bf16)
            .and_then(|s| s.iter().try_fold(0usize, |a, &n| a.checked_add(n)))
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(|| {
                LlamaError::Config(format!(
                    "batch {batch} × seq {seq}: the activations' size overflows"
                ))
            })
    }

    /// The same bytes split into what each layer keeps and what is allocated once
    /// ([`ActivationBytes`]): per layer `4 · batch · seq` times the widths of the layer's input
    /// and of its kept activations (`dim` for x, n₁, h, n₂; `heads·head_dim` for q and the
    /// attention output; `kv_heads·head_dim` for k and v; `heads` log-sum-exps; `ffn` for gate,
    /// up and their product; 1 for each norm's inverse RMS), in `mode`
    /// ([`Llama::activation_bytes_in`]: 2 bytes instead of 4 for n₁, n₂ and the product under
    /// [`MatmulMode::Bf16`]).
    pub fn activation_breakdown(
        cfg: &LlamaConfig,
        batch: usize,
        seq: usize,
        r: Recompute,
        mode: MatmulMode,
    ) -> Result<ActivationBytes> {
        let total = Self::activation_bytes_in(cfg, batch, seq, r, mode)?;
        // `total` did not overflow, so neither does any part of it.
        let per_layer = batch * seq * row_bytes(cfg, r, mode == MatmulMode::Bf16).0;
        Ok(ActivationBytes {
            per_layer,
            fixed: total - cfg.layers * per_layer,
        })
    }

    /// Validates `cfg` and the batch shape (`batch, seq > 0`, `seq ≤ max_seq`), allocates every
    /// activation and scratch buffer once, and uploads the RoPE tables for positions
    /// `0..seq`. Every activation is kept ([`Recompute::Off`]).
    pub fn new(dev: &mut Device, cfg: &LlamaConfig, batch: usize, seq: usize) -> Result<Llama> {
        Self::with_recompute(dev, cfg, batch, seq, Recompute::Off)
    }

    /// [`Llama::new`] with the activations `r` names recomputed in the backward: they live in one
    /// slot all layers share ([`Llama::activation_bytes_with`]), and the backward reruns their
    /// forward ops on the weights fetched again through the hooks, so losses and gradients are
    /// bit-identical to [`Recompute::Off`]. The device's matmul mode at this call fixes the
    /// activations' storage ([`Llama::activation_bytes_in`]): built under
    /// [`MatmulMode::Bf16`], the model is for that mode (in another its norms' outputs and
    /// SwiGLU's product would still be rounded to bf16).
    pub fn with_recompute(
        dev: &mut Device,
        cfg: &LlamaConfig,
        batch: usize,
        seq: usize,
        r: Recompute,
    ) -> Result<Llama> {
        cfg.validate()?;
        if batch == 0 || seq == 0 {
            return Err(LlamaError::Input(format!(
                "batch {batch} × seq {seq}: both must be positive"
            )));
        }
        if seq > cfg.max_seq {
            return Err(LlamaError::Input(format!(
                "seq {seq} is longer than the model's max_seq {} (its RoPE table)",
                cfg.max_seq
            )));
        }
        let bf16 = dev.matmul_mode() == MatmulMode::Bf16;
        let total = Self::activation_bytes_in(cfg, batch, seq, r, dev.matmul_mode())? / 4;
        let buf = dev.try_alloc(DType::F32, total)?;
        let mut a = Arena { buf, next: 0 };
        let rows = batch * seq;
        let (d, f, v) = (cfg.dim, cfg.ffn, cfg.vocab);
        let (qw, kw) = cfg.qkv_widths();
        let half = cfg.head_dim / 2;
        let (ids, targets) = (a.take(rows)?, a.take(rows)?);
        let (cos, sin) = (a.take(seq * half)?, a.take(seq * half)?);
        let x = (0..=cfg.layers)
            .map(|_| a.take(rows * d))
            .collect::<Result<Vec<_>>>()?;
        // An activation's view: f32, or bf16 in the f32 words it takes.
        let take_act = |a: &mut Arena, act: Act| -> Result<View> {
            let (n, words) = (
                rows * act.width(cfg),
                act.words(cfg, rows, bf16).unwrap_or(0),
            );
            if bf16 && act.bf16_when_fast(cfg) {
                Ok(a.take(words)?.reinterpret(DType::Bf16)?.slice(0..n)?)
            } else {
                a.take(words)
            }
        };
        let mut shared = [None; 13];
        for (s, act) in shared.iter_mut().zip(Act::ALL) {
            if r.shares(act) {
                *s = Some(take_act(&mut a, act)?);
            }
        }
        let mut acts = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let mut views = [buf; 13];
            for ((view, s), act) in views.iter_mut().zip(shared).zip(Act::ALL) {
                *view = match s {
                    Some(s) => s,
                    None => take_act(&mut a, act)?,
                };
            }
            acts.push(LayerActs::from_views(views));
        }
        let (nf, rstdf) = (a.take(rows * d)?, a.take(rows)?);
        let (dres, dn, dtmp) = (a.take(rows * d)?, a.take(rows * d)?, a.take(rows * d)?);
        let (datt, dq) = (a.take(rows * qw)?, a.take(rows * qw)?);
        let (dk, dv) = (a.take(rows * kw)?, a.take(rows * kw)?);
        let work = [a.take(rows * f)?, a.take(rows * f)?];
        let chunk = chunk_rows(cfg, rows);
        let loss = LossScratch {
            logits: a.take(chunk * v)?,
            losses: a.take(rows)?,
            weight_fwd: a.take(v * d)?,
            weight_bwd: a.take(v * d)?,
            // One chunk's logits gradient in bf16, in f32 words.
            dlogits: Some(
                a.take((chunk * v).div_ceil(2))?
                    .reinterpret(DType::Bf16)?
                    .slice(0..chunk * v)?,
            ),
        };
        let biggest = params::params_max_numel(cfg);
        let scratch = Scratch {
            param: a.take(biggest)?,
            grad: a.take(biggest)?,
        };
        let embed_grad = if cfg.tied { Some(a.take(v * d)?) } else { None };
        debug_assert_eq!(a.next, total, "arena_sizes and new carve the same views");
        let (c, s) = rope_tables(cfg.rope_theta, cfg.head_dim, seq, cfg.rope_scaling.as_ref());
        dev.upload(cos, &c)?;
        dev.upload(sin, &s)?;
        Ok(Llama {
            cfg: cfg.clone(),
            batch,
            seq,
            recompute: r,
            chunk_rows: chunk,
            arena: buf,
            ids,
            targets,
            cos,
            sin,
            x,
            acts,
            nf,
            rstdf,
            dres,
            dn,
            dtmp,
            datt,
            dq,
            dk,
            dv,
            work,
            loss,
            scratch,
            embed_grad,
        })
    }

    /// Frees the model's device memory.
    pub fn free(self, dev: &mut Device) -> Result<()> {
        Ok(dev.free(self.arena)?)
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Sequences per batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// What the backward recomputes.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Rows per chunk of the cross-entropy.
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    fn embedding(&self) -> Embedding {
        Embedding {
            weight: EMBEDDING,
            vocab: self.cfg.vocab,
            dim: self.cfg.dim,
        }
    }

    fn norm(&self, weight: usize) -> RmsNorm {
        RmsNorm::new(weight, self.cfg.dim).with_eps(self.cfg.rms_eps)
    }

    fn head(&self) -> ChunkedCrossEntropy {
        ChunkedCrossEntropy {
            head: Linear::new(params::head_id(&self.cfg), self.cfg.dim, self.cfg.vocab),
            chunk_rows: self.chunk_rows,
        }
    }

    fn attention(&self) -> Attention {
        Attention {
            heads: self.cfg.heads,
            kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn ropes(&self) -> (Rope, Rope) {
        let r = |heads| Rope {
            heads,
            head_dim: self.cfg.head_dim,
        };
        (r(self.cfg.heads), r(self.cfg.kv_heads))
    }

    fn projections(&self, ids: &LayerIds) -> [Linear; 4] {
        let d = self.cfg.dim;
        let (qw, kw) = self.cfg.qkv_widths();
        [
            Linear::new(ids.q, d, qw),
            Linear::new(ids.k, d, kw),
            Linear::new(ids.v, d, kw),
            Linear::new(ids.o, qw, d),
        ]
    }

    fn mlp(&self, ids: &LayerIds) -> SwiGlu {
        SwiGlu::new(ids.gate, ids.up, ids.down, self.cfg.dim, self.cfg.ffn)
    }

    /// Checks token ids against the vocabulary and uploads them (as f32) into the head of `dst`.
    fn upload_ids(&self, dev: &mut Device, what: &str, ids: &[u32], dst: View) -> Result<()> {
        if let Some(i) = ids.iter().position(|&t| t as usize >= self.cfg.vocab) {
            return Err(LlamaError::Input(format!(
                "{what}[{i}] = {} is not below the vocabulary size {}",
                ids[i], self.cfg.vocab
            )));
        }
        let vals: Vec<f32> = ids.iter().map(|&t| t as f32).collect();
        Ok(dev.upload(dst.slice(0..ids.len())?, &vals)?)
    }

    /// Checks a batch's lengths and ids, then uploads tokens and targets.
    fn upload_batch(&self, dev: &mut Device, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let rows = self.rows();
        for (what, v) in [("tokens", tokens), ("targets", targets)] {
            if v.len() != rows {
                return Err(LlamaError::Input(format!(
                    "{what}: {} ids where the model's batch {} × seq {} needs {rows}",
                    v.len(),
                    self.batch,
                    self.seq
                )));
            }
        }
        // Validate both before uploading either, so bad input changes nothing.
        for (what, v) in [("tokens", tokens), ("targets", targets)] {
            if let Some(i) = v.iter().position(|&t| t as usize >= self.cfg.vocab) {
                return Err(LlamaError::Input(format!(
                    "{what}[{i}] = {} is not below the vocabulary size {}",
                    v[i], self.cfg.vocab
                )));
            }
        }
        self.upload_ids(dev, "tokens", tokens, self.ids)?;
        self.upload_ids(dev, "targets", targets, self.targets)
    }

    /// Layer `l`'s attention half over `rows = batch·seq` token rows (`a` sliced to them): from
    /// its input `x`, `n₁ = RMSNorm(x)`, the rotated q, k and v, the attention with its
    /// log-sum-exps, and `h = o_proj(att) + x`. The forward and the full recompute both run this.
    #[allow(clippy::too_many_arguments)]
    fn attention_half(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        l: usize,
        x: View,
        a: &LayerActs,
        batch: usize,
        seq: usize,
    ) -> Result<()> {
        let rows = batch * seq;
        let s = self.scratch;
        let p = params::layer_ids(l);
        let (rq, rk) = self.ropes();
        let [wq, wk, wv, wo] = self.projections(&p);
        self.norm(p.input_norm)
            .forward(dev, hooks, x, a.n1, a.rstd1, s)?;
        // `att` is written only by the attention below: it holds q, k, v's shared bf16
        // input (the bf16 mode; the exact mode keeps n1).
        let n1s = shared_input(dev, a.n1, a.att)?;
        // The projections' f32 outputs, rotated in place; where q and k are kept in bf16 the
        // products land in the backward's dq and dk buffers instead (free in the forward and
        // before a layer's recompute) and the rotation writes the bf16 activations.
        let (q32, k32) = if a.q.dtype() == DType::F32 {
            (a.q, a.k)
        } else {
            (self.dq.slice(0..a.q.len())?, self.dk.slice(0..a.k.len())?)
        };
        wq.forward(dev, hooks, n1s, q32, rows, s)?;
        wk.forward(dev, hooks, n1s, k32, rows, s)?;
        wv.forward(dev, hooks, n1s, a.v, rows, s)?;
        rq.forward(dev, q32, a.q, seq, self.cos, self.sin)?;
        rk.forward(dev, k32, a.k, seq, self.cos, self.sin)?;
        self.attention()
            .forward(dev, a.q, a.k, a.v, a.att, a.lse, batch, seq)?;
        // h = x + att·Woᵀ, the residual added in the GEMM where the mode can.
        Ok(wo.forward_add(dev, hooks, a.att, x, a.h, rows, s)?)
    }

    /// The forward up to the final norm's output (`nf`) over the first `batch·seq` rows.
    fn trunk(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        batch: usize,
        seq: usize,
    ) -> Result<()> {
        let rows = batch * seq;
        let head = |v: View, width: usize| v.slice(0..rows * width);
        let d = self.cfg.dim;
        let s = self.scratch;
        let ids = head(self.ids, 1)?;
        self.embedding()
            .forward(dev, hooks, ids, head(self.x[0], d)?, rows)?;
        for (l, a) in self.acts.iter().enumerate() {
            let p = params::layer_ids(l);
            let a = a.head(&self.cfg, rows)?;
            let (x, x_next) = (head(self.x[l], d)?, head(self.x[l + 1], d)?);
            self.attention_half(dev, hooks, l, x, &a, batch, seq)?;
            self.norm(p.post_norm)
                .forward(dev, hooks, a.h, a.n2, a.rstd2, s)?;
            self.mlp(&p)
                .forward_add(dev, hooks, a.n2, a.h, x_next, rows, a.swiglu(), s)?;
        }
        let last = head(self.x[self.cfg.layers], d)?;
        self.norm(params::final_norm_id(&self.cfg)).forward(
            dev,
            hooks,
            last,
            head(self.nf, d)?,
            head(self.rstdf, 1)?,
            s,
        )?;
        Ok(())
    }

    /// Before layer `l`'s MLP backward: the activations in the shared slot
    /// ([`Recompute::shares`], the same rule that carved it) rerun from the layer's input `x[l]`
    /// with the forward's ops, the attention half first when it is shared too. Only n₁ (and its
    /// inverse RMS) is left for [`Llama::recompute_input_norm`] when the attention half is kept.
    fn recompute_mlp_half(&self, dev: &mut Device, hooks: &mut dyn Hooks, l: usize) -> Result<()> {
        let (a, s, p, r) = (
            &self.acts[l],
            self.scratch,
            params::layer_ids(l),
            self.recompute,
        );
        if r.shares(Act::Att) {
            self.attention_half(dev, hooks, l, self.x[l], a, self.batch, self.seq)?;
        }
        if r.shares(Act::N2) {
            self.norm(p.post_norm)
                .forward(dev, hooks, a.h, a.n2, a.rstd2, s)?;
        }
        if r.shares(Act::Gate) {
            self.mlp(&p)
                .activations(dev, hooks, a.n2, self.rows(), a.swiglu(), s)?;
        } else if r.shares(Act::Product) {
            dev.swiglu(a.gate, a.up, a.act)?;
        }
        Ok(())
    }

    /// Before layer `l`'s q/k/v backward: n₁ again from `x[l]` where it is shared but the
    /// attention half was kept (which [`Llama::recompute_mlp_half`] would have rerun).
    fn recompute_input_norm(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        l: usize,
    ) -> Result<()> {
        let r = self.recompute;
        if r.shares(Act::N1) && !r.shares(Act::Att) {
            let a = &self.acts[l];
            self.norm(params::layer_ids(l).input_norm).forward(
                dev,
                hooks,
                self.x[l],
                a.n1,
                a.rstd1,
                self.scratch,
            )?;
        }
        Ok(())
    }

    /// Where the backward's inverse RoPE puts the q and k gradients: in place in the f32 `dq`,
    /// `dk`, or, where the layer keeps q and k in bf16 (the bf16 mode), as bf16 in the first
    /// MLP work buffer (free once the layer's MLP backward has run): the operands the q and k
    /// projections' backward GEMMs would round them to, so the same bits without a cast pass.
    fn rotated_grads(&self, a: &LayerActs) -> Result<(View, View)> {
        let (nq, nk) = (self.dq.len(), self.dk.len());
        let free = self.work[0];
        if a.q.dtype() != DType::Bf16 || 2 * free.len() < nq + nk + 1 {
            return Ok((self.dq, self.dk));
        }
        let half = |r: std::ops::Range<usize>, n: usize| -> Result<View> {
            Ok(free.slice(r)?.reinterpret(DType::Bf16)?.slice(0..n)?)
        };
        let wq = nq.div_ceil(2);
        Ok((half(0..wq, nq)?, half(wq..wq + nk.div_ceil(2), nk)?))
    }

    /// One microbatch: the mean cross-entropy of predicting `targets` from `tokens` (each
    /// `batch·seq` ids, sequence-major), returned, and the gradients of `scale · loss`
    /// accumulated through the hooks, each parameter reported ready once, in the reverse of the
    /// forward order. Ids at or above the vocabulary are refused before any op.
    pub fn forward_backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
        targets: &[u32],
        scale: f32,
    ) -> Result<f32> {
        self.upload_batch(dev, tokens, targets)?;
        let (batch, seq, rows) = (self.batch, self.seq, self.rows());
        self.trunk(dev, hooks, batch, seq)?;
        let s = self.scratch;
        let head_grad = match self.embed_grad {
            Some(g) => HeadGrad::Keep(g),
            None => HeadGrad::Report,
        };
        let loss = self.head().forward_backward(
            dev,
            hooks,
            self.nf,
            self.targets,
            self.dn,
            rows,
            scale,
            self.loss,
            s,
            head_grad,
        )?;
        let last = self.x[self.cfg.layers];
        self.norm(params::final_norm_id(&self.cfg))
            .backward(dev, hooks, last, self.rstdf, self.dn, self.dres, s)?;
        let (rq, rk) = self.ropes();
        for (l, a) in self.acts.iter().enumerate().rev() {
            let p = params::layer_ids(l);
            let [wq, wk, wv, wo] = self.projections(&p);
            self.recompute_mlp_half(dev, hooks, l)?;
            // MLP branch: dres holds dL/dx'; dh = dres + n₂'s backward of the MLP's dx.
            let acts = a.swiglu();
            self.mlp(&p).backward(
                dev,
                hooks,
                a.n2,
                self.dres,
                InputGrad::Write(self.dn),
                rows,
                acts,
                self.work,
                s,
            )?;
            self.norm(p.post_norm)
                .backward(dev, hooks, a.h, a.rstd2, self.dn, self.dtmp, s)?;
            dev.add(self.dtmp, self.dres)?;
            // Attention branch: dres holds dL/dh.
            wo.backward(
                dev,
                hooks,
                a.att,
                self.dres,
                InputGrad::Write(self.datt),
                rows,
                s,
            )?;
            self.attention().backward(
                dev, a.q, a.k, a.v, a.att, a.lse, self.datt, self.dq, self.dk, self.dv, batch, seq,
            )?;
            let (dq, dk) = self.rotated_grads(a)?;
            rq.backward(dev, self.dq, dq, seq, self.cos, self.sin)?;
            rk.backward(dev, self.dk, dk, seq, self.cos, self.sin)?;
            self.recompute_input_norm(dev, hooks, l)?;
            // `datt` is consumed: it holds the three weight gradients' shared bf16 input.
            let n1s = shared_input(dev, a.n1, self.datt)?;
            wv.backward(dev, hooks, n1s, self.dv, InputGrad::Write(self.dn), rows, s)?;
            wk.backward(dev, hooks, n1s, dk, InputGrad::Add(self.dn), rows, s)?;
            wq.backward(dev, hooks, n1s, dq, InputGrad::Add(self.dn), rows, s)?;
            self.norm(p.input_norm)
                .backward(dev, hooks, self.x[l], a.rstd1, self.dn, self.dtmp, s)?;
            dev.add(self.dtmp, self.dres)?;
        }
        let v_d = self.cfg.vocab * self.cfg.dim;
        let (grad_buf, start) = match self.embed_grad {
            Some(g) => (g, GradStart::Add),
            None => (s.grad.slice(0..v_d)?, GradStart::Zero),
        };
        self.embedding()
            .backward(dev, hooks, self.ids, self.dres, rows, grad_buf, start)?;
        Ok(loss)
    }

    /// The mean cross-entropy of a batch without gradients (no parameter is reported); the
    /// per-row losses stay on the device for [`Llama::row_losses`].
    pub fn eval_loss(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f32> {
        self.upload_batch(dev, tokens, targets)?;
        self.trunk(dev, hooks, self.batch, self.seq)?;
        Ok(self
            .head()
            .forward(dev, hooks, self.nf, self.targets, self.rows(), self.loss)?)
    }

    /// The per-row losses of the last [`Llama::eval_loss`] or [`Llama::forward_backward`]
    /// (`batch·seq`, sequence-major).
    pub fn row_losses(&self, dev: &Device) -> Result<Vec<f32>> {
        Ok(dev.download(self.loss.losses)?)
    }

    /// The logits (`vocab` values) predicting the token after `tokens`, one sequence of
    /// `1..=seq` tokens: the forward over those positions only, then the head on the last.
    pub fn next_logits(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 || n > self.seq {
            return Err(LlamaError::Input(format!(
                "next_logits: {n} tokens where the model takes 1..={}",
                self.seq
            )));
        }
        self.upload_ids(dev, "tokens", tokens, self.ids)?;
        self.trunk(dev, hooks, 1, n)?;
        let d = self.cfg.dim;
        let last = self.nf.slice((n - 1) * d..n * d)?;
        let logits = self.loss.logits.slice(0..self.cfg.vocab)?;
        self.head()
            .head
            .forward(dev, hooks, last, logits, 1, self.scratch)?;
        Ok(dev.download(logits)?)
    }
}
