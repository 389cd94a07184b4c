//! Operation descriptions and the argument checks every backend applies before launching.

use std::fmt;

use lowbit_device::{DType, View};

use crate::{CommError, Result};

/// The reduction of reduce-scatter and all-reduce.
///
/// Float dtypes (f32, bf16, f16) are reduced element-wise in f32, in rank order
/// `0, 1, …, size − 1`, and rounded once to the dtype at the end (round-to-nearest-even). u8
/// payloads cannot be reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `((x₀ + x₁) + x₂) + …` in f32.
    Sum,
    /// The f32 sum as for [`ReduceOp::Sum`], then divided by the group size in f32.
    Avg,
    /// The maximum. NaN propagates (any NaN input gives NaN, the first one in rank order);
    /// between equal values (`-0.0` and `+0.0`) the lower rank's wins.
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// The kind of a data-moving collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// See [`Op::AllGather`].
    AllGather,
    /// See [`Op::ReduceScatter`].
    ReduceScatter,
    /// See [`Op::AllReduce`].
    AllReduce,
    /// See [`Op::Broadcast`].
    Broadcast,
}

impl OpKind {
    /// The snake-case name used in error messages and statistics.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One collective of a launch (see `Communicator::start_coalesced`).
///
/// `n` below is the per-rank element count, `size` the group size and `r` the calling rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `output` (`size · n` elements) receives rank `q`'s `input` (`n` elements) at
    /// `[q·n, (q+1)·n)`. Same dtype, any dtype. `input` may be exactly
    /// `output.slice(r·n..(r+1)·n)` (in place, as buckets gather from their own shard); any other
    /// overlap is an error.
    AllGather {
        /// This rank's contribution.
        input: View,
        /// The gathered result.
        output: View,
    },
    /// `output` (`n` elements) receives the reduction over ranks of chunk `r` of `input`
    /// (`size · n` elements). Same float dtype. `output` may be exactly
    /// `input.slice(r·n..(r+1)·n)` (in place); any other overlap is an error.
    ReduceScatter {
        /// This rank's full-size contribution.
        input: View,
        /// This rank's reduced chunk.
        output: View,
        /// The reduction.
        reduce: ReduceOp,
    },
    /// `buf` (float dtype) is replaced by the reduction over ranks of `buf`.
    AllReduce {
        /// Input and output.
        buf: View,
        /// The reduction.
        reduce: ReduceOp,
    },
    /// `buf` is replaced on every rank by `root`'s `buf` (any dtype).
    Broadcast {
        /// Input on `root`, output elsewhere.
        buf: View,
        /// The rank whose data is sent.
        root: usize,
    },
}

impl Op {
    /// Which collective this is.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::AllGather { .. } => OpKind::AllGather,
            Op::ReduceScatter { .. } => OpKind::ReduceScatter,
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::Broadcast { .. } => OpKind::Broadcast,
        }
    }

    /// The bytes this op counts in [`CommStats`](crate::CommStats) ("algorithm bytes" as NCCL's
    /// tests count them): the all-gather output, the reduce-scatter input, the all-reduce or
    /// broadcast buffer.
    pub fn algorithm_bytes(&self) -> usize {
        match self {
            Op::AllGather { output, .. } => output.byte_len(),
            Op::ReduceScatter { input, .. } => input.byte_len(),
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => buf.byte_len(),
        }
    }

    /// The view the op reads.
    fn read_view(&self) -> View {
        match *self {
            Op::AllGather { input, .. } | Op::ReduceScatter { input, .. } => input,
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => buf,
        }
    }

    /// The view the op writes.
    fn write_view(&self) -> View {
        match *self {
            Op::AllGather { output, .. } | Op::ReduceScatter { output, .. } => output,
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => buf,
        }
    }
}

/// What every rank must agree on for one op of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub(crate) kind: OpKind,
    pub(crate) dtype: DType,
    /// Per-rank element count `n` (see [`Op`]).
    pub(crate) count: usize,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) root: Option<usize>,
}

