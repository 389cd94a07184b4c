//! Views, byte-level aliasing, bounds, liveness and the overlap rule.

use lowbit_device::{DType, Device, DeviceError, bf16};

#[test]
fn bf16_view_over_first_half_of_f32_buffer_shares_memory() {
    let mut dev = Device::cpu();
    let n = 8;
    let grads = dev.alloc(DType::F32, n);
    dev.upload(grads, &[1.5f32; 8]).unwrap();
    let staging = grads.reinterpret(DType::Bf16).unwrap().slice(0..n).unwrap();
    assert_eq!(staging.byte_range(), 0..2 * n);
    let vals: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32 - 3.25)).collect();
    dev.upload(staging, &vals).unwrap();

    // The f32 buffer's bytes: the first 2n bytes are the bf16 values, the rest untouched.
    let bytes = dev.read_bytes(grads).unwrap();
    let expected_head: Vec<u8> = vals
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect();
    assert_eq!(&bytes[..2 * n], &expected_head[..]);
    let tail = dev.download::<f32>(grads.slice(n / 2..n).unwrap()).unwrap();
    assert_eq!(tail, vec![1.5f32; n / 2]);

    // And writes through the f32 view are visible through the bf16 view.
    dev.upload(grads.slice(0..1).unwrap(), &[f32::from_bits(0x4049_0FDB)])
        .unwrap();
    let back = dev.download::<bf16>(staging.slice(0..2).unwrap()).unwrap();
    assert_eq!(back[0].to_bits(), 0x0FDB);
    assert_eq!(back[1].to_bits(), 0x4049);
}

#[test]
fn cast_into_aliasing_staging_view_of_another_buffer() {
    // fp32 masters → bf16 staging over the first half of an fp32 grad buffer.
    let mut dev = Device::cpu();
    let masters = dev.alloc(DType::F32, 4);
    let grads = dev.alloc(DType::F32, 4);
    let m = [1.0f32 + f32::EPSILON, -2.7, 3.0e-3, 65504.0];
    dev.upload(masters, &m).unwrap();
    let staging = grads.reinterpret(DType::Bf16).unwrap().slice(0..4).unwrap();
    dev.cast(masters, staging).unwrap();
    let got = dev.download::<bf16>(staging).unwrap();
    let want: Vec<bf16> = m.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(got, want);
    // The upper half of the grad buffer still reads zero.
    assert_eq!(
        dev.download::<f32>(grads.slice(2..4).unwrap()).unwrap(),
        [0.0; 2]
    );
}

