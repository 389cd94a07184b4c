//! The reference language model of `lowbit train`, on the device layer with a hand-written
//! backward.
//!
//! ```text
//! tokens [B, C] → embed (concat) → Linear(C·E → h) → blocks × [x + fc2(GELU(fc1(RMSNorm x)))]
//!   → MoE: x + Σ_top-k gate · expert_e(RMSNorm x), expert_e = fc2_e(GELU(fc1_e(·)))
//!   → RMSNorm → head Linear(h → V) → softmax cross-entropy
//! ```
//!
//! The linear layers, the norms, the GELUs and the loss are `lowbit-nn`'s layers. The embedding
//! (rows cast straight from the table, their gradients summed per token) and the experts (all
//! experts' weights loaded once, each expert's GEMMs over the rows routed to it, the weight
//! gradients accumulated after the last expert) are this model's own code: their op order is not
//! a plain layer's.
//!
//! Expert weights are either one grouped parameter per projection (`[experts, out, in]`,
//! expert-major) or one parameter per expert ("discrete"); the model computes the same thing in
//! the same order either way, so the two train to the same bits (the grouped tensor is quantized
//! per expert, by `lowbit-buffers`' NVFP4 storage).
//!
//! Routing (top-k of the router logits, the softmax over the chosen logits and its backward)
//! runs on the host over the downloaded `[B, experts]` logits: a few numbers per token, and
//! host arithmetic is identical whatever the device. Ties go to the lower expert index. There is
//! no load-balancing loss and no capacity limit (every routed token is computed).

use lowbit_device::{DType, Device, MatmulSpec, View};
use lowbit_nn::layers::{
    Gelu, InputGrad, Linear, RmsNorm, Scratch, SoftmaxCrossEntropy, accumulate, load_f32,
};

use crate::model::{Hooks, ModelError, SplitMix64, Usage};

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmShape {
    /// Vocabulary.
    pub vocab: usize,
    /// Context tokens per sample.
    pub context: usize,
    /// Embedding width per token.
    pub embed: usize,
    /// Residual width.
    pub hidden: usize,
    /// Dense blocks.
    pub blocks: usize,
    /// Inner width of the dense blocks.
    pub ffn: usize,
    /// Experts of the MoE block.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Inner width of each expert.
    pub expert_ffn: usize,
    /// Expert weights as one grouped parameter per projection (else one per expert).
    pub grouped: bool,
}

/// One parameter of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Name (`blocks.0.fc1.weight`, `moe.experts.fc1.weight`, …).
    pub name: String,
    /// Shape; grouped expert weights are `[experts, out, in]`.
    pub shape: Vec<usize>,
    /// A GEMM weight computed with in low precision under MXFP8/NVFP4. The embedding, the
    /// router and the output head stay high precision, as low-precision recipes keep the
    /// first and last layers and the routing (Megatron's `--first-last-layers-bf16`).
    pub matrix: bool,
    /// Experts stored in this parameter (1 unless grouped).
    pub experts: usize,
    /// Decayed by AdamW (matrices, embedding); norms, biases and the router are not.
    pub decay: bool,
}

/// A dense block's layers: `x + fc2(GELU(fc1(norm x)))`.
#[derive(Clone, Copy, Debug)]
struct Block {
    norm: RmsNorm,
    fc1: Linear,
    fc2: Linear,
}

/// The layers (their parameter indices, in forward order) and the experts' parameter indices.
/// The embedding and the experts are this model's own code.
#[derive(Clone, Debug)]
struct Ids {
    embed: usize,
    input: Linear,
    blocks: Vec<Block>,
    moe_norm: RmsNorm,
    router: Linear,
    /// Grouped: one id each; discrete: one per expert.
    fc1: Vec<usize>,
    fc2: Vec<usize>,
    final_norm: RmsNorm,
    head: Linear,
}

