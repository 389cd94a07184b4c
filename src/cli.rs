//! Command-line arguments (clap derive) and dispatch. Each subcommand is a variant of
//! [`Command`] (`quantize`, `dequantize`, `train`, `ckpt`, `data`); a new one (`bench`) adds a variant,
//! an args struct and a match arm in [`run`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use lowbit_formats::{Copies, NanPolicy, ScaleLayout};

use lowbit_io::dequantize::{self, OutDtype};
use lowbit_io::quantize::{self, Options};
use lowbit_io::schema::{Naming, Recipe, Settings};
use lowbit_io::select::{Glob, Select};

use crate::error::CliError;
use crate::report;

/// lowbit: low-precision (MXFP8 / NVFP4) weights with Transformer Engine's exact bits.
#[derive(Debug, Parser)]
#[command(
    name = "lowbit",
    version = crate::metrics::VERSION,
    propagate_version = true,
    // A flag given twice keeps its last value, so the command line overrides `--config`'s.
    args_override_self = true,
    after_help = "Examples:\n  \
        lowbit quantize model.safetensors model.mxfp8.safetensors --recipe mxfp8\n  \
        lowbit quantize model.safetensors w.nvfp4.safetensors --recipe nvfp4 --scale-layout swizzled\n  \
        lowbit dequantize model.mxfp8.safetensors model.restored.safetensors --dtype f32\n  \
        lowbit quantize --demo    (generates, quantizes and dequantizes an example file)\n  \
        lowbit train              (the reference run: 4 CPU ranks, MXFP8 primary weights)\n  \
        lowbit train --precision nvfp4 --ranks 2 --json\n  \
        lowbit train --optimizer muon   (Muon layer-wise on the matrices, AdamW on the rest)\n  \
        lowbit train --save ckpt --save-every 50; lowbit train --resume ckpt --save ckpt   (continue)\n  \
        lowbit ckpt export ckpt model.safetensors --dtype bf16\n  \
        lowbit data prepare texts/*.txt --out tokens --tokenizer gpt2 --validation 0.1"
)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Quantize the GEMM weights (or the tensors chosen) of a safetensors file to MXFP8 or NVFP4.
    ///
    /// By default only tensors of 2+ dimensions whose names do not look like norms, embeddings,
    /// biases or the output head are quantized (--include, --exclude, --all choose otherwise);
    /// the others are copied bit for bit. Each quantized tensor W of shape [d0, …, N] is viewed
    /// as an M×N matrix (M = d0·…; 1D is one row, a scalar is 1×1) and written as
    /// W.rowwise_data / W.rowwise_scale_inv / W.columnwise_data / W.columnwise_scale_inv (NVFP4
    /// adds W.amax), bit-identical to Transformer Engine (layout: docs/format.md). Integer and
    /// bool tensors are copied unchanged; other float dtypes are refused when selected. The recipe and each tensor's original dtype and shape go into __metadata__
    /// (lowbit.* keys), so `lowbit dequantize` can restore them. Prints a per-tensor table of
    /// round-trip errors (SQNR, max |err|) and sizes.
    Quantize(QuantizeArgs),
    /// Rebuild high-precision tensors from a file written by `lowbit quantize`.
    ///
    /// Uses the rowwise copy of each tensor (the columnwise one if that is all there is),
    /// restores the original shape and, unless --dtype says otherwise, the original dtype.
    /// Tensors that were copied by quantize are copied again.
    Dequantize(DequantizeArgs),
    /// Train the reference MoE language model across data-parallel ranks.
    ///
    /// A synthetic order-2 Markov source with a known entropy rate (the loss floor), or the
    /// bytes of --data FILE. Prints a progress line on stderr and, at the end, the final loss
    /// beside the floor, memory per rank beside a bf16 unsharded baseline, bytes per collective
    /// and time per phase (or, with --json, one JSON object with every step's loss and grad norm
    /// as decimals and f32 bit patterns, and a checksum of the final fp32 masters).
    Train(Box<crate::train_cmd::TrainArgs>),
    /// Inspect, verify or export a checkpoint written by `lowbit train --save DIR`.
    ///
    /// A checkpoint root holds `step-N` directories (a manifest.json and one safetensors file of
    /// fp32 masters and optimizer state per rank) and a `latest` pointer; every command takes
    /// the root (its latest) or a `step-N` directory.
    Ckpt(crate::ckpt_cmd::CkptArgs),
    /// Prepare text files into token shards for the Llama models, or inspect prepared ones.
    ///
    /// `lowbit data prepare INPUT... --out DIR` tokenizes (GPT-2 BPE or bytes) into
    /// train/validation shards with a manifest of counts and hashes; `lowbit data inspect DIR`
    /// verifies them and prints their counts and first tokens.
    Data(crate::data_cmd::DataArgs),
    /// Evaluate a checkpoint's weights on held-out data: the mean validation loss.
    ///
    /// The run is rebuilt from the checkpoint's manifest (model, precision, optimizer), so the
    /// weights are exactly those the training run evaluated after that step.
    Eval(crate::eval_cmd::EvalArgs),
    /// Draw the curves of `lowbit train --metrics` files into one SVG picture.
    ///
    /// One colour per file (legend: the run's name, its file stem by default): training loss
    /// with the evals as circles, or the eval loss, gradient norm, learning rates or tokens/s,
    /// over steps or training tokens.
    Plot(crate::plot_cmd::PlotArgs),
    /// Continue a prompt with a decoder checkpoint's weights (greedy or sampled), so a person
    /// can see what the model learned.
    Generate(crate::eval_cmd::GenerateArgs),
}

