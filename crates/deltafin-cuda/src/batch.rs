//! Batched (prefill) operations: RoPE with a position per token, MLA for the tokens of a chunk,
//! row gather/scatter for expert-major MoE, and the per-token MoE combine. Each gives, for every
//! token, the bits of the one-token operation (`ops.cu`, "Batched (prefill) forms").

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use crate::attention::{KvB, MlaShape, MLA_SPLIT};
use crate::gpu::GpuBuf;
use crate::mat::GpuMat;
use crate::{CudaError, DriverContext, Gpu};

/// The kernel form of [`Gpu::mla_prefill`]; both give every token its decode bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaPrefillForm {
    /// One block a (split, token), every head in it (`mla_prefill_*` in ops.cu).
    PerToken,
    /// One block a (split, group of tokens), about 32 query-heads in registers sharing each
    /// latent row (`mla_prefill_tiled`, then `mla_prefill_combine_*`); needs `kv_lora_rank` <=
    /// 512, rope <= 64 and at most 128 heads.
    Tiled,
}

impl MlaPrefillForm {
    /// Tiled where the shape allows it (faster on the H200: bench/NOTES.md), else per token.
    pub fn best(s: MlaShape) -> Self {
        if Self::tiled_fits(s) {
            Self::Tiled
        } else {
            Self::PerToken
        }
    }

    fn tiled_fits(s: MlaShape) -> bool {
        s.kv_lora_rank <= 512 && s.rope <= 64 && s.n_heads <= 128
    }
}

fn i32_of(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} is too large for the CUDA kernels")))
}

fn elems(n: usize) -> Result<LaunchConfig, CudaError> {
    let n = u32::try_from(n).map_err(|_| CudaError::Shape(format!("{n} elements is more than one launch takes")))?;
    Ok(LaunchConfig::for_num_elems(n.max(1)))
}

/// Which way [`Gpu::copy_rows`] moves rows (`gather_rows` / `scatter_rows` in ops.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowCopy {
    /// `dst[i] = src[idx[off + i]]` (`dst: [m, dim]`).
    Gather,
    /// `dst[idx[off + i]] = src[i]` (`src: [m, dim]`), destination rows distinct and inside
    /// `dst`.
    Scatter,
}

/// Query rows of one block of `mla_mha_prefill_*` (`MHA_QT` in ops.cu).
const MHA_QT: usize = 32;

/// Dynamic shared memory of `mla_mha_prefill_*` for shape `s` (its `Qs`, `Ks`, `Vs`, `Ps`
/// tiles, ops.cu).
fn mha_smem_bytes(s: MlaShape) -> usize {
    let (dk, vdp) = (s.nope + s.rope, s.v_head_dim.next_multiple_of(4));
    let floats = (MHA_QT * (dk + 1)).next_multiple_of(4) + dk * 36 + 32 * vdp + MHA_QT * 36;
    floats * 4
}