impl LmShape {
    /// Every parameter, in forward order.
    pub fn params(&self) -> Vec<ParamInfo> {
        let (v, h, f) = (self.vocab, self.hidden, self.ffn);
        let p = |name: String, shape: Vec<usize>, matrix: bool, decay: bool| ParamInfo {
            experts: if shape.len() == 3 { shape[0] } else { 1 },
            name,
            shape,
            matrix,
            decay,
        };
        let mut out = vec![
            p("embed.weight".into(), vec![v, self.embed], false, true),
            p(
                "in.weight".into(),
                vec![h, self.context * self.embed],
                true,
                true,
            ),
            p("in.bias".into(), vec![h], false, false),
        ];
        for k in 0..self.blocks {
            out.push(p(format!("blocks.{k}.norm"), vec![h], false, false));
            out.push(p(format!("blocks.{k}.fc1.weight"), vec![f, h], true, true));
            out.push(p(format!("blocks.{k}.fc1.bias"), vec![f], false, false));
            out.push(p(format!("blocks.{k}.fc2.weight"), vec![h, f], true, true));
            out.push(p(format!("blocks.{k}.fc2.bias"), vec![h], false, false));
        }
        out.push(p("moe.norm".into(), vec![h], false, false));
        out.push(p(
            "moe.router.weight".into(),
            vec![self.experts, h],
            false,
            false,
        ));
        let (e, fe) = (self.experts, self.expert_ffn);
        if self.grouped {
            out.push(p(
                "moe.experts.fc1.weight".into(),
                vec![e, fe, h],
                true,
                true,
            ));
            out.push(p(
                "moe.experts.fc2.weight".into(),
                vec![e, h, fe],
                true,
                true,
            ));
        } else {
            for i in 0..e {
                out.push(p(
                    format!("moe.experts.{i}.fc1.weight"),
                    vec![fe, h],
                    true,
                    true,
                ));
            }
            for i in 0..e {
                out.push(p(
                    format!("moe.experts.{i}.fc2.weight"),
                    vec![h, fe],
                    true,
                    true,
                ));
            }
        }
        out.push(p("final.norm".into(), vec![h], false, false));
        out.push(p("head.weight".into(), vec![v, h], false, true));
        out.push(p("head.bias".into(), vec![v], false, false));
        out
    }

    /// The grouped expert tensors (`[experts, out, in]`) of this shape with, for each, the
    /// names of its per-expert parameters in the discrete layout and the elements of one expert:
    /// what converts a checkpoint between the two layouts.
    pub fn expert_groups(&self) -> Vec<(String, Vec<String>, usize)> {
        LmShape {
            grouped: true,
            ..*self
        }
        .params()
        .into_iter()
        .filter(|p| p.shape.len() == 3)
        .map(|p| {
            let parts = (0..p.shape[0]).map(|e| discrete_name(&p.name, e)).collect();
            (p.name, parts, p.shape[1] * p.shape[2])
        })
        .collect()
    }

    fn ids(&self) -> Ids {
        let mut next = 0usize;
        let mut take = || {
            next += 1;
            next - 1
        };
        let (h, f) = (self.hidden, self.ffn);
        // Ids are taken in the order written: a layer's weight before its bias.
        let embed = take();
        let input = Linear::new(take(), self.context * self.embed, h).with_bias(take());
        let blocks = (0..self.blocks)
            .map(|_| Block {
                norm: RmsNorm::new(take(), h),
                fc1: Linear::new(take(), h, f).with_bias(take()),
                fc2: Linear::new(take(), f, h).with_bias(take()),
            })
            .collect();
        let moe_norm = RmsNorm::new(take(), h);
        let router = Linear::new(take(), h, self.experts);
        let n = if self.grouped { 1 } else { self.experts };
        let fc1 = (0..n).map(|_| take()).collect();
        let fc2 = (0..n).map(|_| take()).collect();
        Ids {
            embed,
            input,
            blocks,
            moe_norm,
            router,
            fc1,
            fc2,
            final_norm: RmsNorm::new(take(), h),
            head: Linear::new(take(), h, self.vocab).with_bias(take()),
        }
    }