/// Arguments of `lowbit quantize`.
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Input safetensors file.
    #[arg(value_name = "IN", required_unless_present = "demo")]
    pub input: Option<PathBuf>,
    /// Output safetensors file (written to a new temporary file with an unpredictable name in
    /// the same directory, then renamed into place; temporaries of killed runs are removed).
    #[arg(value_name = "OUT", required_unless_present = "demo")]
    pub output: Option<PathBuf>,
    /// Quantization recipe.
    #[arg(long, value_enum, default_value_t = Recipe::Mxfp8)]
    pub recipe: Recipe,
    /// Which quantized copies to write.
    #[arg(long, value_enum, default_value_t = Copies::Both)]
    pub copies: Copies,
    /// One scale per 32x32 (MXFP8) or 16x16 (NVFP4) tile, shared by both copies (TE's weight
    /// option).
    #[arg(long = "2d")]
    pub two_d: bool,
    /// Memory layout of the scale tensors.
    #[arg(long, value_enum, default_value_t = ScaleLayout::Compact)]
    pub scale_layout: ScaleLayout,
    /// What to do with NaN and ±Inf inputs.
    #[arg(long, value_enum, default_value_t = NanPolicy::Te)]
    pub nan_policy: NanPolicy,
    /// Worker threads (0 = all cores, at most 1024). The output does not depend on it.
    // Bounded because the library spawns up to this many OS threads per pass.
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub threads: u16,
    /// Overwrite OUT if it exists. Only a regular file is replaced (never a device, FIFO,
    /// socket, directory or symlink), and it keeps its permissions.
    #[arg(long)]
    pub force: bool,
    /// Quantize the float tensors whose names match GLOB (`*`, `?`, `[a-z]`, `[!a-z]`; over the
    /// whole name, dots included). Repeatable; replaces the default rule: a tensor matching no
    /// --include is kept. `--include '*'` is --all.
    #[arg(long, value_name = "GLOB", value_parser = parse_glob)]
    pub include: Vec<Glob>,
    /// Keep the float tensors whose names match GLOB in their dtype (wins over --include and
    /// --all). Repeatable.
    #[arg(long, value_name = "GLOB", value_parser = parse_glob)]
    pub exclude: Vec<Glob>,
    /// Quantize every BF16/F16/F32 tensor (but --exclude'd ones). Without it or --include, only
    /// GEMM weights are: tensors of 2 or more dimensions whose names (lower-cased) contain
    /// neither `norm`, `embed` nor `lm_head` and do not end in `.bias`; the others are copied
    /// bit for bit, as `ckpt export --dtype mxfp8` does.
    #[arg(long, conflicts_with = "include")]
    pub all: bool,
    /// How components are named: lowbit's (`W.rowwise_data`, …; what `lowbit dequantize`
    /// reads) or compressed-tensors' nvfp4-pack-quantized (`X.weight_packed`, `X.weight_scale`,
    /// `X.weight_global_scale`; needs --recipe nvfp4 --copies rowwise; see docs/format.md).
    #[arg(long, value_enum, default_value_t = Naming::Lowbit)]
    pub naming: Naming,
    /// Print the report as one JSON object (every tensor quantized, kept or copied, with the
    /// reason) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Instead of IN and OUT: write an example file under target/lowbit-demo/ (or
    /// $CARGO_TARGET_DIR/lowbit-demo/), quantize it, print the report and dequantize the result.
    /// Overwrites earlier demo files.
    #[arg(long, conflicts_with_all = ["input", "output"])]
    pub demo: bool,
}

