//! The flash attention on bf16 views against the same op on f32 views, on any backend (shared
//! by `flash.rs` on the CPU and `cuda_flash.rs`): the op rounds f32 operands to bf16 (RNE)
//! before use, so bf16 views holding those roundings must give exactly the same bits, and a
//! bf16 `out` must be the f32 `out` rounded once.

use lowbit_device::{AttentionSpec, DType, Device, View, bf16};

fn put(dev: &mut Device, d: DType, vals: &[f32]) -> View {
    let v = dev.alloc(d, vals.len());
    match d {
        DType::Bf16 => {
            let h: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
            dev.upload(v, &h)
        }
        _ => dev.upload(v, vals),
    }
    .unwrap();
    v
}

fn get_bits(dev: &Device, v: View) -> Vec<u32> {
    match v.dtype() {
        DType::Bf16 => dev
            .download::<bf16>(v)
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        _ => dev
            .download::<f32>(v)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
    }
}

/// Forward and backward with q, k, v, out and dout all of dtype `d`: the bits of
/// `[out, lse, dq, dk, dv]` (out in `d`).
fn run(dev: &mut Device, s: &AttentionSpec, x: &[Vec<f32>; 4], d: DType) -> [Vec<u32>; 5] {
    let [q, k, v, dout] = [0, 1, 2, 3].map(|i| put(dev, d, &x[i]));
    let (qn, kn) = (x[0].len(), x[1].len());
    let out = put(dev, d, &vec![7.0; qn]);
    let lse = put(dev, DType::F32, &vec![7.0; s.batch * s.heads * s.seq]);
    let dq = put(dev, DType::F32, &vec![7.0; qn]);
    let [dk, dv] = [0, 1].map(|_| put(dev, DType::F32, &vec![7.0; kn]));
    dev.flash_attention(q, k, v, out, lse, s).unwrap();
    dev.flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, s)
        .unwrap();
    let bits = [out, lse, dq, dk, dv].map(|w| get_bits(dev, w));
    for w in [q, k, v, dout, out, lse, dq, dk, dv] {
        dev.free(w).unwrap();
    }
    bits
}

/// Asserts that the bf16-view run of `x` (`[q, k, v, dout]` values) gives the f32-view run's
/// bits: `out` rounded to bf16 (RNE), `lse`, `dq`, `dk`, `dv` identical.
pub fn assert_bf16_views_match(dev: &mut Device, s: &AttentionSpec, x: &[Vec<f32>; 4]) {
    let f = run(dev, s, x, DType::F32);
    let b = run(dev, s, x, DType::Bf16);
    let rounded: Vec<u32> = f[0]
        .iter()
        .map(|&w| u32::from(bf16::from_f32(f32::from_bits(w)).to_bits()))
        .collect();
    assert_eq!(b[0], rounded, "{s:?}: bf16 out is not the f32 out rounded");
    for (w, name) in [(1, "lse"), (2, "dq"), (3, "dk"), (4, "dv")] {
        assert_eq!(
            b[w], f[w],
            "{s:?}: {name} differs between bf16 and f32 views"
        );
    }
}