/// Error-message names of a launch and of each of its ops.
pub(crate) fn labels(seq: u64, ops: &[Op]) -> (String, Vec<String>) {
    if let [op] = ops {
        let l = format!("{} #{seq}", op.kind());
        return (l.clone(), vec![l]);
    }
    let kinds: Vec<&str> = ops.iter().map(|o| o.kind().name()).collect();
    let launch = format!("coalesced launch #{seq} [{}]", kinds.join(", "));
    let per_op = ops
        .iter()
        .enumerate()
        .map(|(i, o)| {
            format!(
                "{} (op {i} of {} in coalesced launch #{seq})",
                o.kind(),
                ops.len()
            )
        })
        .collect();
    (launch, per_op)
}

/// Checks one op's arguments on this rank and returns what the ranks must agree on.
fn check_op(op: &Op, rank: usize, size: usize, label: &str) -> Result<OpDesc> {
    let dtype_err = |what: &str, expected: String, got: DType| CommError::DType {
        op: label.to_string(),
        rank,
        what: what.to_string(),
        expected,
        got,
    };
    let float = |what: &str, v: View, reduce: ReduceOp| {
        if v.dtype().is_float() {
            Ok(())
        } else {
            Err(dtype_err(
                what,
                format!("a float dtype (f32, bf16, f16): u8 payloads cannot be reduced ({reduce})"),
                v.dtype(),
            ))
        }
    };
    let same_dtype = |input: View, output: View| {
        if input.dtype() == output.dtype() {
            Ok(())
        } else {
            Err(dtype_err(
                "output",
                format!("{} (the input's dtype)", input.dtype().name()),
                output.dtype(),
            ))
        }
    };
    match *op {
        Op::AllGather { input, output } => {
            same_dtype(input, output)?;
            let n = input.len();
            if output.len() != size * n {
                return Err(CommError::Size {
                    op: label.to_string(),
                    rank,
                    what: format!("output (must be group size {size} x input of {n} elements)"),
                    expected: size * n,
                    got: output.len(),
                });
            }
            if input.overlaps(&output) && output.slice(rank * n..(rank + 1) * n).ok() != Some(input)
            {
                return Err(CommError::Overlap {
                    op: label.to_string(),
                    rank,
                    detail: format!(
                        "input overlaps output; in place, the input must be exactly the output's \
                         elements {}..{} (this rank's slice)",
                        rank * n,
                        (rank + 1) * n
                    ),
                });
            }
            Ok(OpDesc {
                kind: OpKind::AllGather,
                dtype: input.dtype(),
                count: n,
                reduce: None,
                root: None,
            })
        }
        Op::ReduceScatter {
            input,
            output,
            reduce,
        } => {
            same_dtype(input, output)?;
            float("input", input, reduce)?;
            let n = output.len();
            if input.len() != size * n {
                return Err(CommError::Size {
                    op: label.to_string(),
                    rank,
                    what: format!("input (must be group size {size} x output of {n} elements)"),
                    expected: size * n,
                    got: input.len(),
                });
            }
            if input.overlaps(&output) && input.slice(rank * n..(rank + 1) * n).ok() != Some(output)
            {
                return Err(CommError::Overlap {
                    op: label.to_string(),
                    rank,
                    detail: format!(
                        "output overlaps input; in place, the output must be exactly the input's \
                         elements {}..{} (this rank's chunk)",
                        rank * n,
                        (rank + 1) * n
                    ),
                });
            }
            Ok(OpDesc {
                kind: OpKind::ReduceScatter,
                dtype: input.dtype(),
                count: n,
                reduce: Some(reduce),
                root: None,
            })
        }
        Op::AllReduce { buf, reduce } => {
            float("buf", buf, reduce)?;
            Ok(OpDesc {
                kind: OpKind::AllReduce,
                dtype: buf.dtype(),
                count: buf.len(),
                reduce: Some(reduce),
                root: None,
            })
        }
        Op::Broadcast { buf, root } => {
            if root >= size {
                return Err(CommError::Root {
                    op: label.to_string(),
                    rank,
                    root,
                    size,
                });
            }
            Ok(OpDesc {
                kind: OpKind::Broadcast,
                dtype: buf.dtype(),
                count: buf.len(),
                reduce: None,
                root: Some(root),
            })
        }
    }
}

