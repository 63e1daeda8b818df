//! Attention operations: RoPE and MLA decode (weight-absorbed), and the KV-cache append.

use crate::gpu::GpuBuf;
use crate::mat::{GpuMat, GpuMatData};
use crate::{CudaError, DriverContext, Gpu};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};

/// Shapes of one MLA layer (DeepSeek-V3 config names).
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    /// Attention heads.
    pub n_heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
}

/// Positions one block of the MLA kernels takes (`MLA_SPLIT` in ops.cu).
pub const MLA_SPLIT: usize = 64;

impl MlaShape {
    /// Floats of the per-head completion counters at the start of an MLA scratch buffer.
    fn counter_floats(&self) -> usize {
        self.n_heads.div_ceil(4) * 4
    }

    /// Splits of [`MLA_SPLIT`] positions that `positions` need.
    fn splits(positions: usize) -> usize {
        positions.div_ceil(MLA_SPLIT).max(1)
    }

    /// Floats of scratch one token's MLA needs for up to `max_positions` positions: per-head
    /// completion counters, then for each head and split the running max, the sum of
    /// exponentials and the unnormalized latent context (`kv_lora_rank` floats). Allocate it
    /// zeroed ([`Gpu::zeros`]): the kernels leave the counters at zero.
    pub fn scratch_len(&self, max_positions: usize) -> usize {
        self.counter_floats() + self.n_heads * Self::splits(max_positions) * (self.kv_lora_rank + 2)
    }

    /// The splits a scratch buffer of `len` floats holds per head (the launch's grid height).
    fn splits_in(&self, len: usize) -> usize {
        len.saturating_sub(self.counter_floats()) / (self.n_heads * (self.kv_lora_rank + 2)).max(1)
    }
}

/// `kv_b_proj` as the MLA kernels take it: the weights' address and, when int8, the row scales
/// (the `*_i8` kernels, which take them right after the weights; f32: the `*_f32` kernels).
pub(crate) struct KvB<'a> {
    w: u64,
    scales: Option<&'a CudaSlice<f32>>,
}

impl<'a> KvB<'a> {
    /// `kv_b` on `g`'s stream; `op` names the operation in the refusal of an MXFP4 one.
    pub(crate) fn of(g: &Gpu, kv_b: &'a GpuMat, op: &str) -> Result<Self, CudaError> {
        let (w, scales) = match &kv_b.data {
            GpuMatData::Int8 { q: w, scales } => (w.device_ptr(g.stream()).0, Some(scales)),
            GpuMatData::F32(w) => (w.device_ptr(g.stream()).0, None),
            GpuMatData::Mxfp4 { .. } => {
                return Err(CudaError::Shape(format!("{op}: an MXFP4 kv_b_proj is not supported")))
            }
        };
        Ok(Self { w, scales })
    }

    /// Whether the kernels' int8 form takes it (else the f32 form).
    pub(crate) fn int8(&self) -> bool {
        self.scales.is_some()
    }

    /// Pushes the weights, then the row scales when int8, onto a launch's arguments.
    pub(crate) fn push<'b>(&'b self, b: &mut LaunchArgs<'b>) {
        b.arg(&self.w);
        if let Some(sc) = self.scales {
            b.arg(sc);
        }
    }
}

impl Gpu {
    /// RoPE in place on `n_vec` vectors of `x` (vector stride `stride`, rotary part at
    /// `offset`), with `cs = [cos[half], sin[half]]` for the position computed on the host
    /// (YaRN attention factor already applied); pairs `(2i, 2i+1)` when `interleaved`, else
    /// `(i, i + half)`. The same arithmetic as the CPU's `RotaryEmbedding::apply`.
    ///
    /// # Errors
    /// `Shape` when the vectors do not fit in `x`; a driver error.
    pub fn rope(
        &self,
        x: &mut GpuBuf,
        n_vec: usize,
        stride: usize,
        offset: usize,
        cs: &GpuBuf,
        interleaved: bool,
    ) -> Result<(), CudaError> {
        let half = cs.len() / 2;
        if half == 0 || n_vec == 0 || offset + 2 * half > stride || n_vec * stride > x.len() {
            return Err(CudaError::Shape(format!(
                "rope: {n_vec} vectors of stride {stride} (rotary {} at {offset}) in {} elements",
                2 * half,
                x.len()
            )));
        }
        let (n, st, off, hf, il) = (
            n_vec as i32,
            stride as i32,
            offset as i32,
            half as i32,
            interleaved as i32,
        );
        let mut b = self.stream().launch_builder(self.k.get("rope_apply")?);
        b.arg(x).arg(&n).arg(&st).arg(&off).arg(cs).arg(&hf).arg(&il);
        // SAFETY: matches `rope_apply` in ops.cu; the extents were checked above.
        unsafe { b.launch(LaunchConfig::for_num_elems((n_vec * half) as u32)) }.ctx("launch rope_apply")?;
        Ok(())
    }