/// Arguments of `lowbit dequantize`.
#[derive(Debug, Args)]
pub struct DequantizeArgs {
    /// A file written by `lowbit quantize`.
    #[arg(value_name = "IN")]
    pub input: PathBuf,
    /// Output safetensors file (written to a new temporary file with an unpredictable name in
    /// the same directory, then renamed into place; temporaries of killed runs are removed).
    #[arg(value_name = "OUT")]
    pub output: PathBuf,
    /// Element type of the dequantized tensors [default: each tensor's original dtype].
    #[arg(long, value_enum)]
    pub dtype: Option<OutDtype>,
    /// Overwrite OUT if it exists. Only a regular file is replaced (never a device, FIFO,
    /// socket, directory or symlink), and it keeps its permissions.
    #[arg(long)]
    pub force: bool,
}

impl QuantizeArgs {
    fn options(&self) -> Options {
        Options {
            settings: Settings {
                recipe: self.recipe,
                copies: self.copies,
                two_d: self.two_d,
                layout: self.scale_layout,
                nan_policy: self.nan_policy,
            },
            threads: usize::from(self.threads),
            only: None,
            select: Select {
                all: self.all,
                include: self.include.clone(),
                exclude: self.exclude.clone(),
            },
            naming: self.naming,
        }
    }
}

/// A `--include`/`--exclude` pattern (clap shows the error with the flag).
fn parse_glob(s: &str) -> Result<Glob, String> {
    Glob::new(s).map_err(|e| e.to_string())
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Quantize(args) => {
            let opts = args.options();
            if args.demo {
                return crate::demo::run(&opts);
            }
            let (Some(input), Some(output)) = (&args.input, &args.output) else {
                // clap enforces both unless --demo; kept as an error rather than a panic.
                return Err(CliError::Msg(
                    "quantize needs IN and OUT (or --demo)".into(),
                ));
            };
            let r = quantize::run_report(input, output, &opts, args.force)?;
            if args.json {
                report::print(&r.to_json().to_text())
            } else {
                report::print(&r.table.render())
            }
        }
        Command::Dequantize(args) => {
            let table = dequantize::run(&args.input, &args.output, args.dtype, args.force)?;
            report::print(&table.render())
        }
        Command::Train(args) => crate::train_cmd::run(&args),
        Command::Ckpt(args) => crate::ckpt_cmd::run(&args),
        Command::Data(args) => crate::data_cmd::run(&args),
        Command::Eval(args) => crate::eval_cmd::run_eval(&args),
        Command::Generate(args) => crate::eval_cmd::run_generate(&args),
        Command::Plot(args) => crate::plot_cmd::run(&args),
    }
}