impl Gpu {
    /// RoPE in place on the vectors of `n_tok` tokens, `vec_per_tok` vectors a token (stride
    /// `stride`, rotary part at `offset`); token `j` rotates with its own row of
    /// `cs: [n_tok, 2 * half]` (`[cos, sin]` as for [`Gpu::rope`]).
    ///
    /// # Errors
    /// `Shape` when the vectors or the table do not fit; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_tokens(
        &self,
        x: &mut GpuBuf,
        n_tok: usize,
        vec_per_tok: usize,
        stride: usize,
        offset: usize,
        cs: &GpuBuf,
        half: usize,
        interleaved: bool,
    ) -> Result<(), CudaError> {
        let n_vec = n_tok * vec_per_tok;
        if half == 0
            || n_vec == 0
            || offset + 2 * half > stride
            || n_vec * stride > x.len()
            || cs.len() != n_tok * 2 * half
        {
            return Err(CudaError::Shape(format!(
                "rope_tokens: {n_tok} tokens of {vec_per_tok} vectors (stride {stride}, rotary {} at {offset}) in {} elements, table {}",
                2 * half,
                x.len(),
                cs.len()
            )));
        }
        let (a, b, c, d, e, f) = (
            i32_of("tokens", n_tok)?,
            i32_of("vectors", vec_per_tok)?,
            i32_of("stride", stride)?,
            i32_of("offset", offset)?,
            i32_of("half", half)?,
            interleaved as i32,
        );
        let mut l = self.stream().launch_builder(self.k.get("rope_apply_tokens")?);
        l.arg(x).arg(&a).arg(&b).arg(&c).arg(&d).arg(cs).arg(&e).arg(&f);
        // SAFETY: matches `rope_apply_tokens` in ops.cu; extents checked above.
        unsafe { l.launch(elems(n_vec * half)?) }.ctx("launch rope_apply_tokens")?;
        Ok(())
    }

    /// Whether [`Gpu::mla_prefill_decompressed`] takes shape `s`: `v_head_dim` <= 128 and the
    /// kernel's shared memory ([`mha_smem_bytes`]) within the device's per-block limit.
    pub fn mla_decompressed_fits(&self, s: MlaShape) -> bool {
        s.v_head_dim > 0
            && s.v_head_dim <= 128
            && s.nope + s.rope > 0
            && mha_smem_bytes(s) <= self.info().shared_bytes_optin
    }

    /// MLA for the `n` tokens of a chunk at positions `t0 ..` in the decompressed (multi-head)
    /// form (DeepSeek-V2 §2.1, eq. 12–19; the CPU's `mla_decompressed`): `q: [n, n_heads, nope +
    /// rope]` (rope applied), `kv: [t0 + n, n_heads * (nope + v_head_dim)]` = `kv_b_proj` applied
    /// to every cached latent (per head `k_nope` then `v`), `kpe: [t0 + n, rope]` (rotated),
    /// `out: [n, n_heads * v_head_dim]`. Token `j` attends to positions `0..=t0 + j`; its bits
    /// depend on its position and the inputs only (not on `t0`, `n` or the chunking), and equal
    /// [`Gpu::mla_prefill`] within f32 rounding, not bit for bit (`mla_mha_prefill_*` in ops.cu
    /// states the order).
    ///
    /// # Errors
    /// `Shape` for inconsistent lengths or a shape [`Gpu::mla_decompressed_fits`] refuses; a
    /// driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_prefill_decompressed(
        &self,
        s: MlaShape,
        q: &GpuBuf,
        kv: &GpuBuf,
        kpe: &GpuBuf,
        t0: usize,
        n: usize,
        softmax_scale: f32,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (nh, dk, vd) = (s.n_heads, s.nope + s.rope, s.v_head_dim);
        let t = t0 + n;
        let ok = n > 0
            && self.mla_decompressed_fits(s)
            && q.len() == n * nh * dk
            && kv.len() >= t * nh * (s.nope + vd)
            && kpe.len() >= t * s.rope
            && out.len() == n * nh * vd
            && nh <= 65_535;
        if !ok {
            return Err(CudaError::Shape(format!(
                "mla_prefill_decompressed: operands do not fit {s:?} for {n} tokens from position {t0}"
            )));
        }
        let name = if vd <= 64 {
            "mla_mha_prefill_v64"
        } else {
            "mla_mha_prefill_v128"
        };
        let f = self.k.get(name)?;
        let smem = mha_smem_bytes(s);
        let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        f.set_attribute(attr, smem as i32).ctx("cuFuncSetAttribute")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(MHA_QT) as u32, nh as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (nh_i, nope, rope, vd_i) = (nh as i32, s.nope as i32, s.rope as i32, vd as i32);
        i32_of("position", t)?;
        let (t0_i, n_i) = (t0 as i32, n as i32);
        let mut b = self.stream().launch_builder(f);
        b.arg(q).arg(kv).arg(kpe).arg(&nh_i).arg(&nope).arg(&rope).arg(&vd_i);
        b.arg(&t0_i).arg(&n_i).arg(&softmax_scale).arg(out);
        // SAFETY: matches `mla_mha_prefill_*` in ops.cu; extents and shared memory checked above.
        unsafe { b.launch(cfg) }.ctx("launch mla_mha_prefill")?;
        Ok(())
    }

    /// MLA for the `n` tokens of a chunk whose first token sits at position `t0` (their latents
    /// and rope keys already in `ckv`/`kpe`), in kernel form `form` ([`MlaPrefillForm::best`]
    /// where the caller has no reason to choose; every form gives the same bits): token `j`
    /// attends to positions `0..=t0 + j`, exactly as [`Gpu::mla_decode`] of that token (bit for
    /// bit). `q: [n, n_heads, nope + rope]`, `scores`: scratch of at least `n *`
    /// [`MlaShape::scratch_len`]`(t0 + n)` floats, `out: [n, n_heads * v_head_dim]`.
    ///
    /// # Errors
    /// `Shape` for inconsistent lengths or an MXFP4 `kv_b`, and for [`MlaPrefillForm::Tiled`]
    /// on a shape it does not take (`kv_lora_rank` > 512, `qk_rope_head_dim` > 64 or more than
    /// 128 heads); a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_prefill(
        &self,
        form: MlaPrefillForm,
        s: MlaShape,
        q: &GpuBuf,
        ckv: &GpuBuf,
        kpe: &GpuBuf,
        kv_b: &GpuMat,
        t0: usize,
        n: usize,
        softmax_scale: f32,
        scores: &mut GpuBuf,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (kvl, t) = (s.kv_lora_rank, t0 + n);
        if form == MlaPrefillForm::Tiled && !MlaPrefillForm::tiled_fits(s) {
            return Err(CudaError::Shape(format!(
                "mla_prefill: the tiled form takes kv_lora_rank <= 512, rope <= 64 and at most 128 heads, not {s:?}"
            )));
        }
        let ok = n > 0
            && n <= 65_535
            && q.len() == n * s.n_heads * (s.nope + s.rope)
            && ckv.len() >= t * kvl
            && kpe.len() >= t * s.rope
            && kv_b.rows == s.n_heads * (s.nope + s.v_head_dim)
            && kv_b.cols == kvl
            && scores.len() >= n * s.scratch_len(t)
            && out.len() == n * s.n_heads * s.v_head_dim;
        if !ok {
            return Err(CudaError::Shape(format!(
                "mla_prefill: operands do not fit {s:?} for {n} tokens from position {t0}"
            )));
        }
        let s_cap = t.div_ceil(MLA_SPLIT).max(1);
        if s_cap > 65_535 {
            return Err(CudaError::Shape(format!(
                "mla_prefill: {t} positions is past the kernel's grid"
            )));
        }
        let mut qabs = self.zeros(n * s.n_heads * kvl)?;
        let (nope, rope, vd, kvl_i) = (s.nope as i32, s.rope as i32, s.v_head_dim as i32, kvl as i32);
        let (t0_i, s_cap_i, nh) = (i32_of("position", t0)?, s_cap as i32, s.n_heads as i32);
        let kvb = KvB::of(self, kv_b, "mla_prefill")?;
        // q_abs of every (token, head): one block each.
        let mut b =
            self.stream()
                .launch_builder(self.k.get(if kvb.int8() { "mla_qabs_i8" } else { "mla_qabs_f32" })?);
        b.arg(q);
        kvb.push(&mut b);
        b.arg(&nope).arg(&rope).arg(&vd).arg(&kvl_i).arg(&mut qabs);
        let qcfg = LaunchConfig {
            grid_dim: (s.n_heads as u32, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `mla_qabs_*` in ops.cu: q is [n, nh, qk], kv_b [nh * (nope + vd), kvl]
        // (checked above) with its row scales when int8, qabs [n, nh, kvl].
        unsafe { b.launch(qcfg) }.ctx("launch mla_qabs")?;
        match form {
            MlaPrefillForm::PerToken => {
                // One block a (split, token), every head in it (a latent row is read once for all
                // heads); the token's last block combines.
                let mut counters = self.stream().alloc_zeros::<i32>(n).ctx("cuMemAlloc")?;
                let cfg = LaunchConfig {
                    grid_dim: (s_cap as u32, n as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: ((2 * kvl + s.rope + MLA_SPLIT) * 4) as u32,
                };
                let name = if kvb.int8() {
                    "mla_prefill_i8"
                } else {
                    "mla_prefill_f32"
                };
                let mut b = self.stream().launch_builder(self.k.get(name)?);
                b.arg(q).arg(ckv).arg(kpe);
                kvb.push(&mut b);
                b.arg(&nh)
                    .arg(&nope)
                    .arg(&rope)
                    .arg(&vd)
                    .arg(&kvl_i)
                    .arg(&t0_i)
                    .arg(&s_cap_i);
                b.arg(&softmax_scale).arg(&qabs).arg(&mut counters).arg(scores).arg(out);
                // SAFETY: matches `mla_prefill_*` in ops.cu; lengths checked above; the dynamic
                // shared memory is 2 kvl + rope + MLA_SPLIT floats as the kernel indexes it.
                unsafe { b.launch(cfg) }.ctx("launch mla_prefill")?;
            }
            MlaPrefillForm::Tiled => {
                // One block a (split, group of qt tokens): qt * n_heads query-heads (about 32)
                // sharing each latent row; then one block a (head, token) combines.
                let qt = (32 / s.n_heads).max(1);
                let nqp = (qt * s.n_heads).next_multiple_of(4);
                let smem = (MLA_SPLIT * nqp + 32) * 4;
                if smem > 48 * 1024 {
                    return Err(CudaError::Shape(format!(
                        "mla_prefill: {s:?} needs {smem} bytes of shared memory a block (at most 48 KiB)"
                    )));
                }
                let (n_i, qt_i) = (n as i32, qt as i32);
                // The small instance where the shape allows it (same bits, half the registers).
                let name = if kvl <= 256 && s.rope <= 32 {
                    "mla_prefill_tiled_256"
                } else {
                    "mla_prefill_tiled"
                };
                let mut b = self.stream().launch_builder(self.k.get(name)?);
                b.arg(q)
                    .arg(ckv)
                    .arg(kpe)
                    .arg(&nh)
                    .arg(&nope)
                    .arg(&rope)
                    .arg(&kvl_i)
                    .arg(&t0_i);
                b.arg(&n_i)
                    .arg(&qt_i)
                    .arg(&s_cap_i)
                    .arg(&softmax_scale)
                    .arg(&qabs)
                    .arg(&mut *scores);
                let cfg = LaunchConfig {
                    grid_dim: (s_cap as u32, n.div_ceil(qt) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                // SAFETY: matches `mla_prefill_tiled` in ops.cu; q, ckv, kpe, qabs and the
                // partials in `scores` ([n, nh, s_cap, kvl + 2]) checked above; shared memory
                // MLA_SPLIT * nqp + 32 floats as the kernel indexes it.
                unsafe { b.launch(cfg) }.ctx("launch mla_prefill_tiled")?;
                let name = if kvb.int8() {
                    "mla_prefill_combine_i8"
                } else {
                    "mla_prefill_combine_f32"
                };
                let mut b = self.stream().launch_builder(self.k.get(name)?);
                b.arg(&*scores);
                kvb.push(&mut b);
                b.arg(&nope).arg(&vd).arg(&kvl_i).arg(&t0_i).arg(&s_cap_i).arg(out);
                let cfg = LaunchConfig {
                    grid_dim: (s.n_heads as u32, n as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: (kvl * 4) as u32,
                };
                // SAFETY: matches `mla_prefill_combine_*`: the partials written just before on
                // this stream, kv_b as checked, out [n, nh, vd]; kvl floats of shared memory.
                unsafe { b.launch(cfg) }.ctx("launch mla_prefill_combine")?;
            }
        }
        Ok(())
    }

    /// Copies `m` rows of width `dim` between `src` and `dst` through the indices
    /// `idx[off .. off + m]`, the way `way` says. The caller guarantees every index is a row of
    /// the large side (the engine builds them from routing it owns).
    ///
    /// # Errors
    /// `Shape` when the extents disagree; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_rows(
        &self,
        way: RowCopy,
        src: &GpuBuf,
        idx: &CudaSlice<i32>,
        off: usize,
        m: usize,
        dim: usize,
        dst: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let (name, small, big) = match way {
            RowCopy::Gather => ("gather_rows", dst.len(), src.len()),
            RowCopy::Scatter => ("scatter_rows", src.len(), dst.len()),
        };
        if m == 0 || dim == 0 || off + m > idx.len() || small != m * dim || big % dim != 0 {
            return Err(CudaError::Shape(format!(
                "{name}: {m} rows of {dim} at index {off} of {} (buffers {} and {})",
                idx.len(),
                src.len(),
                dst.len()
            )));
        }
        let (off_i, m_i, dim_i) = (i32_of("offset", off)?, i32_of("rows", m)?, i32_of("width", dim)?);
        let mut b = self.stream().launch_builder(self.k.get(name)?);
        b.arg(src).arg(idx).arg(&off_i).arg(&m_i).arg(&dim_i).arg(dst);
        // SAFETY: matches `gather_rows`/`scatter_rows` in ops.cu; the small side holds m rows;
        // the indices are checked by the caller to lie within the large side (see above).
        unsafe { b.launch(elems(m * dim)?) }.ctx("launch gather/scatter")?;
        Ok(())
    }

    /// [`Gpu::moe_fused`]'s combine for `n` tokens: `x[t] += Σ_j w[t, j] · y[t, j] + shared[t]`
    /// with `y: [n, k, hidden]`, `w: [n, k]`, `shared: [n, hidden]`, `x: [n, hidden]`, each
    /// token with the one-token arithmetic.
    ///
    /// # Errors
    /// `Shape` when lengths disagree; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_tokens(
        &self,
        y: &GpuBuf,
        w: &GpuBuf,
        k: usize,
        hidden: usize,
        n: usize,
        shared: Option<&GpuBuf>,
        x: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        if n == 0
            || y.len() != n * k * hidden
            || w.len() != n * k
            || x.len() != n * hidden
            || shared.is_some_and(|s| s.len() != n * hidden)
        {
            return Err(CudaError::Shape(format!(
                "moe_combine_tokens: buffers do not fit {n} tokens of {k} experts and width {hidden}"
            )));
        }
        let (k_i, h_i, n_i) = (i32_of("k", k)?, i32_of("hidden", hidden)?, i32_of("tokens", n)?);
        let s = self.stream();
        let null: u64 = 0;
        let shared_ptr = shared.map(|sh| sh.device_ptr(s));
        let mut b = s.launch_builder(self.k.get("moe_combine_tokens")?);
        b.arg(y).arg(w).arg(&k_i).arg(&h_i).arg(&n_i);
        match &shared_ptr {
            Some((p, _)) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(x);
        // SAFETY: matches `moe_combine_tokens` in ops.cu; lengths checked above.
        unsafe { b.launch(elems(n * hidden)?) }.ctx("launch moe_combine_tokens")?;
        Ok(())
    }

    /// A new buffer holding `src[start .. start + len]`.
    ///
    /// # Errors
    /// `Shape` when the range is outside `src`; a driver error.
    pub fn copy_range(&self, src: &GpuBuf, start: usize, len: usize) -> Result<GpuBuf, CudaError> {
        if len == 0 || start + len > src.len() {
            return Err(CudaError::Shape(format!(
                "copy_range: {len} elements at {start} of {}",
                src.len()
            )));
        }
        let mut dst = self.zeros(len)?;
        let view = src.slice(start..start + len);
        self.stream().memcpy_dtod(&view, &mut dst).ctx("cuMemcpyDtoD")?;
        Ok(dst)
    }
}