    /// Deterministic initial values: weights uniform in ±1/√fan_in (each expert's slice of a
    /// grouped tensor drawn exactly as the discrete expert would be), output projections of
    /// residual branches scaled by 1/√(2·layers), norms 1, biases 0, embeddings uniform ±1.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let branch = 1.0 / ((2 * (self.blocks + 1)) as f32).sqrt();
        self.params()
            .into_iter()
            .map(|p| {
                let n: usize = p.shape.iter().product();
                // Seed by name (per expert for grouped tensors), so grouped and discrete draw the
                // same numbers.
                let fan_in = *p.shape.last().unwrap_or(&1) as f32;
                let scale = if p.name.contains("fc2") { branch } else { 1.0 };
                if p.name.ends_with(".norm") {
                    vec![1.0; n]
                } else if p.name.ends_with(".bias") {
                    vec![0.0; n]
                } else {
                    let per = n / p.experts;
                    let mut v = Vec::with_capacity(n);
                    for e in 0..p.experts {
                        let name = if p.experts > 1 {
                            discrete_name(&p.name, e)
                        } else {
                            p.name.clone()
                        };
                        let mut rng = SplitMix64(seed ^ fnv(name.as_bytes()));
                        let bound = if name == "embed.weight" {
                            1.0
                        } else {
                            scale / fan_in.sqrt()
                        };
                        v.extend((0..per).map(|_| bound * rng.uniform()));
                    }
                    v
                }
            })
            .collect()
    }
}

/// Expert `e`'s parameter in the discrete layout of the grouped parameter `grouped`.
fn discrete_name(grouped: &str, e: usize) -> String {
    grouped.replace("experts.", &format!("experts.{e}."))
}

fn fnv(bytes: &[u8]) -> u64 {
    lowbit_io::fnv1a64(bytes)
}

/// Scratch memory of one forward/backward for batches of `batch` rows.
#[derive(Debug)]
pub struct Lm {
    shape: LmShape,
    batch: usize,
    ids: Ids,
    x0: View,
    /// Residual stream: input of block k at index k; index `blocks` is the MoE input and
    /// `blocks + 1` its output.
    res: Vec<View>,
    /// Normalized inputs and their inverse RMS: one per dense block (one shared slot with
    /// recompute, see [`Lm::slot`]), then the MoE's (always last).
    norm: Vec<View>,
    rstd: Vec<View>,
    /// Dense blocks' fc1 outputs and their GELU, per block (one shared slot with recompute).
    h1: Vec<View>,
    g1: Vec<View>,
    /// Activation recompute: the dense blocks keep only their inputs (`res`); the backward
    /// recomputes each block's activations from its input before using them.
    recompute: bool,
    router_logits: View,
    /// Per expert: gathered inputs, pre-activation, activation, output.
    xe: Vec<View>,
    he: Vec<View>,
    ae: Vec<View>,
    ye: Vec<View>,
    final_norm: View,
    final_rstd: View,
    logits: View,
    dlogits: View,
    targets: View,
    dr: View,
    dn: View,
    dtmp: View,
    df: [View; 2],
    dye: View,
    dae: [View; 2],
    dxe: View,
    wbuf: View,
    gbuf: View,
    /// All experts' fc1 / fc2 weights (f32) for the current pass.
    w1: View,
    w2: View,
    gw1: View,
    gw2: View,
    /// Input-layer weight gradient and embedding gradient scratch.
    dw_in: View,
    g_embed: View,
    /// Routing of the last forward: per row, `top_k` (expert, gate) pairs.
    routes: Vec<(usize, f32)>,
    /// Per expert, the rows routed to it (with their slot), in row order.
    assigned: Vec<Vec<(usize, usize)>>,
}

fn mm(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool, acc: bool) -> MatmulSpec {
    MatmulSpec {
        m,
        n,
        k,
        trans_a,
        trans_b,
        accumulate: acc,
    }
}