    /// MLA decode of one token over `t` cached positions (weight-absorbed form, DeepSeek-V2
    /// §2.1): `q: [n_heads, nope + rope]` (rope part rotated, or rotated by the kernel with
    /// `rope_cs = Some(([cos[rope/2], sin[rope/2]], interleaved))`: [`Gpu::rope`]'s arithmetic),
    /// `ckv: [>= t, kv_lora_rank]` (with `pos_dev`, the kernel reads `t - 1` from that device
    /// int instead: a captured graph then serves every position up to what `scores` was sized
    /// for), `kpe: [>= t, rope]`, `kv_b`: `kv_b_proj [n_heads * (nope + v_head_dim),
    /// kv_lora_rank]` (int8 or f32), `scores`: zeroed scratch of at least
    /// [`MlaShape::scratch_len`]`(t)` floats (size it for the most positions a captured graph
    /// will see), `out: [n_heads * v_head_dim]`. The positions are split in blocks of
    /// [`MLA_SPLIT`] (flash-decoding) and the splits combined in order: the bits depend on `t`
    /// only.
    ///
    /// # Errors
    /// `Shape` for inconsistent lengths or an MXFP4 `kv_b`; a driver error.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_decode(
        &self,
        s: MlaShape,
        q: &GpuBuf,
        ckv: &GpuBuf,
        kpe: &GpuBuf,
        kv_b: &GpuMat,
        t: usize,
        softmax_scale: f32,
        rope_cs: Option<(&GpuBuf, bool)>,
        pos_dev: Option<&CudaSlice<i32>>,
        scores: &mut GpuBuf,
        out: &mut GpuBuf,
    ) -> Result<(), CudaError> {
        let kvl = s.kv_lora_rank;
        let ok = t > 0
            && rope_cs.is_none_or(|(cs, _)| cs.len() == s.rope && s.rope.is_multiple_of(2))
            && q.len() == s.n_heads * (s.nope + s.rope)
            && ckv.len() >= t * kvl
            && kpe.len() >= t * s.rope
            && kv_b.rows == s.n_heads * (s.nope + s.v_head_dim)
            && kv_b.cols == kvl
            && scores.len() >= s.scratch_len(t)
            && out.len() == s.n_heads * s.v_head_dim;
        if !ok {
            return Err(CudaError::Shape(format!(
                "mla_decode: operands do not fit {s:?} at {t} positions"
            )));
        }
        // Every split the scratch holds gets a block (those past T only count themselves), so a
        // graph captured with the scratch sized for the cache's capacity serves every position.
        let s_cap = s.splits_in(scores.len()).min(65_535);
        let cfg = LaunchConfig {
            grid_dim: (s.n_heads as u32, s_cap as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((2 * kvl + s.rope + MLA_SPLIT) * 4) as u32,
        };
        let s_cap_i = s_cap as i32;
        let (nope, rope, vd, kvl_i, t_i) = (s.nope as i32, s.rope as i32, s.v_head_dim as i32, kvl as i32, t as i32);
        let null: u64 = 0;
        let cs_ptr = rope_cs.map(|(cs, _)| cs.device_ptr(self.stream()).0).unwrap_or(null);
        let il = rope_cs.is_some_and(|(_, i)| i) as i32;
        let pos_ptr = pos_dev.map(|p| p.device_ptr(self.stream()).0).unwrap_or(null);
        let kvb = KvB::of(self, kv_b, "mla_decode")?;
        let (name, what) = if kvb.int8() {
            ("mla_decode_i8", "launch mla_decode_i8")
        } else {
            ("mla_decode_f32", "launch mla_decode_f32")
        };
        let mut b = self.stream().launch_builder(self.k.get(name)?);
        b.arg(q).arg(ckv).arg(kpe);
        kvb.push(&mut b);
        b.arg(&nope)
            .arg(&rope)
            .arg(&vd)
            .arg(&kvl_i)
            .arg(&t_i)
            .arg(&softmax_scale);
        b.arg(&cs_ptr).arg(&il).arg(&pos_ptr).arg(&s_cap_i).arg(scores).arg(out);
        // SAFETY: matches `mla_decode_i8` / `mla_decode_f32` in ops.cu (the int8 form takes the
        // row scales after the weights); lengths checked above.
        unsafe { b.launch(cfg) }.ctx(what)?;
        Ok(())
    }

    /// Copies `src` into `dst[offset .. offset + src.len()]` on the stream (KV-cache append).
    ///
    /// # Errors
    /// `Shape` when it does not fit; a driver error.
    pub fn copy_into(&self, src: &GpuBuf, dst: &mut GpuBuf, offset: usize) -> Result<(), CudaError> {
        let end = offset + src.len();
        if end > dst.len() {
            return Err(CudaError::Shape(format!(
                "copy_into: {} elements at {offset} past the end of {}",
                src.len(),
                dst.len()
            )));
        }
        let mut view = dst.slice_mut(offset..end);
        self.stream().memcpy_dtod(src, &mut view).ctx("cuMemcpyDtoD")
    }

    /// Makes this device's context current on the calling thread (for work submitted from a
    /// thread pool).
    ///
    /// # Errors
    /// A driver error.
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        self.stream().context().bind_to_thread().ctx("cuCtxSetCurrent")
    }
}