#[test]
fn slice_and_split_bounds() {
    let mut dev = Device::cpu();
    let v = dev.alloc(DType::F32, 10);
    let s = v.slice(2..7).unwrap();
    assert_eq!((s.len(), s.byte_offset(), s.byte_len()), (5, 8, 20));
    assert_eq!(s.slice(1..3).unwrap().byte_range(), 12..20);
    assert!(s.slice(5..5).unwrap().is_empty());
    assert!(matches!(
        s.slice(3..6),
        Err(DeviceError::OutOfBounds {
            start: 3,
            end: 6,
            len: 5,
            ..
        })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = s.slice(4..2);
    assert!(matches!(reversed, Err(DeviceError::OutOfBounds { .. })));
    let (a, b) = v.split_at(4).unwrap();
    assert_eq!((a.len(), b.len(), b.byte_offset()), (4, 6, 16));
    assert!(v.split_at(11).is_err());
}

#[test]
fn reinterpret_requires_whole_aligned_elements() {
    let mut dev = Device::cpu();
    let bytes = dev.alloc(DType::U8, 6);
    assert_eq!(bytes.reinterpret(DType::Bf16).unwrap().len(), 3);
    assert!(matches!(
        bytes.reinterpret(DType::F32),
        Err(DeviceError::Reinterpret {
            bytes: 6,
            offset: 0,
            dtype: DType::F32
        })
    ));
    let odd = bytes.slice(1..5).unwrap();
    assert!(matches!(
        odd.reinterpret(DType::Bf16),
        Err(DeviceError::Reinterpret { offset: 1, .. })
    ));
    let f = dev.alloc(DType::F32, 3);
    let h = f.reinterpret(DType::F16).unwrap();
    assert_eq!((h.len(), h.dtype()), (6, DType::F16));
    assert_eq!(h.reinterpret(DType::F32).unwrap(), f);
}

#[test]
fn a_stale_view_longer_than_the_reused_slot_is_rejected_as_freed() {
    let mut dev = Device::cpu();
    let small = dev.alloc(DType::F32, 4);
    let big = dev.alloc(DType::F32, 16);
    dev.free(big).unwrap();
    // Same slot, fewer bytes: the stale 16-element view must not reach them (or past them).
    let reused = dev.alloc(DType::F32, 2);
    assert_ne!(reused.buffer(), big.buffer());
    assert!(matches!(dev.fill(big, 1.0), Err(DeviceError::Freed(_))));
    assert!(matches!(
        dev.download::<f32>(big),
        Err(DeviceError::Freed(_))
    ));
    assert!(matches!(
        dev.axpy(1.0, small, big.slice(0..4).unwrap()),
        Err(DeviceError::Freed(_))
    ));
    assert_eq!(dev.download::<f32>(reused).unwrap(), [0.0; 2]);
}

#[test]
fn freed_buffers_and_stale_ids_are_rejected() {
    let mut dev = Device::cpu();
    let a = dev.alloc(DType::F32, 4);
    let a_half = a.slice(0..2).unwrap();
    dev.free(a).unwrap();
    assert!(matches!(dev.free(a), Err(DeviceError::Freed(_))));
    assert!(matches!(dev.read_bytes(a_half), Err(DeviceError::Freed(_))));
    // The slot is reused by the next allocation; the old views stay invalid.
    let b = dev.alloc(DType::F32, 4);
    assert_eq!(b.byte_range(), a.byte_range());
    assert_ne!(a.buffer(), b.buffer());
    assert!(matches!(dev.download::<f32>(a), Err(DeviceError::Freed(_))));
    assert!(matches!(dev.zero(a_half), Err(DeviceError::Freed(_))));
    assert!(matches!(dev.scale(a, 2.0), Err(DeviceError::Freed(_))));
    assert!(matches!(dev.copy(b, a), Err(DeviceError::Freed(_))));
    dev.upload(b, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(dev.download::<f32>(b).unwrap(), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn views_of_another_device_are_rejected() {
    let mut d1 = Device::cpu();
    let mut d2 = Device::cpu();
    let v1 = d1.alloc(DType::F32, 4);
    let _v2 = d2.alloc(DType::F32, 4);
    assert!(matches!(d2.download::<f32>(v1), Err(DeviceError::Freed(_))));
    assert!(matches!(d2.fill(v1, 1.0), Err(DeviceError::Freed(_))));
    assert!(matches!(d2.free(v1), Err(DeviceError::Freed(_))));
}

#[test]
fn allocated_bytes_tracks_live_buffers() {
    let mut dev = Device::cpu();
    assert_eq!(dev.allocated_bytes(), 0);
    let a = dev.alloc(DType::F32, 10);
    let b = dev.alloc(DType::Bf16, 3);
    let c = dev.alloc(DType::U8, 5);
    assert_eq!(dev.allocated_bytes(), 40 + 6 + 5);
    dev.free(b).unwrap();
    assert_eq!(dev.allocated_bytes(), 45);
    dev.free(a).unwrap();
    dev.free(c).unwrap();
    assert_eq!(dev.allocated_bytes(), 0);
}

#[test]
fn new_buffers_are_zero_and_upload_download_check_dtype_and_length() {
    let mut dev = Device::cpu();
    let v = dev.alloc(DType::Bf16, 3);
    assert_eq!(dev.read_bytes(v).unwrap(), vec![0u8; 6]);
    assert!(matches!(
        dev.upload(v, &[1.0f32; 3]),
        Err(DeviceError::DType {
            got: DType::Bf16,
            ..
        })
    ));
    assert!(matches!(
        dev.upload(v, &[bf16::ONE; 2]),
        Err(DeviceError::Length { a: 3, b: 2, .. })
    ));
    assert!(matches!(
        dev.download::<f32>(v),
        Err(DeviceError::DType { .. })
    ));
}

#[test]
fn overlap_rule_inputs_may_share_outputs_may_not() {
    let mut dev = Device::cpu();
    let buf = dev.alloc(DType::F32, 12);
    let (x, rest) = buf.split_at(4).unwrap();
    let (y, z) = rest.split_at(4).unwrap();
    dev.upload(x, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    dev.upload(y, &[10.0f32; 4]).unwrap();
    // Disjoint views of one buffer: fine.
    dev.axpy(2.0, x, y).unwrap();
    assert_eq!(dev.download::<f32>(y).unwrap(), [12.0, 14.0, 16.0, 18.0]);
    // x == y, partial overlap, and an overlapping view of another dtype: rejected, untouched.
    let before = dev.read_bytes(buf).unwrap();
    assert_eq!(dev.axpy(1.0, y, y), Err(DeviceError::Overlap("axpy")));
    assert_eq!(
        dev.axpy(1.0, buf.slice(2..6).unwrap(), y),
        Err(DeviceError::Overlap("axpy"))
    );
    let y_as_bf16 = y.reinterpret(DType::Bf16).unwrap().slice(0..4).unwrap();
    assert_eq!(dev.cast(y, y_as_bf16), Err(DeviceError::Overlap("cast")));
    assert_eq!(dev.read_bytes(buf).unwrap(), before);
    // Inputs may overlap each other: matmul of x with itself into z.
    let spec = lowbit_device::MatmulSpec {
        m: 2,
        n: 2,
        k: 2,
        trans_a: false,
        trans_b: true,
        accumulate: false,
    };
    dev.matmul(x, x, z, &spec).unwrap();
    // [[1,2],[3,4]] · [[1,2],[3,4]]ᵀ
    assert_eq!(dev.download::<f32>(z).unwrap(), [5.0, 11.0, 11.0, 25.0]);
}

#[test]
fn empty_views_never_overlap_and_ops_on_them_succeed() {
    let mut dev = Device::cpu();
    let buf = dev.alloc(DType::F32, 4);
    let e = buf.slice(2..2).unwrap();
    dev.axpy(1.0, buf.slice(0..0).unwrap(), e).unwrap();
    dev.fill(e, 3.0).unwrap();
    assert_eq!(dev.sum_squares(e).unwrap(), 0.0);
    assert_eq!(dev.max_abs(e).unwrap(), 0.0);
    assert_eq!(dev.read_bytes(buf).unwrap(), vec![0u8; 16]);
}