impl Lm {
    /// Allocates scratch for batches of `batch` rows.
    pub fn new(dev: &mut Device, shape: LmShape, batch: usize) -> Lm {
        let b = batch;
        let (h, f, fe, e) = (shape.hidden, shape.ffn, shape.expert_ffn, shape.experts);
        let mut a = |n: usize| dev.alloc(DType::F32, n);
        let nb = shape.blocks;
        let largest = shape
            .params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .max()
            .unwrap_or(1);
        Lm {
            ids: shape.ids(),
            x0: a(b * shape.context * shape.embed),
            res: (0..nb + 2).map(|_| a(b * h)).collect(),
            norm: (0..nb + 1).map(|_| a(b * h)).collect(),
            rstd: (0..nb + 1).map(|_| a(b)).collect(),
            h1: (0..nb).map(|_| a(b * f)).collect(),
            g1: (0..nb).map(|_| a(b * f)).collect(),
            recompute: false,
            router_logits: a(b * e),
            xe: (0..e).map(|_| a(b * h)).collect(),
            he: (0..e).map(|_| a(b * fe)).collect(),
            ae: (0..e).map(|_| a(b * fe)).collect(),
            ye: (0..e).map(|_| a(b * h)).collect(),
            final_norm: a(b * h),
            final_rstd: a(b),
            logits: a(b * shape.vocab),
            dlogits: a(b * shape.vocab),
            targets: a(b),
            dr: a(b * h),
            dn: a(b * h),
            dtmp: a(b * h),
            df: [a(b * f), a(b * f)],
            dye: a(b * h),
            dae: [a(b * fe), a(b * fe)],
            dxe: a(b * h),
            wbuf: a(largest),
            // Also dx0 of the input layer.
            gbuf: a(largest.max(shape.context * shape.embed * b)),
            w1: a(e * fe * h),
            w2: a(e * h * fe),
            gw1: a(e * fe * h),
            gw2: a(e * h * fe),
            dw_in: a(h * shape.context * shape.embed),
            g_embed: a(shape.vocab * shape.embed),
            routes: Vec::new(),
            assigned: vec![Vec::new(); e],
            shape,
            batch,
        }
    }

    /// With `on`, activation recompute: the dense blocks' activations (normalized input, fc1
    /// output and its GELU) live in one shared slot instead of one per block, and the backward
    /// recomputes them from the block's input, fetching the parameters again for the forward.
    /// The recomputation is the forward's own arithmetic on the same weights, so the results
    /// are bit-identical to recompute off.
    pub fn with_recompute(mut self, dev: &mut Device, on: bool) -> Result<Lm, ModelError> {
        if on && !self.recompute && self.shape.blocks > 1 {
            // Keep slot 0 of each and the MoE's norm (last); free blocks 1.. .
            let nb = self.shape.blocks;
            let freed: Vec<View> = (self.norm.drain(1..nb))
                .chain(self.rstd.drain(1..nb))
                .chain(self.h1.drain(1..))
                .chain(self.g1.drain(1..))
                .collect();
            for v in freed {
                dev.free(v)?;
            }
        }
        self.recompute = self.recompute || on;
        Ok(self)
    }

    /// Rows per batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The activation slot of dense block `k`.
    fn slot(&self, k: usize) -> usize {
        if self.recompute { 0 } else { k }
    }

    /// The index of the MoE's norm and inverse RMS.
    fn moe_slot(&self) -> usize {
        self.norm.len() - 1
    }

    /// Dense block `k`'s forward up to the GELU, from its input `res[k]` into its slot:
    /// normalized input, fc1 output, GELU. The forward and the recompute both run this.
    fn block_activations(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        block: Block,
        k: usize,
    ) -> Result<usize, ModelError> {
        let (j, s) = (self.slot(k), self.scratch());
        let (x, n) = (self.res[k], self.norm[j]);
        block.norm.forward(dev, hooks, x, n, self.rstd[j], s)?;
        block
            .fc1
            .forward(dev, hooks, n, self.h1[j], self.batch, s)?;
        Gelu.forward(dev, self.h1[j], self.g1[j])?;
        Ok(j)
    }