/// Checks a launch on this rank: each op's arguments, and that no op writes memory another op of
/// the same launch reads or writes.
pub(crate) fn check_launch(
    ops: &[Op],
    rank: usize,
    size: usize,
    launch: &str,
    op_labels: &[String],
) -> Result<Vec<OpDesc>> {
    let descs = ops
        .iter()
        .zip(op_labels)
        .map(|(op, label)| check_op(op, rank, size, label))
        .collect::<Result<Vec<_>>>()?;
    for (i, a) in ops.iter().enumerate() {
        for (j, b) in ops.iter().enumerate() {
            if i == j {
                continue;
            }
            let w = a.write_view();
            if w.overlaps(&b.read_view()) || w.overlaps(&b.write_view()) {
                return Err(CommError::Overlap {
                    op: launch.to_string(),
                    rank,
                    detail: format!(
                        "op {i} ({}) writes memory that op {j} ({}) of the same launch uses",
                        a.kind(),
                        b.kind()
                    ),
                });
            }
        }
    }
    Ok(descs)
}

/// Describes one rank's op for mismatch messages.
pub(crate) fn describe_kinds(descs: &[OpDesc]) -> String {
    if let [d] = descs {
        return d.kind.name().to_string();
    }
    let kinds: Vec<&str> = descs.iter().map(|d| d.kind.name()).collect();
    format!("coalesced [{}]", kinds.join(", "))
}

/// Compares what the ranks passed for one launch; the same error on every rank.
pub(crate) fn check_agreement(
    per_rank: &[&[OpDesc]],
    launch: &str,
    op_labels: &[String],
) -> Result<()> {
    let mismatch = |op: &str, what, values: Vec<String>| CommError::Mismatch {
        op: op.to_string(),
        what,
        values,
    };
    let first = per_rank[0];
    if per_rank
        .iter()
        .any(|d| d.len() != first.len() || d.iter().zip(first).any(|(a, b)| a.kind != b.kind))
    {
        return Err(mismatch(
            launch,
            "operation",
            per_rank.iter().map(|d| describe_kinds(d)).collect(),
        ));
    }
    for (i, label) in op_labels.iter().enumerate() {
        let col = |f: &dyn Fn(&OpDesc) -> String| -> Vec<String> {
            per_rank.iter().map(|d| f(&d[i])).collect()
        };
        let d0 = first[i];
        if per_rank.iter().any(|d| d[i].dtype != d0.dtype) {
            return Err(mismatch(label, "dtype", col(&|d| d.dtype.name().into())));
        }
        if per_rank.iter().any(|d| d[i].count != d0.count) {
            let what = match d0.kind {
                OpKind::AllGather => "per-rank input element count",
                OpKind::ReduceScatter => "per-rank output element count",
                OpKind::AllReduce | OpKind::Broadcast => "buffer element count",
            };
            return Err(mismatch(label, what, col(&|d| d.count.to_string())));
        }
        if per_rank.iter().any(|d| d[i].reduce != d0.reduce) {
            return Err(mismatch(
                label,
                "reduction",
                col(&|d| d.reduce.map_or("-".into(), |r| r.to_string())),
            ));
        }
        if per_rank.iter().any(|d| d[i].root != d0.root) {
            return Err(mismatch(
                label,
                "root",
                col(&|d| d.root.map_or("-".into(), |r| r.to_string())),
            ));
        }
    }
    Ok(())
}
