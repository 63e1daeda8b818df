//! Plain Rust kernels: 8 independent lanes per accumulator, which LLVM vectorizes for the
//! baseline target (SSE2 on x86-64, NEON on aarch64).

use super::{bf16, f16, E2M1_X2, E8M0_HALF};
use crate::mxfp4::{BLOCK, BLOCK_BYTES};

const L: usize = 8;

/// Lane-parallel dot product with a fixed reduction order: lanes, then a pairwise tree over
/// the 8 lane sums, then the tail in order.
#[inline(always)]
fn dot_with<T: Copy>(w: &[T], x: &[f32], f: impl Fn(T) -> f32) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; L];
    let wc = w.chunks_exact(L);
    let xc = x.chunks_exact(L);
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (wc, xc) in wc.zip(xc) {
        for i in 0..L {
            acc[i] += f(wc[i]) * xc[i];
        }
    }
    let mut s = reduce8(acc);
    for (&a, &b) in wt.iter().zip(xt) {
        s += f(a) * b;
    }
    s
}

#[inline(always)]
fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    dot_with(w, x, |v| v)
}

pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
    dot_with(w, x, |v| f32::from_bits((v.to_bits() as u32) << 16))
}

pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
    dot_with(w, x, f16::to_f32)
}

pub fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
    dot_with(q, x, |v| v as f32)
}

/// Per block: 8 lane sums of doubled E2M1 values times x, then `lanes += block * scale/2`.
pub fn dot_mxfp4(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    let nb = n.div_ceil(BLOCK);
    assert!(packed.len() >= nb * BLOCK_BYTES && scales.len() >= nb);
    let mut acc = [0.0f32; L];
    let mut xpad = [0.0f32; BLOCK];
    for b in 0..nb {
        let xb = if (b + 1) * BLOCK <= n {
            &x[b * BLOCK..(b + 1) * BLOCK]
        } else {
            // Partial last block: its padding nibbles meet zeros.
            xpad[..n - b * BLOCK].copy_from_slice(&x[b * BLOCK..]);
            &xpad[..]
        };
        let bytes = &packed[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        let mut w = [0.0f32; BLOCK];
        for (i, &byte) in bytes.iter().enumerate() {
            w[2 * i] = E2M1_X2[(byte & 0x0F) as usize] as f32;
            w[2 * i + 1] = E2M1_X2[(byte >> 4) as usize] as f32;
        }
        let mut blk = [0.0f32; L];
        for g in 0..BLOCK / L {
            for i in 0..L {
                blk[i] += w[g * L + i] * xb[g * L + i];
            }
        }
        let scale = E8M0_HALF[scales[b] as usize];
        for i in 0..L {
            acc[i] += blk[i] * scale;
        }
    }
    reduce8(acc)
}

pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}