    /// The layers' scratch: parameters cast into `wbuf`, gradients computed into `gbuf`.
    fn scratch(&self) -> Scratch {
        Scratch {
            param: self.wbuf,
            grad: self.gbuf,
        }
    }

    /// Every expert's weights of one projection into `dst` (expert-major), from the grouped
    /// parameter or the discrete ones.
    fn load_experts(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        ids: &[usize],
        dst: View,
        usage: Usage,
    ) -> Result<(), ModelError> {
        let per = dst.len() / ids.len();
        for (i, &p) in ids.iter().enumerate() {
            load_f32(dev, hooks, p, usage, dst.slice(i * per..(i + 1) * per)?)?;
        }
        Ok(())
    }

    fn accumulate_experts(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        ids: &[usize],
        g: View,
    ) -> Result<(), ModelError> {
        let per = g.len() / ids.len();
        for (i, &p) in ids.iter().enumerate() {
            accumulate(dev, hooks, p, g.slice(i * per..(i + 1) * per)?)?;
        }
        Ok(())
    }

    /// Forward of one batch (`tokens`: `batch·context` ids, `targets`: `batch` ids). Returns the
    /// mean cross-entropy. With `loss_scale = Some(s)`, runs the backward too and accumulates
    /// `s ·` the gradients into the hooks' views.
    pub fn step(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
        targets: &[u32],
        loss_scale: Option<f32>,
    ) -> Result<f32, ModelError> {
        let (b, v) = (self.batch, self.shape.vocab);
        if targets.len() != b {
            return Err(ModelError::Input(format!(
                "{} targets for a batch of {b} rows",
                targets.len()
            )));
        }
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
            return Err(ModelError::Input(format!(
                "target {t} outside vocabulary {v}"
            )));
        }
        self.forward(dev, hooks, tokens)?;
        let t: Vec<f32> = targets.iter().map(|&t| t as f32).collect();
        dev.upload(self.targets, &t)?;
        let loss = SoftmaxCrossEntropy.forward(dev, self.logits, self.targets)?;
        let Some(scale) = loss_scale else {
            return Ok(loss);
        };
        self.backward(dev, hooks, tokens, scale)?;
        Ok(loss)
    }

    /// The forward of one batch, returning the logits (`batch·vocab`, row-major).
    pub fn logits(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        self.forward(dev, hooks, tokens)?;
        Ok(dev.download(self.logits)?)
    }

    fn forward(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        let s = self.shape;
        let b = self.batch;
        let (c, emb, v) = (s.context, s.embed, s.vocab);
        if tokens.len() != b * c {
            return Err(ModelError::Input(format!(
                "{} tokens for {b} rows of context {c}",
                tokens.len()
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(ModelError::Input(format!(
                "token {t} outside vocabulary {v}"
            )));
        }
        let ids = self.ids.clone();
        // Embedding: row `tok` of the table into its slot of x0.
        let table = hooks.param(dev, ids.embed, Usage::Forward)?;
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            dev.cast(
                table.slice(t * emb..(t + 1) * emb)?,
                self.x0.slice(i * emb..(i + 1) * emb)?,
            )?;
        }
        let sc = self.scratch();
        ids.input.forward(dev, hooks, self.x0, self.res[0], b, sc)?;
        for (k, &block) in ids.blocks.iter().enumerate() {
            let j = self.block_activations(dev, hooks, block, k)?;
            let y = self.dtmp;
            block.fc2.forward(dev, hooks, self.g1[j], y, b, sc)?;
            dev.copy(self.res[k], self.res[k + 1])?;
            dev.add(y, self.res[k + 1])?;
        }
        self.moe_forward(dev, hooks)?;
        let nb = s.blocks;
        let (x, n) = (self.res[nb + 1], self.final_norm);
        ids.final_norm
            .forward(dev, hooks, x, n, self.final_rstd, sc)?;
        ids.head.forward(dev, hooks, n, self.logits, b, sc)?;
        Ok(())
    }

    /// The backward after [`Lm::forward`] and the loss, accumulating `scale ·` gradients.
    fn backward(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        tokens: &[u32],
        scale: f32,
    ) -> Result<(), ModelError> {
        let s = self.shape;
        let b = self.batch;
        let (c, emb) = (s.context, s.embed);
        let nb = s.blocks;
        let ids = self.ids.clone();
        let sc = self.scratch();
        let (logits, targets, dlogits) = (self.logits, self.targets, self.dlogits);
        SoftmaxCrossEntropy.backward(dev, logits, targets, dlogits, scale)?;
        let dn = InputGrad::Write(self.dn);
        ids.head
            .backward(dev, hooks, self.final_norm, dlogits, dn, b, sc)?;
        let (x, rstd) = (self.res[nb + 1], self.final_rstd);
        ids.final_norm
            .backward(dev, hooks, x, rstd, self.dn, self.dr, sc)?;
        self.moe_backward(dev, hooks)?;
        for (k, &block) in ids.blocks.iter().enumerate().rev() {
            let j = if self.recompute {
                // The slot holds another block's activations (or none): recompute this one's
                // from its input, with the forward's weights.
                self.block_activations(dev, hooks, block, k)?
            } else {
                k
            };
            let df0 = InputGrad::Write(self.df[0]);
            block
                .fc2
                .backward(dev, hooks, self.g1[j], self.dr, df0, b, sc)?;
            Gelu.backward(dev, self.h1[j], self.df[0], self.df[1])?;
            block
                .fc1
                .backward(dev, hooks, self.norm[j], self.df[1], dn, b, sc)?;
            self.norm_backward(dev, hooks, block.norm, k, j)?;
        }
        // The input layer's gradients go through their own scratch: dx0 is the head of the
        // gradient scratch.
        let dx0 = self.gbuf.slice(0..b * c * emb)?;
        let input_scratch = Scratch {
            param: self.wbuf,
            grad: self.dw_in,
        };
        let dx = InputGrad::Write(dx0);
        ids.input
            .backward(dev, hooks, self.x0, self.dr, dx, b, input_scratch)?;
        // Embedding gradient: rows summed in f32 in sample order, then added once.
        let ge = self.g_embed;
        dev.zero(ge)?;
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            dev.axpy(
                1.0,
                dx0.slice(i * emb..(i + 1) * emb)?,
                ge.slice(t * emb..(t + 1) * emb)?,
            )?;
        }
        accumulate(dev, hooks, ids.embed, ge)
    }

    /// `dr ← dr + RMSNorm backward(dn)` of the norm of `res[k]` (inverse RMS in slot `j`) and
    /// the norm weight's gradient.
    fn norm_backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        norm: RmsNorm,
        k: usize,
        j: usize,
    ) -> Result<(), ModelError> {
        let (x, rstd) = (self.res[k], self.rstd[j]);
        norm.backward(dev, hooks, x, rstd, self.dn, self.dtmp, self.scratch())?;
        dev.add(self.dtmp, self.dr)?;
        Ok(())
    }

    fn moe_forward(&mut self, dev: &mut Device, hooks: &mut dyn Hooks) -> Result<(), ModelError> {
        let s = self.shape;
        let (b, h, fe, e, k) = (self.batch, s.hidden, s.expert_ffn, s.experts, s.top_k);
        let nb = s.blocks;
        let ms = self.moe_slot();
        let (x, out) = (self.res[nb], self.res[nb + 1]);
        let ids = self.ids.clone();
        let sc = self.scratch();
        ids.moe_norm
            .forward(dev, hooks, x, self.norm[ms], self.rstd[ms], sc)?;
        ids.router
            .forward(dev, hooks, self.norm[ms], self.router_logits, b, sc)?;
        let logits: Vec<f32> = dev.download(self.router_logits)?;
        self.routes.clear();
        self.assigned.iter_mut().for_each(Vec::clear);
        for (r, row) in logits.chunks_exact(e).enumerate() {
            let chosen = top_k(row, k);
            let gates = softmax(&chosen.iter().map(|&i| row[i]).collect::<Vec<_>>());
            for (slot, (&i, &g)) in chosen.iter().zip(&gates).enumerate() {
                self.routes.push((i, g));
                self.assigned[i].push((r, slot));
            }
        }
        self.load_experts(dev, hooks, &ids.fc1, self.w1, Usage::Forward)?;
        self.load_experts(dev, hooks, &ids.fc2, self.w2, Usage::Forward)?;
        for ex in 0..e {
            let n = self.assigned[ex].len();
            if n == 0 {
                continue;
            }
            for (i, &(r, _)) in self.assigned[ex].iter().enumerate() {
                dev.copy(
                    self.norm[ms].slice(r * h..(r + 1) * h)?,
                    self.xe[ex].slice(i * h..(i + 1) * h)?,
                )?;
            }
            let xe = self.xe[ex].slice(0..n * h)?;
            let he = self.he[ex].slice(0..n * fe)?;
            let ae = self.ae[ex].slice(0..n * fe)?;
            let ye = self.ye[ex].slice(0..n * h)?;
            let w1 = self.w1.slice(ex * fe * h..(ex + 1) * fe * h)?;
            let w2 = self.w2.slice(ex * h * fe..(ex + 1) * h * fe)?;
            dev.matmul(xe, w1, he, &mm(n, fe, h, false, true, false))?;
            Gelu.forward(dev, he, ae)?;
            dev.matmul(ae, w2, ye, &mm(n, h, fe, false, true, false))?;
        }
        // Combine in row order, slots in order: out = x + Σ gate · y.
        dev.copy(x, out)?;
        // `assigned` was filled in this (row, slot) order, so the i-th visit of an expert is
        // row i of its outputs.
        let mut pos = vec![0usize; e];
        for r in 0..b {
            for slot in 0..k {
                let (ex, g) = self.routes[r * k + slot];
                let i = pos[ex];
                pos[ex] += 1;
                dev.axpy(
                    g,
                    self.ye[ex].slice(i * h..(i + 1) * h)?,
                    out.slice(r * h..(r + 1) * h)?,
                )?;
            }
        }
        Ok(())
    }

    fn moe_backward(&mut self, dev: &mut Device, hooks: &mut dyn Hooks) -> Result<(), ModelError> {
        let s = self.shape;
        let (b, h, fe, e, k) = (self.batch, s.hidden, s.expert_ffn, s.experts, s.top_k);
        let nb = s.blocks;
        let ms = self.moe_slot();
        let ids = self.ids.clone();
        // Gate gradients on the host: dgate = dOut · y.
        let dout: Vec<f32> = dev.download(self.dr)?;
        let mut ys: Vec<Vec<f32>> = Vec::with_capacity(e);
        for ex in 0..e {
            let n = self.assigned[ex].len();
            ys.push(dev.download(self.ye[ex].slice(0..n * h)?)?);
        }
        let mut dlogits = vec![0f32; b * e];
        let mut index_in_expert = vec![0usize; b * k];
        for list in &self.assigned {
            for (i, &(r, slot)) in list.iter().enumerate() {
                index_in_expert[r * k + slot] = i;
            }
        }
        for r in 0..b {
            let mut dg = vec![0f32; k];
            for (slot, d) in dg.iter_mut().enumerate() {
                let (ex, _) = self.routes[r * k + slot];
                let i = index_in_expert[r * k + slot];
                *d = dot(&dout[r * h..(r + 1) * h], &ys[ex][i * h..(i + 1) * h]);
            }
            let gates: Vec<f32> = (0..k).map(|slot| self.routes[r * k + slot].1).collect();
            let inner = gates.iter().zip(&dg).fold(0f32, |acc, (g, d)| acc + g * d);
            for (slot, d) in dg.iter().enumerate() {
                let (ex, g) = self.routes[r * k + slot];
                dlogits[r * e + ex] = g * (d - inner);
            }
        }
        // Experts: dY = gate · dOut per routed row.
        self.load_experts(dev, hooks, &ids.fc1, self.w1, Usage::Backward)?;
        self.load_experts(dev, hooks, &ids.fc2, self.w2, Usage::Backward)?;
        dev.zero(self.gw1)?;
        dev.zero(self.gw2)?;
        dev.zero(self.dn)?;
        for ex in 0..e {
            let n = self.assigned[ex].len();
            if n == 0 {
                continue;
            }
            let dye = self.dye.slice(0..n * h)?;
            dev.zero(dye)?;
            for (i, &(r, slot)) in self.assigned[ex].iter().enumerate() {
                let g = self.routes[r * k + slot].1;
                dev.axpy(
                    g,
                    self.dr.slice(r * h..(r + 1) * h)?,
                    dye.slice(i * h..(i + 1) * h)?,
                )?;
            }
            let xe = self.xe[ex].slice(0..n * h)?;
            let he = self.he[ex].slice(0..n * fe)?;
            let ae = self.ae[ex].slice(0..n * fe)?;
            let w1 = self.w1.slice(ex * fe * h..(ex + 1) * fe * h)?;
            let w2 = self.w2.slice(ex * h * fe..(ex + 1) * h * fe)?;
            let gw1 = self.gw1.slice(ex * fe * h..(ex + 1) * fe * h)?;
            let gw2 = self.gw2.slice(ex * h * fe..(ex + 1) * h * fe)?;
            let dae = self.dae[0].slice(0..n * fe)?;
            let dhe = self.dae[1].slice(0..n * fe)?;
            let dxe = self.dxe.slice(0..n * h)?;
            dev.matmul(dye, ae, gw2, &mm(h, fe, n, true, false, false))?;
            dev.matmul(dye, w2, dae, &mm(n, fe, h, false, false, false))?;
            Gelu.backward(dev, he, dae, dhe)?;
            dev.matmul(dhe, xe, gw1, &mm(fe, h, n, true, false, false))?;
            dev.matmul(dhe, w1, dxe, &mm(n, h, fe, false, false, false))?;
            for (i, &(r, _)) in self.assigned[ex].iter().enumerate() {
                dev.axpy(
                    1.0,
                    dxe.slice(i * h..(i + 1) * h)?,
                    self.dn.slice(r * h..(r + 1) * h)?,
                )?;
            }
        }
        self.accumulate_experts(dev, hooks, &ids.fc1, self.gw1)?;
        self.accumulate_experts(dev, hooks, &ids.fc2, self.gw2)?;
        // Router: dWr = dLogitsᵀ · n, dn += dLogits · Wr.
        dev.upload(self.router_logits, &dlogits)?;
        let dn = InputGrad::Add(self.dn);
        let (x, dy) = (self.norm[ms], self.router_logits);
        ids.router
            .backward(dev, hooks, x, dy, dn, b, self.scratch())?;
        self.norm_backward(dev, hooks, ids.moe_norm, nb, ms)
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index; NaN never wins
/// over a number.
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (row[a], row[b]);
        y.partial_cmp(&x)
            .unwrap_or_else(|| x.is_nan().cmp(&y.is_nan()))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// Softmax in f32 (`exp` evaluated in f64 and rounded, like the device ops).
fn softmax(x: &[f32]) -> Vec<f32> {
    let mx = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|&v| f64::from(v - mx).exp() as f32).collect();
    let s = e.iter().fold(0f32, |a, &v| a + v);
    e.iter().map(|&v| v / s).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |acc, (x, y)| acc + x * y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_towards_lower_index() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[f32::NAN, 0.5, -1.0], 2), vec![1, 2]);
    }

    #[test]
    fn grouped_and_discrete_init_agree() {
        let mut s = LmShape {
            vocab: 8,
            context: 2,
            embed: 4,
            hidden: 8,
            blocks: 1,
            ffn: 8,
            experts: 3,
            top_k: 2,
            expert_ffn: 4,
            grouped: true,
        };
        let g: Vec<f32> = s.init(1).concat();
        s.grouped = false;
        let d: Vec<f32> = s.init(1).concat();
        assert_eq!(g, d);
    }
}
