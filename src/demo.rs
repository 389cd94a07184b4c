//! `lowbit quantize --demo`: writes a small example checkpoint (deterministic, no external data),
//! quantizes it, prints the report and dequantizes the result, all under
//! `$CARGO_TARGET_DIR/lowbit-demo/` (default `target/lowbit-demo/` relative to the current
//! directory), so the README's run command works on a fresh machine.

use std::collections::HashMap;
use std::path::PathBuf;

use lowbit_formats::{bf16, f16};
use safetensors::Dtype;

use lowbit_io::SplitMix64;
use lowbit_io::dequantize;
use lowbit_io::files::{self, OutTensor};
use lowbit_io::quantize::{self, Options};

use crate::error::CliError;
use crate::report;

/// A standard normal from `rng` (Box–Muller over two uniforms in (0, 1], so `ln` stays finite).
fn normal(rng: &mut SplitMix64) -> f64 {
    let (u, v) = (rng.unit_open_f64(), rng.unit_open_f64());
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

/// The directory the demo writes into.
fn demo_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("target"), PathBuf::from);
    target.join("lowbit-demo")
}

/// The example checkpoint: a bf16 weight, an odd-shaped f32 tensor, an f16 bias, an f32 tensor
/// of special values and an I64 step counter (copied through).
pub fn example_file() -> Result<Vec<u8>, lowbit_io::Error> {
    let mut rng = SplitMix64(0x6C6F_7762_6974);
    let weight: Vec<u8> = (0..256 * 512)
        .flat_map(|_| {
            bf16::from_f64(0.02 * normal(&mut rng))
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    // Per-row magnitudes spanning four decades, so blocks get different scales.
    let odd: Vec<u8> = (0..3 * 37 * 45)
        .flat_map(|i| {
            let row = i / 45;
            let mag = 10f64.powf((row % 37) as f64 / 9.0 - 2.0);
            ((mag * normal(&mut rng)) as f32).to_le_bytes()
        })
        .collect();
    let bias: Vec<u8> = (0..100)
        .flat_map(|_| {
            f16::from_f64(0.1 * normal(&mut rng) + 0.05)
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    let mut special = vec![
        0.0f32,
        -0.0,
        1e-40,
        -1.4e-45,
        f32::MIN_POSITIVE,
        3.0e38,
        -1.0e30,
        f32::NAN,
        f32::INFINITY,
        1.0,
        -2.5,
        0.125,
    ];
    special.extend((0..52).map(|_| normal(&mut rng) as f32));
    let special: Vec<u8> = special.iter().flat_map(|v| v.to_le_bytes()).collect();
    let step = 1000i64.to_le_bytes().to_vec();

    let tensors = vec![
        (
            "model.layers.0.mlp.weight".to_owned(),
            OutTensor::owned(Dtype::BF16, vec![256, 512], weight),
        ),
        (
            "model.layers.0.attn.odd".to_owned(),
            OutTensor::owned(Dtype::F32, vec![3, 37, 45], odd),
        ),
        (
            "model.layers.0.mlp.bias".to_owned(),
            OutTensor::owned(Dtype::F16, vec![100], bias),
        ),
        (
            "special_values".to_owned(),
            OutTensor::owned(Dtype::F32, vec![2, 32], special),
        ),
        (
            "step".to_owned(),
            OutTensor::owned(Dtype::I64, vec![], step),
        ),
    ];
    let metadata = HashMap::from([("demo".to_owned(), "lowbit quantize --demo".to_owned())]);
    files::serialize(&demo_dir().join("example.safetensors"), tensors, metadata)
}

/// Runs the demo with the given quantization options (overwriting earlier demo files).
pub fn run(opts: &Options) -> Result<(), CliError> {
    let dir = demo_dir();
    std::fs::create_dir_all(&dir).map_err(|e| CliError::io("create directory", &dir, e))?;
    let example = dir.join("example.safetensors");
    files::write_atomic(&example, &example_file()?)?;
    let recipe = opts.settings.recipe.as_str();
    let quantized = dir.join(format!("example.{recipe}.safetensors"));
    let dequantized = dir.join(format!("example.{recipe}.dequantized.safetensors"));
    report::print(&format!("wrote example input {}\n\n", example.display()))?;
    let table = quantize::run(&example, &quantized, opts, true)?;
    report::print(&table.render())?;
    let table = dequantize::run(&quantized, &dequantized, None, true)?;
    report::print(&format!("\n{}", table.render()))?;
    report::print(&format!(
        "\ndemo done: input {}, quantized {}, dequantized {}\n",
        example.display(),
        quantized.display(),
        dequantized.display()
    ))
}
